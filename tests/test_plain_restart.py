"""A plain script's failed process (``pipedream_ft.exit_on_error``, no ``launch``) ends by torchrun's SIGTERM at once.

Under torchrun's restart path the survivors of a killed worker fail and torchrun SIGTERMs them. The
checkpointer's emergency-checkpoint handler used to stay installed after training failed: the signal was swallowed,
the process went its whole way out (shutting its groups down, a garbage collection over the heap, the interpreter's
shutdown: seconds on a loaded machine) and exited 1, and torchrun's restart waited for it. The facts checked here
hold whatever the machine's load: the process dies *by* the signal, and without running the way out
(``release_all``); the wall-clock bound is generous.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

_SCRIPT = """
import atexit, os, signal, sys, time
from pathlib import Path
import torch
from torch import nn
sys.path.insert(0, {tests!r})
import pipedream_ft, pipedream_ft.trainer
from pipedream_ft import CheckpointConfig, EveryNSteps, PipelineConfig, PipelineTrainer
from pipedream_ft.errors import PipelineError
from runtime_cases import data, mlp, plan_for

MARK = Path({mark!r})
release_all = pipedream_ft.trainer.release_all

def marked_release_all():  # the way out: a failed process told to stop must not take it
    MARK.write_text("released")
    time.sleep(300)
    release_all()

pipedream_ft.trainer.release_all = marked_release_all
atexit.register(time.sleep, 300)  # leaving the interpreter is slow too
HELD = {held!r}

def feed(b):
    if b == 6:
        if HELD:  # torchrun's SIGTERM arrives while this rank still trains: the checkpointer's handler holds it
            os.kill(os.getpid(), signal.SIGTERM)
        raise PipelineError("gradient of minibatch 6 with rank 1 failed: Connection reset by peer")
    return data(b)

def main():
    model = mlp()
    trainer = PipelineTrainer(model, plan_for(model, [list(range(9))]), loss_fn=nn.functional.cross_entropy,
                              optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.05),
                              config=PipelineConfig(progress=False, summary=False),
                              checkpoint=CheckpointConfig(url={url!r}, policy=EveryNSteps(4)))  # emergency_save on
    trainer.fit(feed, 40)

pipedream_ft.exit_on_error(main)
"""


def _run(tmp: Path, held: bool) -> tuple[subprocess.Popen, Path]:
    mark = tmp / "released"
    script = tmp / "plain.py"
    script.write_text(_SCRIPT.format(tests=str(Path(__file__).parent), mark=str(mark), held=held,
                                     url=(tmp / "ckpt").as_uri()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "PIPEDREAM_FT"))}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True), mark


def _wait_for_line(proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 120
    seen = ""
    while "Connection reset by peer" not in seen:  # the one line: training has failed
        assert time.monotonic() < deadline and proc.poll() is None, seen
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            seen += proc.stderr.readline()
    return seen


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def test_a_sigterm_held_while_training_ends_the_failed_process_by_it(tmp_path):
    proc, mark = _run(tmp_path, held=True)
    try:
        line = _wait_for_line(proc)
        assert proc.wait(timeout=60) == -signal.SIGTERM, line + proc.stderr.read()
        assert not mark.exists(), "the failed process went its way out instead of dying by the held SIGTERM"
        assert "pipedream-ft: rank 0: gradient of minibatch 6 with rank 1 failed: Connection reset by peer" in line
    finally:
        _stop(proc)


def test_a_sigterm_after_the_failure_ends_the_way_out(tmp_path):
    proc, mark = _run(tmp_path, held=False)
    try:
        _wait_for_line(proc)
        deadline = time.monotonic() + 60
        while not mark.exists():  # on its way out (which would take 300 s)
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        assert time.monotonic() - sent < 30  # measured ~ms; generous for a loaded machine
    finally:
        _stop(proc)
