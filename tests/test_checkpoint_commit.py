"""Checkpoint format, asynchronous writer, commit protocol, garbage collection and verified loading."""

from __future__ import annotations

import io
import logging
import os
import threading
import time
import uuid
from typing import Any

import pytest
import torch

from pipedream_ft.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    CommitRecord,
    CorruptCheckpointError,
    PartMeta,
    RetryConfig,
    Storage,
    StorageError,
    check_compatible,
    latest_committed,
    list_committed,
    load_latest,
    load_part,
    read_commit,
)
from pipedream_ft.checkpoint import format as fmt

pytestmark = pytest.mark.timeout(60)

FAST_RETRY = RetryConfig(attempts=2, delay_s=0.001, max_delay_s=0.002)


@pytest.fixture(params=["local", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path) -> Storage:
    if request.param == "local":
        return Storage(str(tmp_path / "ckpt"), retry=FAST_RETRY)
    return Storage(f"memory://pdft-test-{uuid.uuid4().hex}", retry=FAST_RETRY)


def writers(storage: Storage, parts: list[str], **kw: Any) -> list[CheckpointWriter]:
    """One writer per part; the first is the committer."""
    kw.setdefault("poll_interval_s", 0.005)
    kw.setdefault("max_poll_interval_s", 0.02)
    kw.setdefault("max_queued", 16)
    return [
        CheckpointWriter(storage, name, expected_parts=parts, is_committer=(i == 0), **kw)
        for i, name in enumerate(parts)
    ]


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def sample_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 6, generator=g)
    return {
        "model": {
            "w": torch.nn.Parameter(w.clone()),
            "w_t_view": w.t()[1:3],  # non-contiguous view
            "b16": torch.randn(5, generator=g).to(torch.bfloat16),
            "ids": torch.arange(7, dtype=torch.int64),
            "mask": torch.tensor([True, False]),
            "special": torch.tensor([float("nan"), float("inf"), -0.0]),
        },
        "optim": {
            "state": {0: {"step": 3, "exp_avg": torch.ones(3)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999)}],
        },
        "epoch": 2,
        "loss": 0.125,
        "name": "stage-0",
        "flag": True,
        "nothing": None,
        "shape": torch.Size([2, 3]),
        "dtype": torch.float16,
        "nested": [1, [2, (3, {"k": "v"})]],
    }


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert bits(a) == bits(b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# ---------------------------------------------------------------------------------------------- format


def test_layout_names() -> None:
    assert fmt.step_dir(42) == "step-0000000042"
    assert fmt.parse_step_dir("step-0000000042") == 42
    assert fmt.parse_step_dir("step-42") is None and fmt.parse_step_dir("COMMIT.json") is None
    assert fmt.part_data_path(7, "stage1") == "step-0000000007/part-stage1.pt"
    assert fmt.part_meta_path(7, "stage1") == "step-0000000007/part-stage1.json"
    assert fmt.commit_path(7) == "step-0000000007/COMMIT.json"
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        fmt.step_dir(-1)
    with pytest.raises(ValueError, match="part name"):
        fmt.validate_part_name("../x")


def test_commit_record_round_trip_and_malformed() -> None:
    meta = PartMeta(name="a", step=3, checksum="crc32:0badf00d", size=10)
    assert PartMeta.from_json(meta.to_json()) == meta
    assert PartMeta("a", 3, "0" * 64, 1).checksum == "sha256:" + "0" * 64  # a bare hex digest is a SHA-256
    for bad in ["crc32:xyz", "md5:00", "crc32:0badf00d0", ""]:
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            PartMeta.from_json(PartMeta("a", 3, bad, 1).to_json())
    rec = CommitRecord(step=3, parts={"a": meta}, wall_time=1.5, metadata={"plan_hash": "abc", "world_size": 2})
    back = CommitRecord.from_json(rec.to_json())
    assert back.step == 3 and back.parts == {"a": meta} and back.metadata == rec.metadata
    for bad in [b"", b"{", b"[]", rec.to_json()[:-5], b'{"format": 99}']:
        with pytest.raises(CorruptCheckpointError):
            CommitRecord.from_json(bad)


def test_snapshot_rejects_unsupported_values() -> None:
    import numpy as np

    with pytest.raises(TypeError, match=r"state\['opt'\]\[0\]: cannot checkpoint .*ndarray"):
        fmt.snapshot_state({"opt": [np.zeros(2)]})
    with pytest.raises(TypeError, match="dict keys must be str or int"):
        fmt.snapshot_state({("a", 1): 1})


class _Evil:
    ran = False

    def __reduce__(self):  # executed only if something unpickles arbitrary objects
        return (_mark_ran, ())


def _mark_ran() -> "_Evil":
    _Evil.ran = True
    return _Evil()


def test_loading_never_unpickles_arbitrary_objects(storage: Storage) -> None:
    # A committed checkpoint with a valid checksum whose part pickles a custom class.
    buf = io.BytesIO()
    torch.save({"x": _Evil()}, buf)
    data = buf.getvalue()
    storage.write_bytes(fmt.part_data_path(5, "a"), data)
    rec = CommitRecord(step=5, parts={"a": PartMeta("a", 5, fmt.sha256_hex(data), len(data))}, wall_time=0.0)
    storage.write_bytes(fmt.commit_path(5), rec.to_json())
    with pytest.raises(CorruptCheckpointError, match="cannot load"):
        load_part(storage, 5, "a")
    assert load_latest(storage, "a") is None
    assert not _Evil.ran


# ---------------------------------------------------------------------------------------- round trip


def test_round_trip_bitwise_and_nested_values(storage: Storage) -> None:
    w0, w1 = writers(storage, ["stage0", "stage1"], metadata={"plan_hash": "p1", "world_size": 2})
    s0, s1 = sample_state(0), sample_state(1)
    h0 = w0.save(10, s0, {"profile_hash": "q"})
    h1 = w1.save(10, s1)
    assert w1.flush(10) and w0.flush(10)
    assert h0.ok and h1.ok and h0.committed is True and h1.committed is None
    assert h0.snapshot_s >= 0 and h0.persist_s is not None and h0.commit_s is not None
    assert list_committed(storage) == [10]
    rec = latest_committed(storage)
    assert rec is not None and rec.step == 10 and set(rec.parts) == {"stage0", "stage1"}
    assert rec.metadata == {"plan_hash": "p1", "world_size": 2, "profile_hash": "q"}
    step, got0 = load_latest(storage, "stage0")  # type: ignore[misc]
    assert step == 10
    expected0 = fmt.snapshot_state(s0)
    assert_same(got0, expected0)
    assert isinstance(got0["model"]["w"], torch.Tensor) and not got0["model"]["w"].requires_grad
    assert_same(load_part(storage, 10, "stage1"), fmt.snapshot_state(s1))
    for w in (w0, w1):
        w.close()


def test_snapshot_isolation(storage: Storage) -> None:
    (w,) = writers(storage, ["only"])
    t = torch.zeros(1000)
    gate = threading.Event()
    real_write = storage.write_bytes

    def slow_write(rel: str, data: bytes) -> None:
        gate.wait(5)  # hold the background thread until the caller has mutated its tensor
        real_write(rel, data)

    storage.write_bytes = slow_write  # type: ignore[method-assign]
    h = w.save(1, {"t": t, "l": [t]})
    t.add_(1.0)
    gate.set()
    assert h.wait(10) and h.ok
    _, state = load_latest(storage, "only")  # type: ignore[misc]
    assert torch.equal(state["t"], torch.zeros(1000)) and torch.equal(state["l"][0], torch.zeros(1000))
    w.close()


def test_saves_are_persisted_in_order_and_on_commit_called(storage: Storage) -> None:
    seen: list[int] = []
    (w,) = writers(storage, ["only"], on_commit=seen.append, keep=10)
    handles = [w.save(s, {"s": torch.tensor(s)}) for s in (1, 2, 3, 4)]
    assert w.flush(10)
    assert [h.step for h in handles] == [1, 2, 3, 4] and all(h.ok for h in handles)
    assert seen == [1, 2, 3, 4]
    assert list_committed(storage) == [1, 2, 3, 4]
    w.close()


# -------------------------------------------------------------------------------------------- commit


def test_commit_only_when_all_parts_present(storage: Storage) -> None:
    w0, w1 = writers(storage, ["a", "b"], commit_timeout_s=20)
    h0 = w0.save(3, {"x": torch.ones(2)})
    deadline = time.monotonic() + 10
    while not storage.exists(fmt.part_meta_path(3, "a")) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a few polling rounds of the committer
    assert not h0.done()
    assert not storage.exists(fmt.commit_path(3))
    assert storage.exists(fmt.part_meta_path(3, "a"))
    assert latest_committed(storage) is None and load_latest(storage, "a") is None
    w1.save(3, {"x": torch.zeros(2)})
    assert h0.wait(10) and h0.ok and h0.committed
    assert list_committed(storage) == [3]
    w0.close(), w1.close()


def test_commit_gives_up_after_timeout_and_later_steps_commit(storage: Storage, caplog) -> None:
    w0, w1 = writers(storage, ["a", "b"], commit_timeout_s=1.0)
    with caplog.at_level(logging.WARNING, logger="pipedream_ft.checkpoint"):
        h = w0.save(1, {"x": torch.ones(1)})  # part b of step 1 never arrives
        assert h.wait(10)
    assert h.committed is False and isinstance(h.error, CheckpointError) and "parts missing" in str(h.error)
    assert "not committed, giving up" in caplog.text and "missing or incomplete: b" in caplog.text
    assert "no commit yet" in caplog.text  # how long since the last commit
    assert not storage.exists(fmt.commit_path(1))
    w0.save(2, {"x": torch.ones(1)})
    w1.save(2, {"x": torch.ones(1)})
    assert w0.flush(10) and w1.flush(10)
    assert list_committed(storage) == [2]
    assert not storage.exists(fmt.step_dir(1))  # uncommitted and older than the newest commit: collected
    w0.close(), w1.close()


def test_newer_commit_supersedes_pending_older_step(storage: Storage) -> None:
    w0, w1 = writers(storage, ["a", "b"], commit_timeout_s=30)
    h1 = w0.save(1, {"x": 1})  # b skips step 1
    h2 = w0.save(2, {"x": 2})
    w1.save(2, {"x": 2})
    assert h2.wait(10) and h2.committed
    assert h1.wait(10) and h1.committed is False and "superseded" in str(h1.error)
    assert list_committed(storage) == [2]
    w0.close(), w1.close()


def test_keep_last_k(storage: Storage) -> None:
    w0, w1 = writers(storage, ["a", "b"], keep=2)
    for step in range(1, 6):
        w0.save(step, {"s": torch.tensor(step)})
        w1.save(step, {"s": torch.tensor(-step)})
        assert w0.flush(10) and w1.flush(10)
    assert list_committed(storage) == [4, 5]
    assert storage.list("") == [fmt.step_dir(4), fmt.step_dir(5)]
    w0.close(), w1.close()


def test_already_committed_step_is_not_rewritten(storage: Storage) -> None:
    (w,) = writers(storage, ["only"])
    w.save(7, {"v": torch.tensor(1)})
    assert w.flush(10)
    w.close()
    before = storage.read_bytes(fmt.part_data_path(7, "only"))
    (w2,) = writers(storage, ["only"])  # e.g. a restarted run saving the same step again
    h = w2.save(7, {"v": torch.tensor(2)})
    assert h.wait(10) and h.ok and h.committed
    assert storage.read_bytes(fmt.part_data_path(7, "only")) == before
    w2.close()


def test_storage_down_no_commit_then_recovers(storage: Storage, caplog) -> None:
    down = threading.Event()
    real_write = storage.write_bytes

    def write(rel: str, data: bytes) -> None:
        if down.is_set() and "part-b" in rel:
            raise StorageError(f"{rel}: injected outage")
        real_write(rel, data)

    storage.write_bytes = write  # type: ignore[method-assign]
    w0, w1 = writers(storage, ["a", "b"], commit_timeout_s=1.0)
    w0.save(1, {"x": 1}), w1.save(1, {"x": 1})
    assert w0.flush(10) and w1.flush(10)
    down.set()
    with caplog.at_level(logging.WARNING, logger="pipedream_ft.checkpoint"):
        h0, h1 = w0.save(2, {"x": 2}), w1.save(2, {"x": 2})
        assert h1.wait(10) and h0.wait(10)
    assert "write failed" in caplog.text and "retrying" in caplog.text
    assert h1.error is not None and h0.committed is False
    assert not storage.exists(fmt.commit_path(2))
    down.clear()
    w0.save(3, {"x": 3}), w1.save(3, {"x": 3})
    assert w0.flush(10) and w1.flush(10)
    assert list_committed(storage) == [1, 3]
    w0.close(), w1.close()


def test_slow_storage_never_drops_a_save(storage: Storage, caplog) -> None:
    gate = threading.Event()
    real_write = storage.write_bytes

    def slow(rel: str, data: bytes) -> None:
        gate.wait(5)
        real_write(rel, data)

    storage.write_bytes = slow  # type: ignore[method-assign]
    w = CheckpointWriter(storage, "only", is_committer=True, max_queued=1, poll_interval_s=0.005, keep=10)
    h1 = w.save(1, {"s": 1})
    assert w.backlog == 1 and w.last_committed is None
    time.sleep(0.05)  # the thread took step 1 and waits in the write
    h2 = w.save(2, {"s": 2})  # queued: 1 waiting
    assert w.backlog == 2
    done3 = threading.Event()
    handles: list[Any] = []
    with caplog.at_level(logging.WARNING, logger="pipedream_ft.checkpoint"):
        t = threading.Thread(target=lambda: (handles.append(w.save(3, {"s": 3})), done3.set()))
        t.start()
        assert not done3.wait(0.2)  # the queue is full: save waits instead of dropping a queued save
        gate.set()
        assert done3.wait(10)
        t.join()
    assert "saves queued" in caplog.text and "backlog" in caplog.text
    assert w.flush(10)
    assert all(h.ok and h.committed for h in (h1, h2, *handles))
    assert list_committed(storage) == [1, 2, 3]
    assert w.backlog == 0 and w.last_committed == 3 and w.last_durable == 3
    w.close()


# ------------------------------------------------------------------------------------- torn / corrupt


def committed_steps(storage: Storage, steps: list[int], parts: list[str] = ["a"]) -> None:
    ws = writers(storage, parts, keep=10)
    for step in steps:
        for w in ws:
            w.save(step, {"step": torch.tensor(step), "part": w.part_name})
    for w in ws:
        assert w.flush(10)
        w.close()


def test_torn_part_falls_back_to_previous(storage: Storage, caplog) -> None:
    committed_steps(storage, [1, 2])
    data = storage.read_bytes(fmt.part_data_path(2, "a"))
    storage.write_bytes(fmt.part_data_path(2, "a"), data[: len(data) // 2])  # truncated after commit
    with pytest.raises(CorruptCheckpointError, match="bytes"):
        load_part(storage, 2, "a")
    with caplog.at_level(logging.WARNING, logger="pipedream_ft.checkpoint"):
        step, state = load_latest(storage, "a")  # type: ignore[misc]
    assert step == 1 and int(state["step"]) == 1
    assert "step 2" in caplog.text and "corrupt" in caplog.text


def test_corrupted_byte_detected(storage: Storage) -> None:
    committed_steps(storage, [1, 2])
    data = bytearray(storage.read_bytes(fmt.part_data_path(2, "a")))
    data[len(data) // 2] ^= 0x01
    storage.write_bytes(fmt.part_data_path(2, "a"), bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum crc32:[0-9a-f]{8} does not match"):
        load_part(storage, 2, "a")
    assert load_latest(storage, "a")[0] == 1  # type: ignore[index]
    # With the older part gone too, no committed checkpoint is usable.
    storage.delete(fmt.part_data_path(1, "a"))
    assert load_latest(storage, "a") is None


def test_torn_commit_record_is_skipped(storage: Storage) -> None:
    committed_steps(storage, [1, 2])
    rec = storage.read_bytes(fmt.commit_path(2))
    storage.write_bytes(fmt.commit_path(2), rec[:10])
    latest = latest_committed(storage)
    assert latest is not None and latest.step == 1
    assert load_latest(storage, "a")[0] == 1  # type: ignore[index]


def test_crash_mid_write_is_ignored(storage: Storage) -> None:
    committed_steps(storage, [1])
    # Step 2: a part written without its meta and no commit; step 3: part + meta but no commit.
    storage.write_bytes(fmt.part_data_path(2, "a"), b"partial")
    storage.write_bytes(fmt.part_data_path(3, "a"), b"x")
    storage.write_bytes(fmt.part_meta_path(3, "a"), PartMeta("a", 3, fmt.sha256_hex(b"x"), 1).to_json())
    assert list_committed(storage) == [1]
    assert latest_committed(storage).step == 1  # type: ignore[union-attr]
    assert load_latest(storage, "a")[0] == 1  # type: ignore[index]
    with pytest.raises(CheckpointError, match="not committed"):
        load_part(storage, 3, "a")
    committed_steps(storage, [4])  # the next commit collects the uncommitted leftovers older than it
    assert storage.list("") == [fmt.step_dir(1), fmt.step_dir(4)]


def test_missing_part_in_record(storage: Storage) -> None:
    committed_steps(storage, [1])
    with pytest.raises(CheckpointError, match="no part 'zzz'"):
        load_part(storage, 1, "zzz")


# ------------------------------------------------------------------------------------- compatibility


def test_incompatible_metadata(storage: Storage) -> None:
    (w,) = writers(storage, ["a"], metadata={"plan_hash": "P", "profile_hash": "Q", "stages": (0, 1)})
    w.save(1, {"x": 1})
    assert w.flush(10)
    w.close()
    rec = read_commit(storage, 1)
    check_compatible(rec, plan_hash="P", profile_hash="Q", stages=[0, 1])
    check_compatible(rec, stages=(0, 1))
    with pytest.raises(CheckpointError, match="profile_hash is 'Q' in the checkpoint, this run expects 'Z'"):
        check_compatible(rec, plan_hash="P", profile_hash="Z")
    with pytest.raises(CheckpointError, match="no 'world_size'"):
        check_compatible(rec, world_size=4)
    with pytest.raises(CheckpointError, match="plan_hash"):
        load_latest(storage, "a", expected={"plan_hash": "other"})
    assert load_latest(storage, "a", expected={"plan_hash": "P"})[0] == 1  # type: ignore[index]


# ---------------------------------------------------------------------------------------- validation


def test_writer_validation(storage: Storage) -> None:
    with pytest.raises(ValueError, match="must be in expected_parts"):
        CheckpointWriter(storage, "a", expected_parts=["b"], is_committer=True)
    with pytest.raises(ValueError, match="keep must be an int >= 1, got 0"):
        CheckpointWriter(storage, "a", keep=0)
    with pytest.raises(ValueError, match="commit_timeout_s must be > 0, got 0"):
        CheckpointWriter(storage, "a", commit_timeout_s=0)
    with pytest.raises(ValueError, match="expected_parts must be unique"):
        CheckpointWriter(storage, "a", expected_parts=["a", "a"])
    with pytest.raises(TypeError, match="storage must be a Storage"):
        CheckpointWriter("/tmp/x", "a")  # type: ignore[arg-type]
    (w,) = writers(storage, ["a"])
    w.save(5, {"x": 1})
    with pytest.raises(ValueError, match="step must increase: got 5 after 5"):
        w.save(5, {"x": 1})
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        w.save(-1, {})
    with pytest.raises(TypeError, match="state must be a dict"):
        w.save(6, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="metadata must be JSON-serializable"):
        w.save(6, {}, {"obj": object()})
    with pytest.raises(TypeError, match="cannot checkpoint"):
        w.save(6, {"obj": object()})
    w.save(6, {"ok": 1})  # a rejected save does not consume its step
    assert w.close(10)
    with pytest.raises(CheckpointError, match="closed"):
        w.save(7, {})


def test_local_layout_on_disk(tmp_path) -> None:
    st = Storage(str(tmp_path))
    committed_steps(st, [12], parts=["a", "b"])
    d = tmp_path / "step-0000000012"
    assert sorted(os.listdir(d)) == ["COMMIT.json", "part-a.json", "part-a.pt", "part-b.json", "part-b.pt"]


def test_rewind_retires_later_commits_so_the_steps_are_written_anew(tmp_path) -> None:
    """After a roll-back to step 1 (a resume from an older checkpoint), the commits of steps 2 and 3 belong to
    a history that does not go on: they are retired, and steps 2 and 3 of the new history commit anew."""
    from pipedream_ft.checkpoint import load_part

    st = Storage(str(tmp_path / "ckpt"))
    w = CheckpointWriter(st, "a", is_committer=True, keep=10, poll_interval_s=0.005, max_poll_interval_s=0.02)
    for step in (1, 2, 3):
        w.save(step, {"x": torch.full((4,), float(step))})
    assert w.flush(10) and list_committed(st) == [1, 2, 3]
    assert w.rewind(1) == [2, 3]
    assert list_committed(st) == [1] and w.last_committed is None
    h = w.save(2, {"x": torch.full((4,), 20.0)})  # the step may be saved again, and is written, not skipped
    assert h.wait(10) and h.committed and w.last_committed == 2 and w.last_durable == 2
    assert list_committed(st) == [1, 2]
    assert torch.equal(load_part(st, 2, "a")["x"], torch.full((4,), 20.0))
    assert w.rewind(2) == [] and list_committed(st) == [1, 2]  # nothing newer: nothing retired
    w.close()


# ------------------------------------------------------------------------------------- one background


def test_one_background_thread_serves_every_part_of_a_process(storage: Storage) -> None:
    """A process of three stages writes its three parts with one thread: the writers share a Background, every
    step commits with every part, each part keeps its own durability, and closing them leaves the thread to its
    owner, which stops it."""
    from pipedream_ft.checkpoint.background import Background

    before = threading.active_count()
    background = Background("checkpoint-writer")
    parts = ["stage0-replica0", "stage2-replica0", "stage4-replica0"]
    ws = writers(storage, parts, background=background, keep=10)
    assert threading.active_count() == before + 1 and background.clients == 3
    assert [t.name for t in threading.enumerate()].count("checkpoint-writer") == 1
    handles = [[w.save(step, {"x": torch.full((3,), float(step * 10 + k))}) for k, w in enumerate(ws)]
               for step in (1, 2, 3)]
    assert all(w.flush(10) for w in ws)
    assert all(h.ok for row in handles for h in row)
    assert [row[0].committed for row in handles] == [True, True, True]  # the committer's handles
    assert [w.last_durable for w in ws] == [3, 3, 3] and ws[0].last_committed == 3
    assert list_committed(storage) == [1, 2, 3]
    assert read_commit(storage, 3).parts.keys() == set(parts)
    for k, name in enumerate(parts):
        assert torch.equal(load_part(storage, 2, name)["x"], torch.full((3,), float(20 + k)))
    for w in ws:
        assert w.close(10)
    assert background.clients == 0 and threading.active_count() == before + 1  # the owner closes it
    assert background.close(10) and threading.active_count() == before
    with pytest.raises(RuntimeError, match="background 'checkpoint-writer' is closed"):
        writers(storage, ["late"], background=background)


def test_a_part_retrying_on_the_shared_thread_does_not_hold_up_the_others(storage: Storage, caplog) -> None:
    """One part's writes fail and are tried again later; meanwhile the same thread writes the other parts (no
    sleeping in between), and once storage takes the part again the step commits."""
    from pipedream_ft.checkpoint.background import Background

    down = threading.Event()
    down.set()
    real_write = storage.write_bytes

    def write(rel: str, data: Any) -> None:
        if down.is_set() and "part-b" in rel:
            raise StorageError(f"{rel}: injected outage")
        real_write(rel, data)

    storage.write_bytes = write  # type: ignore[method-assign]
    background = Background("checkpoint-writer")
    w0, w1, w2 = writers(storage, ["a", "b", "c"], background=background, commit_timeout_s=30,
                         max_poll_interval_s=0.05)
    with caplog.at_level(logging.DEBUG, logger="pipedream_ft.checkpoint"):
        hb = w1.save(1, {"x": 1})  # b first: its retries come before a's and c's writes
        ha, hc = w0.save(1, {"x": 1}), w2.save(1, {"x": 1})
        assert hc.wait(10) and hc.ok and w2.last_durable == 1
        assert storage.exists(fmt.part_meta_path(1, "a")) and w0.last_durable == 1
        assert not hb.done() and not ha.done() and w1.backlog == 1
        down.clear()
        assert hb.wait(10) and hb.ok and ha.wait(10) and ha.committed
    # the run of failures is logged once
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "part b" in r.getMessage()]
    assert len(warned) == 1 and "retrying" in warned[0]
    assert list_committed(storage) == [1]
    for w in (w0, w1, w2):
        w.close(10)
    background.close(10)


def test_a_shared_background_is_validated() -> None:
    from pipedream_ft.checkpoint.background import Background

    storage = Storage(f"memory://pdft-test-{uuid.uuid4().hex}")
    background = Background("checkpoint-writer")
    with pytest.raises(ValueError, match=r"persist_nice=5 is for a writer's own thread; a shared background "
                                         r"\('checkpoint-writer'\) has its own nice \(None\)"):
        CheckpointWriter(storage, "a", background=background, persist_nice=5)
    with pytest.raises(TypeError, match="background must be a Background, got str"):
        CheckpointWriter(storage, "a", background="thread")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nice must be None or an int in \\[-20, 19\\], got 40"):
        Background("x", nice=40)
    with pytest.raises(ValueError, match="name must be a non-empty string, got ''"):
        Background("")
    assert background.close(10) and background.close(10)
