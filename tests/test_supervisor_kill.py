"""Killing a rank's supervisor (the torchrun worker process itself, as an OOM killer or a lost container would):
its training process dies with it, torchrun ends the other workers and starts the group again.

The surviving supervisors must leave at once on torchrun's SIGTERM (their group is recovering: there is nothing
to save, and their memory-tier parts stay for the next attempt) instead of being SIGKILLed after torchrun's
grace period; the next attempt must not read the previous one's store keys (a stale eviction record once made
a fresh supervisor kill its own new process); no traceback; final weights bitwise those of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

WORKER = Path(__file__).with_name("ft_worker.py")
TOTAL = 64


def start(tmp: Path, restarts: int, sleep_ms: float, faults: str = "") -> tuple[subprocess.Popen, Path]:
    out = tmp / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", f"--max-restarts={restarts}",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.2",
           str(WORKER), "--ckpt", str(tmp / "ckpt"), "--total", str(TOTAL), "--every", "100000",
           "--memory-every", "4", "--out", str(out), "--sleep-ms", str(sleep_ms), "--timeout", "8"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PIPEDREAM_FT_RECOVERY="in-place", PIPEDREAM_FT_FAULTS=faults)
    log = open(tmp / "torchrun.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), out


def finish(proc: subprocess.Popen, tmp: Path, timeout: float) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    log = (tmp / "torchrun.log").read_text()
    assert proc.returncode == 0, log[-6000:]
    return log


def test_killing_a_supervisor_restarts_the_group_quickly_and_quietly(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    proc, out = start(ref, 0, 0)
    finish(proc, ref, 240)
    reference = torch.load(out)

    run = tmp_path / "run"
    run.mkdir()
    # rank 2's supervisor (the torchrun worker itself) is SIGKILLed as rank 2 starts minibatch 21
    proc, out = start(run, 1, 20, "supervisor@rank=2,step=21")
    log = finish(proc, run, 300)
    assert "injecting fault supervisor@rank=2,step=21" in log, log[-6000:]
    attempts = [json.loads(l) for l in out.with_suffix(".pt.attempts").read_text().splitlines()]
    assert [a["attempt"] for a in attempts] == [0, 1], (attempts, log[-6000:])  # one restart, no replacement loop
    assert attempts[1]["resumed_from"] is not None and attempts[1]["resumed_from"] > 0, (attempts, log[-6000:])
    assert "Traceback" not in log and "DistStoreError" not in log and "did not join" not in log, log[-6000:]
    # the survivors left on torchrun's SIGTERM: none had to be SIGKILLed after the grace period
    assert "forcefully exiting" not in log, log[-6000:]
    assert "starting replacement" not in log, log[-6000:]  # nobody killed (or replaced) a fresh process
    got = torch.load(out)
    for k, v in reference.items():
        assert torch.equal(got[k], v), f"{k} differs from the uninterrupted run"
