"""The library's decisive store keys cannot be forged by a process that reaches the store but does not know the
job's secret: eviction records (``evict/<rank>``), preemption notices and the job's error are signed with it,
and a forged, unsigned or replayed record is ignored (said once) — while genuine ones still work. The forger is
always a separate process writing to the live store, as an outsider on the node would."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import test_inplace_recovery as inplace
from dist_helpers import free_port
from pipedream_ft.env import read_env
from pipedream_ft.ft.coordination import Coordinator, LiveGroup
from pipedream_ft.ft.secret import key_from_secret

pytestmark = [pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
KEY = key_from_secret("the job's secret, 32 characters")
RUN = "signed-keys"

FORGER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist

port, deadline = int(sys.argv[1] if sys.argv[1] != "-" else input()), time.monotonic() + float(sys.argv[2])
while True:  # the store may not be up yet
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
for line in sys.stdin:  # "wait PREFIX KEY" (until it exists; print its value) or "set PREFIX KEY VALUE"
    op, prefix, key, *value = line.rstrip().split(" ", 3)
    where = dist.PrefixStore(prefix, store)  # the key names the library uses
    if op == "wait":
        while not where.check([key]):
            if time.monotonic() > deadline:
                raise SystemExit(f"{prefix} {key} never appeared")
            time.sleep(0.005)
        print(where.get(key).decode(), flush=True)
    else:
        where.set(key, value[0] if value else "")
        print("ok", flush=True)
"""


class Forger:
    """A separate process connected to the store at ``port`` (it knows every key name, not the secret);
    ``port=None``: tell it later with :meth:`connect`."""

    def __init__(self, port: int | None, deadline_s: float = 30.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FORGER), str(port or "-"),
                                      str(deadline_s)],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def connect(self, port: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{port}\n")
        self.proc.stdin.flush()

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().rstrip("\n")
        assert answer, f"the forger died on {line!r} (exit {self.proc.poll()})"
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)


@pytest.fixture
def store():
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    forger = Forger(port)
    yield host, port, forger
    forger.close()


def test_forged_and_replayed_evictions_are_ignored_and_genuine_ones_apply(store, caplog) -> None:
    host, port, forger = store
    live = LiveGroup(host, RUN, "round-a", key=KEY)
    prefix = f"pipedream_ft/{RUN}/round-a/live/"
    with caplog.at_level(logging.WARNING, logger="pipedream_ft.ft.coordination"):
        for forged in ("0", "0 " + "0" * 64, "x y"):
            forger.ask(f"set {prefix} evict/1 {forged}")
            assert live.evicted(1) is None
            assert live.evicted(1) is None
        # a genuine record of another group (round) copied into this one is a replay: ignored too
        LiveGroup(host, RUN, "round-b", key=KEY).evict(1, 0)
        replayed = forger.ask(f"wait pipedream_ft/{RUN}/round-b/live/ evict/1")
        forger.ask(f"set {prefix} evict/1 {replayed}")
        assert live.evicted(1) is None
        # signed with another job's secret: ignored
        LiveGroup(host, RUN, "round-a", key=key_from_secret("another job's secret, 32 chars")).evict(2, 0)
        assert live.evicted(2) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 5 and all("ignoring an eviction record not signed" in w for w in warnings), warnings
    # a genuine eviction, written by another process of the job (it knows the secret), applies
    writer = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from datetime import timedelta
        import torch.distributed as dist
        from pipedream_ft.ft.coordination import LiveGroup
        store = dist.TCPStore("127.0.0.1", {port}, is_master=False, timeout=timedelta(seconds=30))
        LiveGroup(store, {RUN!r}, "round-a", key={KEY!r}).evict(1, 3)
        """)], capture_output=True, text=True, timeout=120)
    assert writer.returncode == 0, writer.stderr
    assert live.evicted(1) == 3


def test_forged_preemption_notices_and_job_errors_are_ignored(store, caplog) -> None:
    host, port, forger = store
    env = read_env({}, rank=0, world_size=1, master_port=port, run_id=RUN, use_agent_store=True)  # a client
    coordinator = Coordinator(env, 30.0)
    coordinator._secret = KEY  # as every process of the job derives it (see pipedream_ft.ft.secret)
    epoch = coordinator.live_epoch("round-a", 0)
    prefix = f"pipedream_ft/{RUN}/round-a/live/e0/"
    with caplog.at_level(logging.WARNING, logger="pipedream_ft.ft.coordination"):
        forger.ask(f"set {prefix} preempted 1")
        forger.ask(f"set {prefix} job-error rank 1: stop everything")
        assert not coordinator.preemption_announced() and coordinator.job_error() is None
        assert not coordinator.preemption_announced() and coordinator.job_error() is None
    assert len(caplog.records) == 2, [r.getMessage() for r in caplog.records]  # once each
    epoch.store.delete_key("job-error")
    coordinator.announce_preemption()
    coordinator.publish_job_error("a data source ended")
    assert coordinator.preemption_announced() and coordinator.job_error() == "rank 0: a data source ended"
    # the genuine records of epoch 0, replayed into epoch 1, do not apply there
    genuine = forger.ask(f"wait {prefix} preempted")
    forger.ask(f"set pipedream_ft/{RUN}/round-a/live/e1/ preempted {genuine}")
    coordinator.live_epoch("round-a", 1)
    assert not coordinator.preemption_announced()


def test_a_forged_eviction_and_preemption_do_not_stop_a_running_job(tmp_path, monkeypatch) -> None:
    """Under real torchrun: an outsider reads the group's round from the store as soon as it is agreed and
    writes eviction records for every rank (what an earlier version obeyed: it killed them) and a preemption
    notice. The job goes on untouched: no process is replaced, nobody stops, the weights are bitwise those of
    the uninterrupted run, and each supervisor says once that it ignores the record.

    Training is held at minibatch 24 (the peers' timeout covers it) until every supervisor has said so: however
    slowly a loaded machine starts the outsider, the job cannot end before the records are written and read."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv("PDFT_TEST_FORGERY", mark)  # tells the job's processes apart from others' on this machine
    forger = Forger(None, deadline_s=240.0)
    hold = tmp_path / "hold"
    hold.touch()
    evictions_ignored = threading.Semaphore(0)

    def on_line(line: str) -> None:
        if "ignoring an eviction record not signed" in line:
            evictions_ignored.release()

    try:
        result: dict = {}
        job = threading.Thread(target=lambda: result.update(zip(("proc", "out", "lines"), inplace.torchrun_watched(
            tmp_path, "", "--sleep-ms", "50", "--hold", "24", str(hold), "--timeout", "120", on_line=on_line))))
        job.start()
        forger.connect(_store_port(mark))
        rounds = "pipedream_ft/none/round/"
        try:
            token = forger.ask(f"wait {rounds} hello/1")
            round_id = forger.ask(f"wait {rounds} ack/{token}")
            for rank in range(4):
                forger.ask(f"set pipedream_ft/none/{round_id}/live/ evict/{rank} 0")
            for where in (f"{round_id}/", f"{round_id}/live/e0/"):
                forger.ask(f"set pipedream_ft/none/{where} preempted 0")
        except AssertionError as exc:  # the store went away: say why the job ended
            hold.unlink()
            job.join(120)
            proc = result.get("proc")
            raise AssertionError(f"{exc}; the job: " + (f"exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}"
                                                        if proc is not None else "still running")) from None
        deadline = time.monotonic() + 120
        for _ in range(4):  # every supervisor has read its record and ignored it
            evictions_ignored.acquire(timeout=max(0.0, deadline - time.monotonic()))
        hold.unlink()
        job.join(300)
        assert not job.is_alive()
    finally:
        forger.close()
        hold.unlink(missing_ok=True)
    info = inplace.summary(result["proc"], result["out"])
    log = info["log"]
    assert "starting replacement" not in log and "preempted:" not in log, log[-4000:]
    assert info["recoveries"] == [] and info["incarnation"] == 0
    ignored = [line for line in log.splitlines() if "ignoring an eviction record not signed" in line]
    assert len(ignored) == 4, log[-4000:]  # each rank's supervisor, once
    assert any("ignoring a preempted record not signed" in line for line in log.splitlines()), log[-4000:]
    reference = _reference(tmp_path / "reference")
    inplace.assert_bitwise(result["out"], reference)


def _store_port(mark: str, timeout_s: float = 120.0) -> int:
    """The port of the job's store, as anyone on the machine can find it (here from a worker's environment,
    which a process of the same user reads; ``ss -ltn`` lists it to every user)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if env.get(b"PDFT_TEST_FORGERY") == mark.encode() and b"TORCHELASTIC_USE_AGENT_STORE" in env:
                return int(env[b"MASTER_PORT"])
        time.sleep(0.05)
    raise AssertionError(f"no worker of the job appeared within {timeout_s:.0f}s")


def _reference(tmp: Path) -> dict:
    tmp.mkdir()
    info = inplace.summary(*inplace.torchrun(tmp))
    assert info["recoveries"] == []
    import torch

    return torch.load(tmp / "final.pt")
