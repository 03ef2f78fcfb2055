"""Files replaced whole or not at all: the new content goes to a temporary file beside the target, which is then
renamed over it (a reader sees the old file or the new one, never half of one; a failed write leaves no
temporary file behind)."""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Iterable, TypeVar

__all__ = ["replace_atomically", "write_all"]

T = TypeVar("T")


def replace_atomically(path: str, write: Callable[[str], T], *, tmp: str | None = None) -> T:
    """Call ``write(tmp)`` to write a temporary file (default: ``path`` with a random suffix, in the same
    directory), then rename it to ``path``; if either fails the temporary file is removed and the error raised.
    Returns what ``write`` returned."""
    tmp = tmp if tmp is not None else f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        out = write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return out


def write_all(fd: int, chunks: Iterable[Any]) -> int:
    """Write every chunk (bytes-like) to ``fd``, going on after short writes; returns the bytes written."""
    size = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            n = os.write(fd, view)
            size += n
            view = view[n:]
    return size
