"""The safetensors file format laid out ahead of the data, so several processes can each write their own tensors
into one file (or each into its own shard) without any of them holding the others'.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
``[begin, end)`` byte range in the data that follows, and the tensors' raw bytes. :func:`layout` computes the
header from the tensors' names, dtypes and shapes alone (:class:`Entry`); :func:`write_tensor` writes one tensor's
bytes at its place (``os.pwrite``), so the file is complete once every writer has written its tensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["Entry", "Layout", "entry_of", "layout", "write_file", "write_header", "write_tensor"]

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor as the header names it."""

    key: str
    dtype: str
    """The safetensors dtype name (``"F32"``, ``"BF16"``, ...)."""
    shape: tuple[int, ...]
    nbytes: int


def entry_of(key: str, t: torch.Tensor) -> Entry:
    """The :class:`Entry` of tensor ``t`` under ``key``; ``ValueError`` for a dtype safetensors has no name for."""
    if t.dtype not in _DTYPES:
        raise ValueError(f"safetensors cannot hold {key} of dtype {t.dtype}")
    return Entry(key, _DTYPES[t.dtype], tuple(t.shape), t.numel() * t.element_size())


@dataclass(frozen=True, slots=True)
class Layout:
    """Where everything goes in one file."""

    header: bytes
    """The length prefix and the JSON header, padded to 8 bytes."""
    offsets: dict[str, int]
    """Each tensor's absolute byte offset in the file."""
    size: int
    """The whole file's size."""


def layout(entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> Layout:
    """The header and offsets of a file holding ``entries`` in that order."""
    body: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    begin = 0
    for e in entries:
        body[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [begin, begin + e.nbytes]}
        begin += e.nbytes
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    header = len(text).to_bytes(8, "little") + text
    offsets, at = {}, len(header)
    for e in entries:
        offsets[e.key] = at
        at += e.nbytes
    return Layout(header, offsets, at)


def write_tensor(fd: int, t: torch.Tensor, offset: int) -> None:
    """Write ``t``'s bytes (moved to the CPU, made contiguous) at ``offset`` of the open file ``fd``."""
    _pwrite(fd, memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()), offset)


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def write_header(fd: int, plan: Layout) -> None:
    """Write ``plan``'s header at the start of ``fd`` and give the file its full size (the data is written after,
    by whoever holds each tensor)."""
    _pwrite(fd, memoryview(plan.header), 0)
    os.ftruncate(fd, plan.size)


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as one safetensors file at ``path`` (tensors sharing memory are written as copies)."""
    entries = [entry_of(k, t) for k, t in tensors.items()]
    plan = layout(entries, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite(fd, memoryview(plan.header), 0)
        for key, t in tensors.items():
            write_tensor(fd, t, plan.offsets[key])
        os.ftruncate(fd, plan.size)
        os.fsync(fd)
    finally:
        os.close(fd)
