"""``pipedream-pool simulate``: its JSON, its pictures, and one line with exit 2 on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipedream_ft.pool.cli import main
from pipedream_ft.pool.plot import device_segments
from pipedream_ft.pool.simulator import JobRecord

from pool_helpers import write_chain_profile, write_workload

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup(tmp_path):
    d = tmp_path / "profiles"
    d.mkdir()
    write_chain_profile(d / "m.graph.txt")
    w = write_workload(tmp_path / "w.csv", ["a,0,m,2,300", "b,10,m,1,200", "c,20,m,4,100"])
    return tmp_path, d, w


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_simulate_writes_the_json_keys_scripts_read(setup, capsys) -> None:
    tmp, d, w = setup
    out = tmp / "out.json"
    rc, said, _ = _run(["simulate", "--workload", str(w), "--profiles", str(d), "--devices", "4", "--resize-cost",
                        "0", "--json", str(out), "--cache", str(tmp / "cache")], capsys)
    assert rc == 0 and "goodput" in said
    res = json.loads(out.read_text())["policies"]
    assert list(res) == ["fifo", "elastic-fifo", "round-robin", "tiresias", "goodput"]
    for r in res.values():
        assert {"avg_jct", "p50_jct", "p99_jct", "makespan", "avg_queue", "utilization", "resizes", "preemptions",
                "jobs"} <= set(r)
        assert 0 < r["utilization"] <= 1
        for j in r["jobs"]:
            assert {"name", "arrival", "start", "finish", "allocations"} <= set(j)
    for j in res["fifo"]["jobs"]:  # rigid fifo, free resizes: each job runs its trace duration
        assert j["finish"] - j["start"] == pytest.approx({"a": 300, "b": 200, "c": 100}[j["name"]])


def test_switch_and_plot(setup, capsys) -> None:
    tmp, d, w = setup
    out = tmp / "out.json"
    rc, said, err = _run(["simulate", "--workload", str(w), "--profiles", str(d), "--devices", "4", "--policy",
                          "fifo", "--switch", "60:goodput", "--json", str(out), "--plot", str(tmp / "fig"),
                          "--cache", str(tmp / "cache")], capsys)
    assert rc == 0, err
    assert list(json.loads(out.read_text())["policies"]) == ["fifo>60:goodput"]
    pngs = sorted(p.name for p in (tmp / "fig").iterdir())
    assert pngs == ["gantt-fifo>60_goodput.png", "jct-cdf.png"]
    assert (tmp / "fig" / "jct-cdf.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, said", [
    (["--devices", "0"], "--devices"),
    (["--policy", "lifo"], "unknown policy 'lifo'"),
    (["--switch", "soon:goodput"], "--switch must be TIME:POLICY"),
    (["--devices", "2"], "line 4 (c): workers 4 is above the pool's 2 devices"),
])
def test_bad_input_is_one_line_and_exit_2(setup, capsys, args: list[str], said: str) -> None:
    tmp, d, w = setup
    base = ["simulate", "--workload", str(w), "--profiles", str(d), "--devices", "4", "--cache", str(tmp / "c")]
    rc, _, err = _run(base + args, capsys)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("pipedream-pool: error: ") and said in err


def test_the_command_as_a_process_refuses_an_unknown_model_in_one_line(setup) -> None:
    tmp, d, _ = setup
    w = write_workload(tmp / "bad.csv", ["ok-0,0,m,1,100", "bad-1,5,no_such_model,1,100"])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIPEDREAM_POOL_CACHE": str(tmp / "c")}
    r = subprocess.run([sys.executable, "-m", "pipedream_ft.pool", "simulate", "--workload", str(w), "--profiles",
                        str(d), "--devices", "4"], capture_output=True, text=True, env=env, timeout=100)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"pipedream-pool: error: workload {w} line 3 (bad-1): unknown model 'no_such_model' "
        "(no no_such_model.graph.txt or no_such_model.json among the profiles)"]


def test_gantt_places_each_job_on_devices_it_keeps_when_it_shrinks() -> None:
    a = JobRecord("a", "m", 0, 1, start=0, finish=100, allocations=[[0, 3], [50, 1]])
    b = JobRecord("b", "m", 50, 1, start=50, finish=80, allocations=[[50, 2]])
    segs = device_segments([a, b], 3)
    assert segs == [[(0, 100, 0)], [(0, 50, 0), (50, 80, 1)], [(0, 50, 0), (50, 80, 1)]]
