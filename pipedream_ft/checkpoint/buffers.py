"""The bytes of a file as a sequence of buffers, written without being joined."""

from __future__ import annotations

from typing import Any

__all__ = ["Buffers"]


class Buffers:
    """The bytes of a file as a sequence of buffers (memoryviews of tensors, headers), written without being
    joined. ``len()`` is the total size; slicing (``b[i:j]``) returns ``bytes`` (a copy of that range)."""

    __slots__ = ("chunks", "_size")

    def __init__(self, chunks: Any) -> None:
        self.chunks: list[memoryview] = [memoryview(c).cast("B") for c in chunks]
        self._size = sum(len(c) for c in self.chunks)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Any:
        return iter(self.chunks)

    def __getitem__(self, index: slice) -> bytes:
        if not isinstance(index, slice):
            raise TypeError(f"Buffers supports slices only, got {type(index).__name__}")
        start, stop, stride = index.indices(self._size)
        if stride != 1:
            raise ValueError(f"Buffers supports contiguous slices only, got step {stride}")
        out, pos = bytearray(), 0
        for c in self.chunks:
            lo, hi = max(start - pos, 0), min(stop - pos, len(c))
            if lo < hi:
                out += c[lo:hi]
            pos += len(c)
        return bytes(out)

    def join(self) -> bytes:
        """All the bytes in one object (a copy)."""
        return b"".join(self.chunks)
