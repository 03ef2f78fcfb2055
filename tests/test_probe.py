"""``pipedream-probe`` on real gloo processes: what it measures, what it writes, and peers that never come."""

from __future__ import annotations

import json
import math
import os
import time

import pytest

from dist_helpers import run_world
from partitioner.machine import MachineProfile, load_machine
from profiler.cliutil import CliError

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

_FAST = dict(repeats=3, large_bytes=1 << 16, minibatches=12, timeout_s=20.0)


def _probe(levels, fast):
    from pipedream_ft.probe import ProbeSettings, probe

    return probe(levels, ProbeSettings(**fast)).to_json()


def _probe_or_absent(absent: int, fast):
    """Rank ``absent`` never joins (it waits, then leaves); every other rank probes."""
    if int(os.environ["RANK"]) == absent:
        time.sleep(fast["timeout_s"] + 3)
        return "absent"
    from pipedream_ft.probe import ProbeSettings, probe

    return probe(None, ProbeSettings(**fast)).to_json()


def _cli(path: str, extra: list[str]):
    from pipedream_ft.probe import main

    return main(["-o", path, "--repeats", "3", "--large-bytes", "65536", "--minibatches", "12",
                 "--timeout", "20", *extra])


def test_probe_measures_two_levels_on_four_ranks():
    out = run_world(_probe, 4, [2, 2], _FAST, timeout=150)
    docs = [out[r][1] for r in range(4)]
    assert all(d == docs[0] for d in docs[1:]) or all(d["levels"] == docs[0]["levels"] for d in docs)
    m = MachineProfile.from_json(json.loads(json.dumps(docs[0])))
    assert m.workers == [2, 2]
    for lv in m.levels:
        assert 0 < lv.latency_s < 0.05 and 1e6 < lv.bandwidth and math.isfinite(lv.bandwidth)
        assert lv.allreduce_latency_s >= 0 and lv.allreduce_bandwidth > 0
    # the runtime's fixed cost was measured through the trainer, on every stage of a 4-stage pipeline
    rt = m.samples["runtime"]
    assert [r["stage"] for r in rt["stages"]] == [0, 1, 2, 3]
    assert len(m.stage_overhead_s) == 4 and 1e-5 < m.overhead_s < 0.05
    assert all(r["wall_s"] >= r["busy_s"] > 0 for r in rt["stages"])
    # its floors, measured beside it on every stage: the same messages alone, a plain loop of the stage's layer
    assert len(rt["messages"]) == len(rt["plain"]) == 4
    assert all(0 < c < 0.05 for c in rt["messages"] + rt["plain"])
    # per level: a small and a large ping-pong; all-reduce for groups of 2 at each level
    assert sorted((s["level"], s["bytes"]) for s in m.samples["p2p"]) == [(0, 64), (0, 65536), (1, 64), (1, 65536)]
    assert {(s["level"], s["replicas"]) for s in m.samples["allreduce"]} == {(0, 2), (1, 2)}
    assert m.cores and m.cores >= 1


def test_absent_peer_is_named_on_every_rank():
    fast = dict(_FAST, timeout_s=4.0)
    t0 = time.monotonic()
    out = run_world(_probe_or_absent, 4, 3, fast, timeout=90, expect_failure=True)
    assert time.monotonic() - t0 < 60
    for r in range(3):
        ok, err = out[r]
        assert not ok and err[0] == "CliError", out[r]
        assert err[1] == f"rank {r}: no answer from rank 3 within 4 s", err[1]
        assert "\n" not in err[1]
    assert out[3] == (True, "absent")


def test_absent_store_host_is_named():
    fast = dict(_FAST, timeout_s=3.0)
    out = run_world(_probe_or_absent, 3, 0, fast, timeout=90, expect_failure=True)
    for r in (1, 2):
        ok, err = out[r]
        assert not ok and err[0] == "CliError"
        assert err[1].startswith(f"rank {r}: cannot reach rank 0's store at 127.0.0.1:") and "within 3 s" in err[1]


def test_cli_writes_the_profile_and_fails_in_one_line(tmp_path, capsys):
    path = str(tmp_path / "machine.json")
    out = run_world(_cli, 2, path, ["--no-runtime"], timeout=90)
    assert [out[r][1] for r in range(2)] == [0, 0]
    m = load_machine(path)
    assert m.workers == [2] and m.overhead_s == 0.0 and m.samples["runtime"] is None
    # a hierarchy that does not multiply to the world: one line, status 2, on every rank, nothing written
    bad = str(tmp_path / "bad.json")
    out = run_world(_cli, 2, bad, ["--workers", "3"], timeout=60)
    assert [out[r][1] for r in range(2)] == [2, 2]
    assert not os.path.exists(bad)


def test_levels_of():
    from pipedream_ft.probe import levels_of

    assert levels_of(8, 4, None) == [4, 2]
    assert levels_of(4, 4, None) == [4]
    assert levels_of(4, None, None) == [4]
    assert levels_of(8, 4, [2, 4]) == [2, 4]
    with pytest.raises(CliError, match="= 6 workers, but the world has 8"):
        levels_of(8, 4, [2, 3])
    with pytest.raises(CliError, match="not a multiple"):
        levels_of(6, 4, None)
