"""Checkpoint tiers with real processes: the shared-memory tier outlives the process that wrote it, a peer
process keeps a copy of my part that a replacement process on another "node" restores from, timeouts and
corrupt transfers, and restore picking the newest verifiable tier."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from pipedream_ft.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    CorruptCheckpointError,
    DurableTier,
    MemoryTier,
    PeerClient,
    PeerError,
    PeerServer,
    PeerTier,
    Storage,
    TierWriter,
    available_steps,
    load_newest,
)
from pipedream_ft.checkpoint.checksum import checksum
from pipedream_ft.checkpoint.storage import Buffers

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
KEY = b"the job's key, 32 bytes long...."


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "opt": {0: {"m": torch.randn(64, generator=g)}}, "step": step}


def python(code: str, *args: str) -> subprocess.Popen:
    """A real Python process running ``code`` (with the repository importable)."""
    prelude = "import sys, os, json, time, signal, torch\nsys.path.insert(0, %r)\nKEY = %r\n" % (str(ROOT), KEY)
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code), *args], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def same_state(a: dict, b: dict) -> None:
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["opt"][0]["m"], b["opt"][0]["m"]) and a["step"] == b["step"]


STATE_OF = """
def state_of(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "opt": {0: {"m": torch.randn(64, generator=g)}}, "step": step}
"""


def test_memory_tier_outlives_the_writer_process_and_is_removed_at_job_end() -> None:
    job = f"test-{uuid.uuid4().hex[:10]}"
    tier = MemoryTier(job, key=KEY)  # the real /dev/shm
    assert tier.directory.startswith("/dev/shm/pdft-") and tier.directory.endswith(f"-{job}")
    try:
        child = python(STATE_OF + """
from pipedream_ft.checkpoint import MemoryTier, TierWriter, immutable
tier = MemoryTier(sys.argv[1], key=KEY)
w = TierWriter([tier], "stage0", keep=2)
for step in (4, 5, 6):
    w.save(step, {**state_of(step), "w": immutable(state_of(step)["w"])})
assert w.flush(30)
# a part of step 7 whose writer dies before it is complete: its data, no meta
os.makedirs(os.path.join(tier.directory, "step-0000000007"), exist_ok=True)
with open(os.path.join(tier.directory, "step-0000000007", "part-stage0.pt.tmp-x"), "wb") as f:
    f.write(b"torn")
print("saved", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""", job)
        out, err = child.communicate(timeout=60)
        assert child.returncode == -signal.SIGKILL and "saved" in out, err
        assert tier.steps(["stage0"]) == [5, 6]  # keep=2; the torn step 7 is not listed
        same_state(tier.get(6, "stage0"), state_of(6))
        tiers = [tier]
        assert available_steps(tiers, "stage0") == {"memory": [5, 6]}
        step, name, got = load_newest(tiers, "stage0", [5, 6])  # type: ignore[misc]
        assert (step, name) == (6, "memory")
        same_state(got, state_of(6))
    finally:
        tier.destroy()
    assert not os.path.exists(tier.directory)


def test_peer_keeps_my_part_when_my_node_is_lost(tmp_path) -> None:
    nodes = {n: tmp_path / n for n in ("node-a", "node-b", "node-c")}  # each one's /dev/shm
    for d in nodes.values():
        d.mkdir()
    job = "job-1"
    holder = python("""
from pipedream_ft.checkpoint import MemoryTier, PeerServer
server = PeerServer(MemoryTier(sys.argv[1], key=KEY, root=sys.argv[2]), timeout_s=5, token="s3cret").start()
print(json.dumps(server.address), flush=True)
sys.stdin.read()  # serve until the test closes stdin
""", job, str(nodes["node-a"]))
    try:
        line = holder.stdout.readline()  # type: ignore[union-attr]
        address = tuple(json.loads(line))
        rank = python(STATE_OF + """
from pipedream_ft.checkpoint import MemoryTier, PeerTier, TierWriter
address = tuple(json.loads(sys.argv[3]))
w = TierWriter([MemoryTier(sys.argv[1], key=KEY, root=sys.argv[2]),
                PeerTier(address, timeout_s=5, token="s3cret")],
               "stage1", keep=1)
for step in (10, 20):
    h = w.save(step, state_of(step))
    assert h.wait(30) and h.ok, h.errors
print("pushed", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""", job, str(nodes["node-b"]), json.dumps(address))
        out, err = rank.communicate(timeout=60)
        assert rank.returncode == -signal.SIGKILL and "pushed" in out, err
        # node b is lost with its shared memory; the replacement rank runs on node c
        for f in nodes["node-b"].rglob("*"):
            if f.is_file():
                f.unlink()
        replacement = python(STATE_OF + """
from pipedream_ft.checkpoint import MemoryTier, PeerTier, available_steps, load_newest
address = tuple(json.loads(sys.argv[3]))
tiers = [MemoryTier(sys.argv[1], key=KEY, root=sys.argv[2]), PeerTier(address, timeout_s=5, token="s3cret")]
have = available_steps(tiers, "stage1")
step, name, state = load_newest(tiers, "stage1", sorted(set().union(*have.values())))
ok = torch.equal(state["w"], state_of(step)["w"]) and state["step"] == step
print(json.dumps({"have": have, "step": step, "tier": name, "ok": ok}), flush=True)
""", job, str(nodes["node-c"]), json.dumps(address))
        out, err = replacement.communicate(timeout=60)
        assert replacement.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result == {"have": {"memory": [], "peer": [20]}, "step": 20, "tier": "peer", "ok": True}
        # the holder's node keeps the copy in its own shared memory (keep=1 pruned step 10 there too)
        assert MemoryTier(job, key=KEY, root=str(nodes["node-a"])).steps(["stage1"]) == [20]
    finally:
        holder.kill()
        holder.communicate(timeout=10)


def test_peer_timeouts_refusals_and_a_dead_peer_do_not_stop_the_other_tiers(tmp_path, caplog) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = ("127.0.0.1", s.getsockname()[1])  # nobody listens there once closed
    with pytest.raises(PeerError, match="failed: ConnectionRefusedError"):
        PeerClient(dead, timeout_s=1).steps(["a"])
    with socket.socket() as stuck:  # accepts connections (backlog) but never answers
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(8)
        t0 = time.monotonic()
        with pytest.raises(PeerError, match="timed out"):
            PeerClient(stuck.getsockname(), timeout_s=0.5).put(1, "a", b"x" * 10, checksum([b"x" * 10]))
        assert time.monotonic() - t0 < 5
    shm = MemoryTier("j", key=KEY, root=str(tmp_path))
    with PeerServer(MemoryTier("held", key=KEY, root=str(tmp_path)), token="t") as server:
        good = PeerClient(server.address, timeout_s=5, token="t")
        with pytest.raises(PeerError, match="refused put: CorruptCheckpointError"):
            good.put(1, "a", b"hello", checksum([b"other"]))
        with pytest.raises(PeerError, match="not signed with this job's token"):
            PeerClient(server.address, timeout_s=5, token="wrong").steps(["a"])
        with pytest.raises(PeerError, match="no part 'a' at step 1"):
            good.get(1, "a")
        good.put(1, "a", Buffers([b"hel", b"lo"]), checksum([b"hello"]))
        assert good.steps(["a"]) == [1] and good.get(1, "a") == (bytearray(b"hello"), checksum([b"hello"]))
    w = TierWriter([PeerTier(dead, timeout_s=0.5), shm], "a", keep=3)
    with caplog.at_level(logging.DEBUG, logger="pipedream_ft.checkpoint"):
        handles = [w.save(s, state_of(s)) for s in (1, 2)]
        assert w.flush(30)
    assert all("peer" in h.errors and "memory" in h.put_s for h in handles)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "tier peer" in warnings[0] and "training goes on" in warnings[0]
    assert shm.steps(["a"]) == [1, 2]
    w.close()


def test_restore_takes_the_newest_verifiable_tier(tmp_path) -> None:
    storage = Storage(str(tmp_path / "durable"))
    dw = CheckpointWriter(storage, "a", is_committer=True, poll_interval_s=0.005)
    dw.save(10, state_of(10))
    assert dw.flush(10)
    dw.close()
    shm = MemoryTier("job", key=KEY, root=str(tmp_path))
    fast = TierWriter([shm], "a", keep=5)
    for s in (12, 14):
        fast.save(s, state_of(s))
    assert fast.flush(10)
    tiers = [shm, DurableTier(storage)]
    assert available_steps(tiers, "a") == {"memory": [12, 14], "durable": [10]}
    assert load_newest(tiers, "a", [10, 12, 14])[:2] == (14, "memory")  # type: ignore[index]
    # the newest memory part is corrupt: the previous step is taken; with memory gone, the durable one
    path = Path(shm.directory) / "step-0000000014" / "part-a.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="MAC under this job's key"):
        shm.get(14, "a")
    step, name, got = load_newest(tiers, "a", [10, 12, 14])  # type: ignore[misc]
    assert (step, name) == (12, "memory")
    same_state(got, state_of(12))
    shm.destroy()
    assert load_newest(tiers, "a", [10, 12, 14])[:2] == (10, "durable")  # type: ignore[index]
    assert load_newest(tiers, "b", [10]) is None
    with pytest.raises(CheckpointError, match="read-only"):
        DurableTier(storage).put(20, "a", b"x", "0")
    with pytest.raises(CheckpointError, match="read-only"):
        DurableTier(storage).keep_last(1)
    fast.close()


def test_memory_tier_validation_and_keep(tmp_path) -> None:
    with pytest.raises(ValueError, match="job must match"):
        MemoryTier("../evil", key=KEY, root=str(tmp_path))
    with pytest.raises(ValueError, match="key must be at least 16 bytes"):
        MemoryTier("j", key=b"short", root=str(tmp_path))
    with pytest.raises(Exception, match="does not exist"):
        MemoryTier("j", key=KEY, root=str(tmp_path / "missing"))
    tier = MemoryTier("j", key=KEY, root=str(tmp_path))
    for s in (1, 2, 3):
        for part in ("a", "b"):
            tier.put(s, part, Buffers([b"x" * s]), checksum([b"x" * s]))
    tier.keep_last(2, ["a"])
    assert tier.steps(["a"]) == [2, 3] and tier.steps(["b"]) == [1, 2, 3] and tier.steps(["a", "b"]) == [2, 3]
    tier.keep_last(1)
    assert tier.steps([]) == [3]
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        tier.keep_last(0)


def test_one_snapshot_feeds_both_tiers_and_its_buffers_return_at_the_last_release(tmp_path) -> None:
    """A cut saved to the memory tier and to durable storage is copied once: both writers hold the same snapshot,
    each part is the state at the save, and the buffers are reused only once both writers are done with them."""
    storage = Storage(str(tmp_path / "durable"))
    durable = CheckpointWriter(storage, "a", is_committer=True, poll_interval_s=0.005)
    shm = MemoryTier("job", key=KEY, root=str(tmp_path))
    fast = TierWriter([shm], "a", keep=5)
    live = state_of(10)
    snap = durable.snapshot(live)
    copied = snap.tree["w"].data_ptr()
    handle, _ = durable.save(10, snap), fast.save(10, snap)
    snap.release()  # the taker's hold: the writers still hold theirs
    assert handle.copied_bytes == snap.copied_bytes > 0
    assert fast._pool._arenas == []  # the memory tier's writer copied nothing: it holds the durable one's snapshot
    live["w"].add_(1)  # training goes on at once: neither part sees it
    assert durable.flush(10) and fast.flush(10)
    want = state_of(10)
    same_state(load_newest([DurableTier(storage)], "a", [10])[2], want)  # type: ignore[index]
    same_state(load_newest([shm], "a", [10])[2], want)  # type: ignore[index]
    again = durable.snapshot(live)  # both writers released it: its buffers are taken again
    assert again.tree["w"].data_ptr() == copied and torch.equal(again.tree["w"], live["w"])
    again.release()
    with pytest.raises(ValueError, match="snapshot was released"):
        snap.retain()
    with pytest.raises(TypeError, match="state must be a dict, got list"):
        durable.snapshot([1])  # type: ignore[arg-type]
    durable.close()
    fast.close()
    shm.destroy()



def test_one_background_thread_writes_every_part_to_every_tier(tmp_path) -> None:
    """A process of two stages saving each cut to the memory tier and durably: four writers, one thread. Each
    part is snapshotted once for both tiers, the memory tier has every part, and the cut commits with both."""
    import threading

    from pipedream_ft.checkpoint.background import Background
    from pipedream_ft.checkpoint.reader import list_committed

    storage = Storage(str(tmp_path / "durable"))
    shm = MemoryTier("job", key=KEY, root=str(tmp_path))
    before = threading.active_count()
    background = Background("checkpoint-writer")
    parts = ["stage0-replica0", "stage3-replica0"]
    durable = [CheckpointWriter(storage, name, expected_parts=parts, is_committer=k == 0, poll_interval_s=0.005,
                                background=background) for k, name in enumerate(parts)]
    fast = [TierWriter([shm], name, keep=5, background=background) for name in parts]
    assert threading.active_count() == before + 1 and background.clients == 4
    for step in (4, 8):
        for k in range(2):
            live = state_of(step + k)
            snap = durable[k].snapshot(live)
            handle, saved = durable[k].save(step, snap), fast[k].save(step, snap)
            snap.release()
            live["w"].add_(1)  # training goes on at once: neither tier sees it
    assert all(w.flush(10) for w in fast + durable)  # type: ignore[operator]
    assert all(w._pool._arenas == [] for w in fast)  # the memory tier's writers copied nothing
    assert shm.steps(parts) == [4, 8] and list_committed(storage) == [4, 8]
    for k, name in enumerate(parts):
        same_state(shm.get(8, name), state_of(8 + k))
        same_state(DurableTier(storage).get(8, name), state_of(8 + k))
    for w in fast + durable:  # type: ignore[operator]
        w.close(10)
    assert background.close(10) and threading.active_count() == before
    shm.destroy()
