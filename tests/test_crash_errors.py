"""Errors that would recur end the job with one line, under real torchrun (see pipedream_ft/crashlog.py).

An error from the training script before training starts, a bad argument to ``trainer.fit``, and an error that
the rank's replacement raises again at the same place: each stops the job with exit status 2 and one line that
names the error, instead of a traceback per rank and a replacement (or restart) loop; the full traceback is in
the per-rank log file the line names; a later torchrun attempt (``--max-restarts 1``) exits at once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("crash_worker.py")


def torchrun(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts=1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.2",
           str(WORKER), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PIPEDREAM_FT_LOG_DIR=str(tmp / "logs"))
    env.pop("PIPEDREAM_FT_RECOVERY", None)  # launch's default under torchrun: in-place recovery
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, cwd=tmp)
    return proc, proc.stdout + proc.stderr


def ours(log: str) -> list[str]:
    return [l for l in log.splitlines() if l.startswith("pipedream-ft:")]


def assert_stopped_quietly(log: str, error: str) -> None:
    """Every worker exited with status 2; the error shows only in the library's one-line messages (no
    worker traceback); no process was replaced twice."""
    statuses = re.findall(r"exitcode\s*:\s*(-?\d+)", log)
    assert statuses and set(statuses) <= {"2", "-15", "-9", "137"} and "2" in statuses, log[-5000:]
    assert 'crash_worker.py", line' not in log, log[-5000:]
    for line in log.splitlines():
        if error in line:
            assert line.startswith("pipedream-ft:"), line
    assert "starting replacement 2" not in log, log[-5000:]


def logged_traceback(line: str, error: str) -> str:
    path = Path(re.search(r"full traceback in (\S+)", line).group(1))
    text = path.read_text()
    assert "Traceback (most recent call last)" in text and error in text, text
    return text


def test_an_error_before_training_stops_the_job(tmp_path):
    proc, log = torchrun(tmp_path, "--error", "before")
    assert proc.returncode != 0
    assert_stopped_quietly(log, "bad dataset path")
    lines = [l for l in ours(log) if "bad dataset path" in l]
    assert lines and all("before training started" in l for l in lines), log[-5000:]
    logged_traceback(lines[0], "ValueError: bad dataset path")
    assert "replacement" not in log, log[-5000:]


def test_a_bad_fit_argument_is_a_set_up_error(tmp_path):
    proc, log = torchrun(tmp_path, "--error", "fit")
    assert proc.returncode != 0
    assert_stopped_quietly(log, "multiple of 2")
    lines = [l for l in ours(log) if "multiple of 2" in l]
    assert len(set(lines)) == 1 and lines[0].startswith("pipedream-ft: error: steps must be"), log[-5000:]
    assert "replacement" not in log and "recovering" not in log, log[-5000:]


def test_an_error_that_recurs_in_the_replacement_stops_the_job(tmp_path):
    proc, log = torchrun(tmp_path, "--error", "during", "--rank", "0", "--at", "6")
    assert proc.returncode != 0
    assert_stopped_quietly(log, "corrupt record")
    lines = [l for l in ours(log) if "corrupt record" in l]
    assert len(lines) == 2, log[-5000:]  # the crash, then its recurrence in the replacement: no loop
    assert "starting replacement 1" in log, log[-5000:]
    assert "it recurs, the job stops" in lines[1], lines
    first, again = logged_traceback(lines[0], "ValueError"), logged_traceback(lines[1], "ValueError")
    assert "process0" in lines[0] and "process1" in lines[1] and first != again
