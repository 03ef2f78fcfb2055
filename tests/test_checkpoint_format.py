"""Part file format (tensorfile), checksums, snapshots (immutable references, reused buffers), O_DIRECT writes,
and reading checkpoints written by the previous format (torch.save parts, SHA-256 records)."""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from collections import OrderedDict
from typing import Any

import pytest
import torch

from pipedream_ft.checkpoint import (
    Buffers,
    CheckpointWriter,
    CorruptCheckpointError,
    SnapshotPool,
    Storage,
    immutable,
    list_committed,
    load_latest,
    load_part,
    read_commit,
)
from pipedream_ft.checkpoint import checksum as cks
from pipedream_ft.checkpoint import directio
from pipedream_ft.checkpoint import format as fmt
from pipedream_ft.checkpoint.tensorfile import ALIGN, decode_part, encode_part

pytestmark = pytest.mark.timeout(60)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    else:
        assert type(a) is type(b) and a == b


def every_kind() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 5, generator=g)
    return {
        "f32": w, "view": w.t()[1:4], "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, generator=g).half(), "f64": torch.randn(2, 2, generator=g).double(),
        "i64": torch.arange(9), "i8": torch.tensor([-1, 2], dtype=torch.int8), "u8": torch.tensor([255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "c64": torch.tensor([1 + 2j, -3j]), "scalar": torch.tensor(4.5),
        "empty": torch.empty(0, 3), "param": torch.nn.Parameter(torch.ones(2)),
        "same_twice": [w, w],
        "special": [float("nan"), float("inf"), float("-inf"), -0.0, 1e300, 0.1],
        "ints": [0, -1, 2**62, True, False, None], "text": "ünïcode ✓", "raw": b"\x00\xffbytes",
        "complex": 1.5 - 2j, "dtype": torch.float16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
        "ordered": OrderedDict([("b", 1), ("a", 2)]), "int_keys": {0: {"momentum_buffer": torch.zeros(2)}, 7: "x"},
        "nested": [1, [2, (3, {"k": (torch.ones(1),)})]], "tuple": (), "dict": {},
    }


def test_tensorfile_round_trip_is_bitwise_and_keeps_types() -> None:
    state = every_kind()
    enc = encode_part(state)
    data = bytearray(Buffers(enc.chunks()).join())
    assert len(data) == enc.size
    assert all(off % ALIGN == 0 for off in enc.offsets)  # every tensor on a block boundary (O_DIRECT)
    back = decode_part(data)
    expected = dict(state, param=state["param"].detach(), view=state["view"].contiguous())
    same(back, expected)
    # the same tensor twice is stored once and comes back as one tensor
    assert back["same_twice"][0].data_ptr() == back["same_twice"][1].data_ptr()
    assert back["f32"].data_ptr() == back["same_twice"][0].data_ptr()
    # tensors view the buffer read (no copy) and are writable
    back["i64"][0] = 42
    assert not back["param"].requires_grad


def test_tensorfile_rejects_unsupported_and_refuses_corrupt_bytes() -> None:
    import numpy as np

    with pytest.raises(TypeError, match=r"state\['a'\]\[0\]: cannot checkpoint .*ndarray"):
        encode_part({"a": [np.zeros(2)]})
    with pytest.raises(TypeError, match="dict keys must be str or int"):
        encode_part({(1, 2): 3})
    good = bytearray(Buffers(encode_part({"t": torch.arange(100)}).chunks()).join())
    for bad, match in [
        (b"", "too short"),
        (b"NOTAPART" + bytes(100), "not a part file"),
        (good[:20], "does not fit"),
        (good[: len(good) - 8], "does not fit"),
    ]:
        with pytest.raises(CorruptCheckpointError, match=match):
            decode_part(bytearray(bad))
    header = json.loads(bytes(good[16 : 16 + int.from_bytes(good[8:16], "little")]))
    for mutate in [lambda h: h.update(format=9), lambda h: h["tensors"][0].update(dtype="float128"),
                   lambda h: h["tensors"][0].update(offset=10**9), lambda h: h.update(tree={"T": 5}),
                   lambda h: h.update(tree={"zz": 1}), lambda h: h.update(byteorder="middle")]:
        h = json.loads(json.dumps(header))
        mutate(h)
        raw = json.dumps(h).encode()
        blob = bytearray(b"PDFTTNS1" + len(raw).to_bytes(8, "little") + raw)
        blob += bytes(len(good))
        with pytest.raises(CorruptCheckpointError):
            decode_part(blob)


def test_checksums() -> None:
    data = b"123456789"
    assert cks.checksum([data]) == "crc32:cbf43926"  # the standard CRC-32 check value
    assert cks.checksum([data[:4], data[4:]]) == "crc32:cbf43926"
    assert cks.checksum([data], "sha256").startswith("sha256:15e2b0d3c33891eb")
    assert cks.parse_checksum("crc32:cbf43926") == ("crc32", "cbf43926")
    with pytest.raises(ValueError, match="checksum must be"):
        cks.parse_checksum("crc32:cbf4392")
    with pytest.raises(ValueError, match="checksum must be one of"):
        cks.validate_algorithm("md5")


def test_snapshot_references_immutable_and_reuses_buffers() -> None:
    pool = SnapshotPool(max_arenas=1)
    frozen, live = torch.randn(1 << 16), torch.randn(1 << 16)
    s1 = pool.take({"v": immutable([frozen]), "m": live, "n": 3})
    assert s1.tree["v"][0].data_ptr() == frozen.data_ptr()  # referenced
    assert s1.tree["m"].data_ptr() != live.data_ptr() and torch.equal(s1.tree["m"], live)  # copied
    assert s1.copied_bytes == live.numel() * 4 and s1.referenced_bytes == frozen.numel() * 4
    assert s1.tree["m"].data_ptr() % directio.BLOCK == 0  # page-aligned: written with O_DIRECT without a copy
    first = s1.tree["m"].data_ptr()
    s2 = pool.take({"v": immutable([frozen]), "m": live, "n": 3})  # s1 not released: fresh buffers
    assert s2.tree["m"].data_ptr() != first
    s1.release()
    s2.release()
    live.add_(1)
    s3 = pool.take({"v": immutable([frozen]), "m": live, "n": 3})
    assert s3.tree["m"].data_ptr() == first and torch.equal(s3.tree["m"], live)  # reused, new value
    s3.release()
    s4 = pool.take({"m": live.reshape(2, -1)})  # the structure changed: a new buffer for the new shape
    assert s4.tree["m"].shape == (2, 1 << 15)
    s4.release()
    with pytest.raises(TypeError, match="cannot checkpoint"):
        pool.take({"x": object()})
    assert pool.take({"m": live}).tree["m"].data_ptr() == first  # the failed take released its buffers


def test_immutable_tensors_are_not_copied_by_save(tmp_path) -> None:
    st = Storage(str(tmp_path))
    w = CheckpointWriter(st, "a", is_committer=True, poll_interval_s=0.005)
    versions = {3: [torch.randn(1000), torch.randn(10)]}
    mutable = torch.zeros(1000)
    h = w.save(1, {"versions": immutable(versions), "opt": mutable})
    assert h.referenced_bytes == 4040 and h.copied_bytes == 4000
    mutable.add_(1)  # copied: the checkpoint keeps the old value
    assert h.wait(10) and h.ok and h.persist_cpu_s is not None and h.bytes
    _, got = load_latest(st, "a")  # type: ignore[misc]
    assert torch.equal(got["versions"][3][0], versions[3][0]) and torch.equal(got["opt"], torch.zeros(1000))
    w.close()


@pytest.mark.parametrize("sizes", [[1], [4096], [5000, 3, 8192, 1], [1 << 20, 17, (1 << 20) + 5]])
def test_direct_io_writes_exact_bytes(tmp_path, sizes: list[int]) -> None:
    rng = torch.Generator().manual_seed(sum(sizes))
    chunks = []
    for n in sizes:
        aligned = directio.aligned_empty((n,), torch.uint8)
        aligned.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng))
        chunks.append(memoryview(aligned.numpy()))
        chunks.append(memoryview(os.urandom(n % 100 + 1)))  # unaligned ones between
    expected = b"".join(bytes(c) for c in chunks)
    # tmpfs refuses O_DIRECT: then try the checkout's file system
    places = [tmp_path, Path(__file__).resolve().parent.parent]
    for place in places:
        path = str(place / f".direct-io-test-{os.getpid()}-{len(sizes)}")
        try:
            fd = directio.open_direct(path)
        except directio.DirectIOUnsupported as exc:
            assert "O_DIRECT" in str(exc)  # the refusal is recognised (writers then fall back to buffered I/O)
            continue
        try:
            try:
                assert directio.write_direct(fd, chunks) == len(expected)
            finally:
                os.close(fd)
            with open(path, "rb") as f:
                assert f.read() == expected
        finally:
            os.unlink(path)
        return


def test_storage_falls_back_to_buffered_writes_where_o_direct_is_refused(tmp_path, monkeypatch) -> None:
    def refuse(path: str) -> int:
        raise directio.DirectIOUnsupported(22, "refused", path)

    monkeypatch.setattr(directio, "open_direct", refuse)
    st = Storage(str(tmp_path))
    data = Buffers([os.urandom(3 << 20), b"tail"])
    st.write_bytes("x/part.pt", data)
    assert st.direct_io is False  # remembered: no further attempts
    assert st.read_bytes("x/part.pt") == data.join()
    assert data[5:9] == data.join()[5:9] and len(data) == (3 << 20) + 4


def test_sha256_writer_option(tmp_path) -> None:
    st = Storage(str(tmp_path))
    with pytest.raises(ValueError, match="checksum must be one of"):
        CheckpointWriter(st, "a", checksum="md5")
    w = CheckpointWriter(st, "a", is_committer=True, checksum="sha256", poll_interval_s=0.005)
    w.save(1, {"x": torch.ones(3)})
    assert w.flush(10)
    w.close()
    rec = read_commit(st, 1)
    assert rec.parts["a"].checksum.startswith("sha256:") and rec.parts["a"].sha256 is not None
    assert torch.equal(load_part(st, 1, "a")["x"], torch.ones(3))


def write_format1_checkpoint(st: Storage, step: int, state: dict[str, Any]) -> None:
    """A checkpoint exactly as the previous version wrote it: torch.save part, records with format 1."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    sha = fmt.sha256_hex(data)
    st.write_bytes(fmt.part_data_path(step, "a"), data)
    st.write_bytes(fmt.part_meta_path(step, "a"),
                   json.dumps({"format": 1, "name": "a", "step": step, "sha256": sha, "size": len(data)}).encode())
    record = {"format": 1, "step": step, "wall_time": 1.0, "parts": {"a": {"sha256": sha, "size": len(data)}},
              "metadata": {"plan_hash": "p"}}
    st.write_bytes(fmt.commit_path(step), json.dumps(record).encode())


def test_previous_format_checkpoints_are_still_read(tmp_path) -> None:
    st = Storage(str(tmp_path))
    old = {"model": {"w": torch.randn(4, 4)}, "position": 10, "names": ["w"]}
    write_format1_checkpoint(st, 10, old)
    rec = read_commit(st, 10)
    assert rec.parts["a"].checksum.startswith("sha256:")
    same(load_part(st, 10, "a"), old)
    # a new-format checkpoint after it; both listed, the newest loaded, and the old one still verifies
    w = CheckpointWriter(st, "a", is_committer=True, keep=5, poll_interval_s=0.005)
    w.save(20, {"model": {"w": torch.zeros(4, 4)}, "position": 20})
    assert w.flush(10)
    w.close()
    assert list_committed(st) == [10, 20]
    assert load_latest(st, "a")[0] == 20  # type: ignore[index]
    data = bytearray(st.read_bytes(fmt.part_data_path(10, "a")))
    data[len(data) // 2] ^= 1
    st.write_bytes(fmt.part_data_path(10, "a"), bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum sha256:"):
        load_part(st, 10, "a")
