"""In-place recovery under real torchrun: the ranks that did not fail keep their processes; a supervisor replaces
the failed one; all roll back to the newest cut every rank can restore (here from the memory tier) and go on.

Every case must end with final weights bitwise equal to an uninterrupted run, with torchrun never restarting
the group (``--max-restarts 0``: a restart would fail the run), and the work redone bounded by the memory tier's
interval plus the pipeline depth (plus one interval when the newest memory save was still being written).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("ft_worker.py")
TOTAL, EVERY, MEMORY_EVERY, DEPTH = 48, 8, 4, 4


def torchrun(tmp: Path, faults: str = "", *extra: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts=0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.5",
           str(WORKER), "--ckpt", str(tmp / "ckpt"), "--total", str(TOTAL), "--every", str(EVERY),
           "--memory-every", str(MEMORY_EVERY), "--out", str(out), "--sleep-ms", "5", "--timeout", "8", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PIPEDREAM_FT_FAULTS=faults, PIPEDREAM_FT_RECOVERY="in-place")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout), out


def summary(proc: subprocess.CompletedProcess, out: Path) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    info = json.loads(Path(str(out) + ".json").read_text())
    info["log"] = proc.stdout + proc.stderr
    return info


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """An uninterrupted run, which must never recover or restart (a clean run stays clean)."""
    tmp = tmp_path_factory.mktemp("reference")
    info = summary(*torchrun(tmp))
    assert info["recoveries"] == [] and info["attempt"] == 0 and info["incarnation"] == 0
    assert "recovering" not in info["log"] and "replacement" not in info["log"], info["log"][-3000:]
    return torch.load(tmp / "final.pt")


def assert_bitwise(out: Path, reference: dict[str, torch.Tensor]) -> None:
    got = torch.load(out)
    assert sorted(got) == sorted(reference)
    for k, v in reference.items():
        assert torch.equal(got[k], v), f"{k} differs from the uninterrupted run"


CASES = {
    # name: (faults, minibatch of the failure, replaced ranks, text the output must show)
    "kill -9": ("kill@rank=2,step=21", 21, 1, "starting replacement 1"),
    "exception in user code": ("exception@rank=1,step=13", 13, 1, "injected fault"),
    "SIGSTOP: evicted and replaced": ("hang@rank=3,step=21", 21, 1, "stopped answering"),
    "two failures at once": ("kill@rank=1,step=21;kill@rank=3,step=21", 21, 2, "starting replacement 1"),
    "a failure while the group forms again": ("kill@rank=2,step=21;rejoin@rank=1,step=0,attempt=1", 21, 2,
                                              "injecting fault rejoin"),
    "a second failure after the recovery": ("kill@rank=2,step=17;kill@rank=0,step=33,attempt=1", 33, 2,
                                            "starting replacement 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_in_place_recovery(case, reference, tmp_path):
    faults, failed_at, replaced, text = CASES[case]
    info = summary(*torchrun(tmp_path, faults))
    log = info["log"]
    assert text in log, log[-4000:]
    assert "recovering in place" in log
    assert log.count("starting replacement") == replaced, log[-4000:]
    assert_bitwise(tmp_path / "final.pt", reference)
    assert info["attempt"] == 0  # torchrun never restarted the group
    if info["incarnation"] == 0:  # rank 0 survived: its record of the recoveries it took part in
        cuts = [r["cut"] for r in info["recoveries"]]
        # a cut due while the previous save of its tier was still being written is taken at a later minibatch
        # (the policy stretches the interval), so cuts need not be multiples of the intervals
        assert cuts and all(0 < c <= failed_at for c in cuts), cuts
        assert cuts[-1] >= failed_at - (2 * MEMORY_EVERY + DEPTH), (cuts, log[-4000:])


def test_sigterm_commits_an_emergency_checkpoint_and_every_process_is_replaced_in_place(reference, tmp_path):
    info = summary(*torchrun(tmp_path, "term@rank=1,step=19"))
    log = info["log"]
    assert "preempted: checkpoint" in log, log[-4000:]
    assert info["attempt"] == 0  # no torchrun restart was used up
    assert log.count("starting replacement 1") == 4  # every rank stopped at the emergency cut
    assert_bitwise(tmp_path / "final.pt", reference)


def test_a_replacement_with_another_plan_stops_the_job_with_one_line(tmp_path):
    proc, _ = torchrun(tmp_path, "kill@rank=2,step=21", "--odd-replacement", timeout=200)
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    lines = [l for l in log.splitlines() if "run another plan" in l]
    assert lines, log[-4000:]
    assert len({l.split(": ", 2)[-1] for l in lines}) == 1  # the same message on every rank


def test_a_source_that_ends_stops_every_rank_with_one_line(tmp_path):
    """An error that any recovery would meet again (stage 0's data source ends mid-run) is not recovered from:
    every rank stops at once with the set-up exit status and the log holds one line for it."""
    proc, _ = torchrun(tmp_path, "", "--source-ends", "22")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    lines = [l for l in log.splitlines() if l.startswith("pipedream-ft:")]
    assert lines == ["pipedream-ft: error: data source EndingSource ended after 22 minibatches "
                     "(minibatch 22 was needed)"], log[-4000:]
    assert "exitcode  : 2" in log and "pipedream_ft/" not in log, log[-4000:]  # no traceback from the library
