"""A job that ends for good leaves nothing in /dev/shm: under real torchrun (in-place recovery), a set-up error
that stops every rank, and a SIGTERM of the whole job once its emergency checkpoint is durable, remove the
job's memory tier (its parts would otherwise fill the node's RAM until reboot). A rank replaced in place keeps
it (tests/test_inplace_recovery.py restores from it). The job's tier is told apart from others' by its name,
which its secret (``PIPEDREAM_FT_SECRET``, unique per test) determines."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

import test_inplace_recovery as inplace
from pipedream_ft.checkpoint.shm import DEFAULT_SHM_ROOT, tier_directory
from pipedream_ft.ft.secret import key_from_secret

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class TierWatch:
    """Which memory tiers of the job with ``secret`` exist, sampled every 20 ms while the job runs."""

    def __init__(self, secret: str) -> None:
        self.key = key_from_secret(secret)
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def current(self) -> set[str]:
        out = set()
        for name in os.listdir(DEFAULT_SHM_ROOT):
            if name.startswith("pdft-") and len(name) > 18:
                path = os.path.join(DEFAULT_SHM_ROOT, name)
                if tier_directory(name[len("pdft-") + 13:], self.key) == path:  # pdft-<12 hex of the key>-<job>
                    out.add(path)
        return out

    def with_parts(self) -> bool:
        return any(any(Path(p).glob("step-*/part-*.json")) for p in self.current())

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.seen |= self.current()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def secret(monkeypatch):
    value = f"cleanup test {uuid.uuid4().hex}"
    monkeypatch.setenv("PIPEDREAM_FT_SECRET", value)  # the job's processes inherit it
    return value


def test_a_set_up_error_that_stops_the_job_removes_its_memory_tier(tmp_path, secret):
    watch = TierWatch(secret)
    try:
        proc, _ = inplace.torchrun(tmp_path, "", "--source-ends", "22")
    finally:
        watch.close()
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ended after 22 minibatches" in log, log[-3000:]
    assert watch.seen, "the job never had a memory tier"
    assert watch.current() == set(), log[-3000:]


def test_sigterm_of_the_whole_job_removes_its_memory_tier_once_the_emergency_checkpoint_is_durable(tmp_path, secret,
                                                                                                     monkeypatch):
    mark = uuid.uuid4().hex
    monkeypatch.setenv("PDFT_TEST_CLEANUP", mark)
    watch = TierWatch(secret)
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(
        zip(("proc", "out"), inplace.torchrun(tmp_path, "", "--sleep-ms", "50", "--total", "400"))))
    job.start()
    try:
        deadline = time.monotonic() + 200
        while not watch.with_parts():  # training has begun: a memory-tier cut is stored
            assert time.monotonic() < deadline and job.is_alive(), "no memory-tier cut appeared"
            time.sleep(0.05)
        os.kill(_agent_pid(mark), signal.SIGTERM)  # as a scheduler cancelling the job would
        job.join(240)
        assert not job.is_alive()
    finally:
        watch.close()
    proc = result["proc"]
    log = proc.stdout + proc.stderr
    assert "preempted: checkpoint" in log, log[-4000:]
    assert list((tmp_path / "ckpt").glob("step-*/COMMIT*")), "the emergency checkpoint was not committed"
    assert watch.current() == set(), log[-3000:]


def _agent_pid(mark: str) -> int:
    """torchrun's own process (the elastic agent) of the job started with ``mark`` in its environment."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if f"PDFT_TEST_CLEANUP={mark}".encode() in env and b"torch.distributed.run" in cmd:
            return int(entry)
    raise AssertionError("torchrun's process not found")
