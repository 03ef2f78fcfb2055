"""In-place recovery under real torchrun: the ranks that did not fail keep their processes; a supervisor replaces
the failed one; all roll back to the newest cut every rank can restore (here from the memory tier) and go on.

Every case must end with final weights bitwise equal to an uninterrupted run, with torchrun never restarting
the group (``--max-restarts 0``: a restart would fail the run), and the work redone bounded by the memory tier's
interval plus the pipeline depth (plus one interval when the newest memory save was still being written).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("ft_worker.py")
TOTAL, EVERY, MEMORY_EVERY, DEPTH = 48, 8, 4, 4


def torchrun(tmp: Path, faults: str = "", *extra: str, timeout: float = 240,
             environ: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts=0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.5",
           str(WORKER), "--ckpt", str(tmp / "ckpt"), "--total", str(TOTAL), "--every", str(EVERY),
           "--memory-every", str(MEMORY_EVERY), "--out", str(out), "--sleep-ms", "5", "--timeout", "8", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PIPEDREAM_FT_FAULTS=faults, PIPEDREAM_FT_RECOVERY="in-place",
               **(environ or {}))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout), out


def torchrun_watched(tmp: Path, faults: str, *extra: str, on_line=None, timeout: float = 240
                     ) -> tuple[subprocess.CompletedProcess, Path, list[tuple[float, str]]]:
    """:func:`torchrun`, reading the output as it comes: every line with the time it came (``time.monotonic``),
    and ``on_line(line)`` called for each."""
    out = tmp / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts=0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.5",
           str(WORKER), "--ckpt", str(tmp / "ckpt"), "--total", str(TOTAL), "--every", str(EVERY),
           "--memory-every", str(MEMORY_EVERY), "--out", str(out), "--sleep-ms", "5", "--timeout", "8", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PIPEDREAM_FT_FAULTS=faults, PIPEDREAM_FT_RECOVERY="in-place")
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line))
            if on_line is not None:
                on_line(line)
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(line for _, line in lines)
    return subprocess.CompletedProcess(cmd, proc.returncode, text, ""), out, lines


def summary(proc: subprocess.CompletedProcess, out: Path) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    info = json.loads(Path(str(out) + ".json").read_text())
    info["log"] = proc.stdout + proc.stderr
    return info


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> tuple[dict[str, torch.Tensor], dict]:
    """An uninterrupted run, which must never recover or restart (a clean run stays clean): its final weights
    and rank 0's summary."""
    tmp = tmp_path_factory.mktemp("reference")
    info = summary(*torchrun(tmp))
    assert info["recoveries"] == [] and info["attempt"] == 0 and info["incarnation"] == 0
    assert "recovering" not in info["log"] and "replacement" not in info["log"], info["log"][-3000:]
    assert info["start"] == 0 and len(info["losses"]) == TOTAL
    return torch.load(tmp / "final.pt"), info


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[str, torch.Tensor]:
    return reference_run[0]


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
    # tagged together: neither fires before the other is reached (else the first loss is noticed and recovered
    # from before the other rank gets to its step)
    "two failures at once": ("kill@rank=1,step=21,together=a;kill@rank=3,step=21,together=a", 21, 2,
                             "starting replacement 1"),
    "a failure while the group forms again": ("kill@rank=2,step=21;rejoin@rank=1,step=0,attempt=1", 21, 2,
                                              "injecting fault rejoin"),
    "a second failure after the recovery": ("kill@rank=2,step=17;kill@rank=0,step=33,attempt=1", 33, 2,
                                            "starting replacement 1"),
    # before the memory tier's first cut (4): the group goes back to the start, which every rank keeps as a cut
    "a crash before the first checkpoint": ("kill@rank=2,step=3", 3, 1, "continuing from checkpoint 0"),
    # after its last minibatch, while the ranks that finished first wait in the call's closing gather of the losses:
    # they recover like ranks still training (they were failing and being replaced themselves)
    "a failure while the others gather the losses": ("drained@rank=1,step=0", TOTAL, 1, "injecting fault drained"),
    # its part of the last durable checkpoint never lands: the replacement writes it from the restored cut, or the
    # commit (and the run) would fail; the others may still be gathering the losses or already finishing
    "a crash while writing the last checkpoint": (f"ckpt_crash@rank=1,step={TOTAL}", TOTAL, 1,
                                                  "injecting fault ckpt_crash"),
    # every rank has gathered the losses and waits for the last checkpoint to commit, when one dies: no collective
    # fails, yet the others recover at once rather than wait out the commit timeout (and be replaced themselves)
    "a failure while the others finish the last checkpoint": ("finishing@rank=1,step=0", TOTAL, 1,
                                                              f"checkpoint {TOTAL} was being finished; recovering"),
}


def test_a_meta_built_job_is_replaced_in_place_bitwise(tmp_path, reference):
    """Built on the meta device, each process materialising and seeding its own stage: a rank killed mid-run is
    replaced by a process that builds on meta again and restores its stage from the memory tier, and the run ends
    where an uninterrupted meta-built run ends, bitwise."""
    uninterrupted = summary(*torchrun(tmp_path / "straight", "", "--meta"))
    assert uninterrupted["recoveries"] == [] and len(uninterrupted["losses"]) == TOTAL
    proc, out = torchrun(tmp_path / "killed", "kill@rank=2,step=21", "--meta")
    info = summary(proc, out)
    assert "starting replacement 1" in info["log"] and len(info["recoveries"]) == 1, info["log"][-3000:]
    straight = torch.load(tmp_path / "straight" / "final.pt")
    assert_bitwise(out, straight)
    assert any(not torch.equal(straight[k], v) for k, v in reference.items())  # seeded per layer, not mlp()'s init


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
        assert cuts and all(0 <= c <= failed_at for c in cuts), cuts
        assert cuts[-1] >= failed_at - (2 * MEMORY_EVERY + DEPTH), (cuts, log[-4000:])


def test_a_zero_bubble_pipeline_recovers_in_place_bitwise(tmp_path):
    """Flush mode under ZB-H1 (split backwards, deferred weight gradients): a rank killed mid-window is replaced,
    the group rolls back to the last window boundary and the result is the uninterrupted ZB-H1 run's, bitwise."""
    zb = ("--mode", "flush", "--schedule", "zb_h1")
    (tmp_path / "straight").mkdir()
    summary(*torchrun(tmp_path / "straight", "", *zb))
    want = torch.load(tmp_path / "straight" / "final.pt")
    info = summary(*torchrun(tmp_path, "kill@rank=1,step=22", *zb))
    assert info["log"].count("starting replacement") == 1 and "recovering in place" in info["log"], info["log"][-4000:]
    assert info["attempt"] == 0
    assert_bitwise(tmp_path / "final.pt", want)


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
    lines = {l.split(" (tracebacks in ")[0] for l in log.splitlines() if l.startswith("pipedream-ft:")}
    assert lines == {"pipedream-ft: error: rank 0: data source EndingSource ended after 22 minibatches "
                     "(minibatch 22 was needed)"}, log[-4000:]  # the same line from every rank
    assert "exitcode  : 2" in log and "pipedream_ft/" not in log, log[-4000:]  # no traceback from the library


@pytest.mark.parametrize("rank", [3, 0])
def test_a_replaced_process_reports_the_whole_loss_history_and_no_metrics_line_is_lost(reference_run, tmp_path,
                                                                                       rank):
    """The last stage's process (rank 3: it computes the losses) or the reporting one (rank 0: it writes the
    summary) is killed and replaced: every rank's result still starts at minibatch 0 and holds every
    minibatch's loss, equal to the uninterrupted run's (the replacement restores its call's losses with its
    checkpoint part, instead of reporting the cut's loss as minibatch 0's); and the killed process's metrics
    lines are all in the file (they were buffered in the process and lost with it)."""
    _, want = reference_run
    metrics = tmp_path / "metrics"
    info = summary(*torchrun(tmp_path, f"kill@rank={rank},step=21", environ={"PIPEDREAM_FT_METRICS_DIR": str(metrics)}))
    log = info["log"]
    assert log.count("starting replacement") == 1 and "recovering in place" in log, log[-4000:]
    assert info["incarnation"] == (1 if rank == 0 else 0)  # the summary is the replacement's when rank 0 died
    assert info["start"] == 0 and len(info["losses"]) == TOTAL, (info["start"], len(info["losses"]))
    assert info["losses"] == want["losses"]
    for r in range(4):
        lines = (metrics / f"metrics-rank{r}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]  # every line whole
        updates = {rec["update"] for rec in records}
        assert updates == set(range(TOTAL)), (r, sorted(set(range(TOTAL)) - updates))
        if r == 3:  # the losses the metrics report are the run's too (a redone minibatch twice, the same)
            losses = {rec["minibatches"] - 1: rec["loss"] for rec in records}
            assert [losses[b] for b in range(TOTAL)] == want["losses"]


def _processes(out: Path) -> dict[int, list[int]]:
    """The pids of every training process that got as far as training, by rank (ft_worker's ``.ranks`` file)."""
    pids: dict[int, list[int]] = {}
    for line in Path(str(out) + ".ranks").read_text().splitlines():
        row = json.loads(line)
        pids.setdefault(row["rank"], []).append(row["pid"])
    return pids


def test_a_replacement_that_dies_while_the_group_connects_is_the_only_process_replaced(reference, tmp_path):
    """Rank 2 is killed; its replacement dies too, as the others wait for it to connect the new epoch's groups.
    The others must not wait out their timeout in the connection (and then crash), nor look silent meanwhile
    (their heartbeats must not queue behind that wait): only rank 2 is replaced, twice; nobody is evicted. With a
    60 s timeout, the recovery cannot have waited for the dead replacement's connection."""
    proc, out, lines = torchrun_watched(tmp_path, "kill@rank=2,step=21;connect@rank=2,step=0,attempt=1",
                                        "--timeout", "60")
    info = summary(proc, out)
    log = info["log"]
    killed = next(t for t, line in lines if "injecting fault kill" in line)
    recovered = [t for t, line in lines if line.startswith("pipedream-ft: recovered in place")][-1]
    assert recovered - killed < 30, (recovered - killed, log[-4000:])  # the connection's timeout alone is 60 s
    assert "injecting fault connect" in log, log[-4000:]
    died = re.findall(r"rank (\d+): training process died", log)
    assert died == ["2", "2"], log[-6000:]
    assert "stopped beating" not in log and "stopped answering" not in log and "evicted" not in log, log[-6000:]
    pids = _processes(tmp_path / "final.pt")
    assert {r: len(p) for r, p in pids.items()} == {0: 1, 1: 1, 2: 2, 3: 1}, pids  # the others kept their process
    assert_bitwise(tmp_path / "final.pt", reference)


def test_a_hung_rank_is_found_by_its_heartbeat_whatever_the_timeout(reference, tmp_path):
    """A SIGSTOPped rank with a 60 s operation timeout: the peers' heartbeat watch evicts it within about a second
    (its supervisor kills it, every rank fails over at once), so the recovery cannot have waited for the
    timeout."""
    proc, out, lines = torchrun_watched(tmp_path, "hang@rank=3,step=21", "--timeout", "60")
    info = summary(proc, out)
    log = info["log"]
    assert re.search(r"rank 3 \(process 0\) stopped beating", log), log[-4000:]
    assert re.findall(r"rank (\d+): training process died", log) == ["3"], log[-6000:]
    assert_bitwise(out, reference)
    hung = next(t for t, line in lines if "injecting fault hang" in line)
    recovered = next(t for t, line in lines if line.startswith("pipedream-ft: recovered in place"))
    assert recovered - hung < 30, (recovered - hung, log[-4000:])  # an operation's timeout alone is 60 s


def test_a_replacement_killed_again_soon_after_is_the_only_process_replaced(reference, tmp_path):
    """The issue's double kill, from outside: rank 2 is killed at minibatch 21 and its replacement 0.4 s after it
    was started, wherever the others are then (forming, restoring, connecting, training). Only rank 2 is replaced;
    the others keep their processes; the weights are the uninterrupted run's. Each minibatch sleeps 40 ms (the
    weights do not depend on it), so that the minibatches left after the cut take well over 0.4 s: on an idle
    machine the run used to finish first, and the kill hit the processes' last collective, outside training."""
    killed: list[int] = []

    def on_line(line: str) -> None:
        if "rank 2: training process died" in line and "starting replacement 1" in line and not killed:
            deadline = time.monotonic() + 30
            pid = None
            while pid is None and time.monotonic() < deadline:  # the supervisor has forked it, or is about to
                pid = _newest_child_of_rank(tmp_path, 2)
                time.sleep(0.005)
            assert pid is not None, "no replacement process found"
            time.sleep(0.4)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    proc, out, _ = torchrun_watched(tmp_path, "kill@rank=2,step=21", "--sleep-ms", "40", on_line=on_line)
    info = summary(proc, out)
    log = info["log"]
    assert killed, log[-4000:]
    assert re.findall(r"rank (\d+): training process died", log) == ["2", "2"], log[-6000:]
    assert "stopped beating" not in log and "stopped answering" not in log, log[-6000:]
    pids = _processes(out)
    assert all(len(pids[r]) == 1 for r in (0, 1, 3)), pids  # the others kept their process
    assert_bitwise(out, reference)


def _newest_child_of_rank(tmp: Path, rank: int) -> int | None:
    """The newest process that rank ``rank``'s supervisor (the torchrun worker running ft_worker.py for ``tmp``)
    has forked, from ``/proc``; ``None`` if it has none now."""
    procs: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            environ = Path(f"/proc/{entry}/environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if str(WORKER) in cmdline and str(tmp / "final.pt") in cmdline and f"RANK={rank}" in environ:
            procs[int(entry)] = (int(stat[1]), float(stat[19]))  # parent, start time
    children = [(start, pid) for pid, (ppid, start) in procs.items() if ppid in procs]
    return max(children)[1] if children else None
