"""The fault-injection suite: real torchrun, 4 gloo ranks, faults injected by rank and step.

Every case must end with final weights bitwise equal to an uninterrupted run, having redone no more work
than the checkpoint interval plus the pipeline depth (or, when the newest checkpoint is lost, the interval
before it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port
from s3server import seaweed_s3  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow]

WORKER = Path(__file__).with_name("ft_worker.py")
TOTAL, EVERY, DEPTH = 48, 8, 4


def torchrun_command(ckpt: str, out: Path, *, sleep_ms: float = 5.0, restarts: int = 3,
                     storage_options: dict | None = None, rdzv_id: str | None = None,
                     extra: tuple[str, ...] = (), timeout_s: float = 8) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", f"--max-restarts={restarts}",
           "--run-path", "--start-method", "fork",  # as the README advises for restarts: no fresh import of torch
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.5",
           *(["--rdzv-id", rdzv_id] if rdzv_id else []),
           str(WORKER), "--ckpt", ckpt, "--total", str(TOTAL), "--every", str(EVERY), "--out", str(out),
           "--sleep-ms", str(sleep_ms), "--timeout", f"{timeout_s:g}", *extra]
    if storage_options:
        cmd += ["--storage-options", json.dumps(storage_options)]
    return cmd


def torchrun_env(faults: str = "") -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PIPEDREAM_FT_FAULTS=faults, PIPEDREAM_FT_RECOVERY="restart")


def torchrun(ckpt: str, out: Path, faults: str = "", *, sleep_ms: float = 5.0, restarts: int = 3,
             storage_options: dict | None = None, timeout: float = 240, extra: tuple[str, ...] = (),
             peer_timeout_s: float = 8) -> subprocess.CompletedProcess:
    cmd = torchrun_command(ckpt, out, sleep_ms=sleep_ms, restarts=restarts, storage_options=storage_options,
                           extra=extra, timeout_s=peer_timeout_s)
    return subprocess.run(cmd, env=torchrun_env(faults), capture_output=True, text=True, timeout=timeout)


def finished(proc: subprocess.CompletedProcess, out: Path) -> dict:
    """The run's summary, with ``resumed_from`` of the first attempt that resumed (the recovery under test)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    info = json.loads(Path(str(out) + ".json").read_text())
    attempts = [json.loads(l) for l in Path(str(out) + ".attempts").read_text().splitlines()]
    resumed = [a["resumed_from"] for a in attempts if a["resumed_from"] is not None]
    info["resumed_from"] = resumed[0] if resumed else None
    return info


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    d = tmp_path_factory.mktemp("reference")
    proc = torchrun(str(d / "ckpt"), d / "final.pt", sleep_ms=0)
    info = finished(proc, d / "final.pt")
    assert info["resumed_from"] is None and info["attempt"] == 0
    return torch.load(d / "final.pt")


def assert_bitwise(out: Path, reference: dict[str, torch.Tensor]) -> None:
    got = torch.load(out)
    assert sorted(got) == sorted(reference)
    for k, v in reference.items():
        assert torch.equal(got[k], v), f"{k} differs from the uninterrupted run"


LOCAL_CASES = {
    # name: (faults, minibatch of the (last) failure, text the output must show)
    "kill -9 mid-step": ("kill@rank=2,step=21", 21, "redoing"),
    "exception in user code": ("exception@rank=1,step=13", 13, "injected fault"),
    "SIGSTOP, watchdog/timeouts": ("hang@rank=3,step=21", 21, "timed out"),
    "SIGTERM, emergency save": ("term@rank=1,step=19", None, "preempted: checkpoint"),
    "crash while writing a checkpoint": ("ckpt_crash@rank=2,step=24", 24, "ckpt_crash"),
    "corrupted checkpoint file": ("corrupt@rank=1,step=24", None, "is not usable"),
    "two failures, the second during recovery": ("kill@rank=2,step=21;exception@rank=0,step=18,attempt=1", 18,
                                                "attempt 2"),
}


def assert_redone_within_bound(resumed: int | None, failed_at: int, log: str = "") -> None:
    """Resumed from a checkpoint at most the interval plus the pipeline depth before the failure (the newest
    one, unless the failure hit while it was still being written: then the one before, which for a failure
    in the second interval is the start: ``None``, nothing to resume). A checkpoint the policy deferred
    (storage behind) is taken at a later cut, so cuts need not be multiples of the interval."""
    resumed = 0 if resumed is None else resumed
    assert resumed <= failed_at, (resumed, log[-6000:])
    newest_possible = failed_at - failed_at % EVERY
    assert resumed >= newest_possible - EVERY, (resumed, failed_at, log[-6000:])


def assert_resumed_before_the_crashed_cut(resumed: int | None, failed_at: int, log: str) -> None:
    """The part being written when its rank crashed is of the first cut at or after ``failed_at`` (a cut the
    policy deferred while the previous part was still being persisted may come later); that cut never commits,
    so the resume is from an earlier one. How much earlier depends on how far behind storage was (each due cut
    waits for the previous part to be durable), not on the interval."""
    resumed = 0 if resumed is None else resumed
    crashed = int(re.search(r"ckpt_crash while writing \S*?step-0*(\d+)", log).group(1))
    assert crashed >= failed_at and resumed < crashed, (crashed, resumed, log[-6000:])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(LOCAL_CASES))
def test_fault_on_local_disk(case, reference, tmp_path):
    faults, failed_at, text = LOCAL_CASES[case]
    out = tmp_path / "final.pt"
    proc = torchrun(str(tmp_path / "ckpt"), out, faults, sleep_ms=20 if "SIGTERM" in case else 5)
    info = finished(proc, out)
    log = proc.stdout + proc.stderr
    assert text in log, log[-4000:]
    assert_bitwise(out, reference)
    if "crash while writing" in case:  # the checkpoint being written is never committed: one before it is used
        assert_resumed_before_the_crashed_cut(info["resumed_from"], failed_at, log)
    elif "corrupt" in case:  # the newest checkpoint was damaged: the one before it is used
        damaged = int(re.search(r"into checkpoint (\d+)", log).group(1))
        assert damaged - 2 * EVERY <= info["resumed_from"] < damaged, (damaged, info["resumed_from"])
        # corrupt-then-continue: the damaged step's commit is retired, and checkpointing goes on past it
        from pipedream_ft.checkpoint import Storage, list_committed

        assert "retired" in log, log[-4000:]
        assert list_committed(Storage(str(tmp_path / "ckpt")))[-1] > damaged, log[-4000:]
    elif "SIGTERM" in case:
        # the emergency checkpoint is taken at the next cut after the notice and nothing is redone
        # (stage 0 is up to DEPTH minibatches ahead of rank 1 and looks for notices every 50 ms)
        assert 19 < info["resumed_from"] <= 19 + DEPTH + 8, (info["resumed_from"], log[-6000:])
        assert "redoing 0 minibatches" in log, log[-3000:]
    else:
        assert_redone_within_bound(info["resumed_from"], failed_at, log)


@pytest.mark.timeout(900)
def test_shared_url_second_job_refused_and_a_taken_over_job_refuses_to_resume(tmp_path):
    """Two jobs started at once on one checkpoint URL: one trains, the other stops at start with one line
    naming the URL and the owner (exit 2), before writing anything. Once the winner ended, the loser (rerun)
    takes the location over and resumes from it, as a rerun does; the winner, rerun under its old job id after
    that, is refused: the checkpoints there are no longer its own."""
    ckpt, linger = str(tmp_path / "ckpt"), tmp_path / "linger"

    def start(job: str) -> subprocess.Popen:
        cmd = torchrun_command(ckpt, tmp_path / f"{job}.pt", restarts=0, rdzv_id=job, extra=("--linger", str(linger)))
        return subprocess.Popen(cmd, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    jobs = {job: start(job) for job in ("job-a", "job-b")}
    try:
        deadline = time.monotonic() + 600
        while all(p.poll() is None for p in jobs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        losers = [job for job, p in jobs.items() if p.poll() is not None]
        assert len(losers) == 1, "neither job stopped at start"
        loser = losers[0]
        winner = next(job for job in jobs if job != loser)
        loser_log = jobs[loser].communicate(timeout=60)[0]
        assert jobs[loser].returncode != 0 and re.search(r"exitcode\s*:\s*2", loser_log), loser_log[-4000:]
        lines = [l for l in loser_log.splitlines() if l.startswith("pipedream-ft: error:")]
        assert len(set(lines)) == 1 and ckpt in lines[0] and f"in use by job run-{winner}" in lines[0], loser_log[-4000:]
    finally:
        linger.touch()
    winner_log = jobs[winner].communicate(timeout=300)[0]
    assert jobs[winner].returncode == 0, winner_log[-4000:]

    rerun = subprocess.run(torchrun_command(ckpt, tmp_path / "rerun.pt", restarts=0, rdzv_id=loser),
                           env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    assert f"taken over from job run-{winner}" in rerun.stdout + rerun.stderr
    again = subprocess.run(torchrun_command(ckpt, tmp_path / "again.pt", restarts=0, rdzv_id=winner),
                           env=torchrun_env(), capture_output=True, text=True, timeout=300)
    log = again.stdout + again.stderr
    assert again.returncode != 0 and f"was taken over by job run-{loser}" in log, log[-4000:]
    assert not Path(str(tmp_path / "again.pt") + ".json").exists()  # it trained on nothing


S3_CASES = {
    "kill -9 mid-step": ("kill@rank=2,step=21", 21),
    "crash while writing a checkpoint": ("ckpt_crash@rank=2,step=24", 24),
}


def run_held_until_storage_caught_up(url: str, out: Path, faults: str, storage_options: dict, at: int,
                                     hold: Path) -> subprocess.CompletedProcess:
    """Run the job with training held at minibatch ``at`` until a checkpoint of the previous interval has
    committed. Cuts due while a part is still being uploaded are deferred, so on a loaded machine, with S3 slower
    than training, the run could otherwise end before any cut at or after ``at`` was written, and a fault armed for
    that write would never fire. Once storage has caught up, the next cut due is taken at once. The peers' timeout
    covers the hold."""
    from pipedream_ft.checkpoint import Storage, list_committed

    hold.touch()
    result: dict = {}

    def run() -> None:
        result["proc"] = torchrun(url, out, faults, storage_options=storage_options, extra=("--hold", str(at), str(hold)),
                                  peer_timeout_s=120)

    storage = Storage(url, storage_options)
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120
    while t.is_alive() and not [c for c in list_committed(storage) if c >= at - EVERY] and time.monotonic() < deadline:
        time.sleep(0.2)
    hold.unlink()
    t.join(timeout=280)
    return result["proc"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(S3_CASES))
def test_fault_through_s3(case, reference, tmp_path, seaweed_s3):  # noqa: F811
    faults, failed_at = S3_CASES[case]
    out = tmp_path / "final.pt"
    url = seaweed_s3.url(f"ft-{case.split()[0]}-{time.time_ns()}")
    if "crash" in case:
        proc = run_held_until_storage_caught_up(url, out, faults, seaweed_s3.storage_options, failed_at,
                                                tmp_path / "hold")
    else:
        proc = torchrun(url, out, faults, storage_options=seaweed_s3.storage_options)
    info = finished(proc, out)
    log = proc.stdout + proc.stderr
    resumed = 0 if info["resumed_from"] is None else info["resumed_from"]
    # An upload to S3 takes longer than an interval here (~1 s against 8 minibatches of ~10 ms), so stage 0 defers
    # each due cut until its previous part is durable: cuts are as far apart as the storage needs, and the
    # interval bound of the local-disk cases does not apply. What must hold: the resume is from before the
    # failure and, for a crash while writing, from before the cut being written (it never commits).
    assert resumed <= failed_at, (resumed, log[-6000:])
    if "crash" in case:
        assert_resumed_before_the_crashed_cut(resumed, failed_at, log)
    assert_bitwise(out, reference)


@pytest.mark.timeout(300)
def test_s3_outage_during_training(reference, tmp_path, seaweed_s3):  # noqa: F811
    """The S3 server goes away mid-run: training goes on, saves warn and retry (the policy defers the next
    checkpoints meanwhile instead of queueing them), none is committed half-written, and checkpoints commit
    again once S3 is back: the one that was being written, and later ones. Training is held at minibatch 32 until
    the one being written has committed, so that the run cannot end before S3 is back however slowly a loaded
    machine restarts it (the peers' timeout is raised to cover the hold)."""
    out = tmp_path / "final.pt"
    url = seaweed_s3.url(f"ft-outage-{time.time_ns()}")
    result: dict = {}
    hold = tmp_path / "hold"
    hold.touch()

    def run() -> None:
        result["proc"] = torchrun(url, out, sleep_ms=400, storage_options=seaweed_s3.storage_options,
                                  extra=("--hold", "32", str(hold)), peer_timeout_s=120)

    from pipedream_ft.checkpoint import Storage, list_committed, load_part, read_commit

    storage = Storage(url, seaweed_s3.storage_options)
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120
    while not list_committed(storage) and time.monotonic() < deadline:  # training is under way
        time.sleep(0.2)
    before = list_committed(storage)
    seaweed_s3.stop()
    time.sleep(4.0)
    seaweed_s3.start()
    deadline = time.monotonic() + 120
    while not [c for c in list_committed(storage) if c > before[-1]] and time.monotonic() < deadline:
        time.sleep(0.2)  # the checkpoint that was being written commits once S3 is back
    hold.unlink()
    t.join(timeout=280)
    info = finished(result["proc"], out)
    log = result["proc"].stdout + result["proc"].stderr
    assert info["attempt"] == 0, log[-6000:]  # no restart was needed
    assert_bitwise(out, reference)
    committed = list_committed(storage)
    assert len([c for c in committed if c > before[-1]]) >= 2, (before, committed, log[-6000:])
    for step in committed:  # every committed checkpoint is whole
        record = read_commit(storage, step)
        for part in record.parts:
            load_part(storage, step, part, record=record)
