"""The in-memory tier: parts kept as files in shared memory (``/dev/shm``) on this node.

Layout under ``<root>/<job>/`` (root ``/dev/shm`` by default)::

    step-0000000120/
        part-stage0.pt        # the encoded part (tensorfile bytes)
        part-stage0.json      # {"checksum": "crc32:...", "size": n}, written after the part (atomic rename)

Files in ``/dev/shm`` are memory that outlives the process that wrote it: a rank that crashes and is restarted
on the same node finds its parts there. A part counts once its ``.json`` exists (the part file is renamed into
place first), so a writer killed mid-write leaves nothing listed. Parts of several ranks (and, through
:class:`~.peer.PeerServer`, copies of other nodes' parts) share the directory: part names are unique.

The directory is job-scoped (``job`` is e.g. the torchrun run id) and removed by :meth:`MemoryTier.destroy`
when the job ends; shared memory counts against the node's RAM, so keep few steps (``keep_last``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any, Sequence

from .checksum import parse_checksum
from .format import (
    PART_DATA_SUFFIX,
    PART_META_SUFFIX,
    PART_PREFIX,
    CheckpointError,
    CorruptCheckpointError,
    parse_step_dir,
    step_dir,
    validate_part_name,
    validate_step,
)
from .reader import decode_verified
from .storage import Buffers
from .tiers import Tier

__all__ = ["DEFAULT_SHM_ROOT", "MemoryTier"]

DEFAULT_SHM_ROOT = "/dev/shm"
_JOB_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")


class MemoryTier(Tier):
    """Parts in shared memory under ``<root>/pdft-<job>``; see the module docstring.

    Args:
        job: identifies the job (letters, digits, ``_.-``); every rank of the job on this node uses the same.
        root: the shared-memory file system (``/dev/shm``); a test may use any directory.
    """

    name = "memory"

    def __init__(self, job: str, *, root: str = DEFAULT_SHM_ROOT) -> None:
        if not isinstance(job, str) or not _JOB_RE.match(job):
            raise ValueError(f"job must match [A-Za-z0-9_][A-Za-z0-9_.-]* (at most 128 characters), got {job!r}")
        if not os.path.isdir(root):
            raise CheckpointError(f"shared-memory directory {root!r} does not exist (is /dev/shm mounted?)")
        self.job = job
        self.directory = os.path.join(root, f"pdft-{job}")
        os.makedirs(self.directory, exist_ok=True)

    def _part_paths(self, step: int, part: str) -> tuple[str, str]:
        d = os.path.join(self.directory, step_dir(step))
        base = f"{PART_PREFIX}{validate_part_name(part)}"
        return os.path.join(d, base + PART_DATA_SUFFIX), os.path.join(d, base + PART_META_SUFFIX)

    def put(self, step: int, part: str, data: Buffers | bytes, checksum: str) -> None:
        validate_step(step)
        parse_checksum(checksum)
        data_path, meta_path = self._part_paths(step, part)
        os.makedirs(os.path.dirname(data_path), exist_ok=True)
        try:  # a stale meta must not describe the new data while it is written
            os.unlink(meta_path)
        except FileNotFoundError:
            pass
        size = _write_atomic(data_path, data)
        _write_atomic(meta_path, json.dumps({"checksum": checksum, "size": size}).encode())

    def steps(self, parts: Sequence[str]) -> list[int]:
        out = []
        for name in self._step_dirs():
            step = parse_step_dir(name)
            assert step is not None
            if all(os.path.exists(self._part_paths(step, p)[1]) for p in parts):
                out.append(step)
        return sorted(out)

    def _step_dirs(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.directory) if parse_step_dir(n) is not None]
        except FileNotFoundError:
            return []

    def meta(self, step: int, part: str) -> tuple[str, int]:
        """``(checksum, size)`` of a stored part; :class:`CheckpointError` if it is not stored."""
        _, meta_path = self._part_paths(validate_step(step), part)
        try:
            with open(meta_path, "rb") as f:
                doc = json.loads(f.read())
            parse_checksum(doc["checksum"])
            size = doc["size"]
            if type(size) is not int or size < 0:
                raise ValueError(f"bad size {size!r}")
        except FileNotFoundError:
            raise CheckpointError(f"memory tier {self.directory}: no part {part!r} at step {step}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"memory tier: part {part!r} step {step}: bad meta: {exc}") from None
        return doc["checksum"], size

    def read_raw(self, step: int, part: str) -> tuple[bytearray, str, int]:
        """The stored bytes with their recorded checksum and size (not verified)."""
        checksum, size = self.meta(step, part)
        data_path, _ = self._part_paths(step, part)
        try:
            with open(data_path, "rb", buffering=0) as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(buf)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"memory tier: part {part!r} step {step}: data file missing") from None
        return buf, checksum, size

    def get(self, step: int, part: str) -> dict[str, Any]:
        buf, checksum, size = self.read_raw(step, part)
        return decode_verified(buf, checksum, size, f"memory tier: part {part!r} step {step}")

    def keep_last(self, k: int, parts: Sequence[str] | None = None) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if parts is None:
            steps = sorted(parse_step_dir(n) for n in self._step_dirs())  # type: ignore[type-var]
            for step in steps[:-k]:
                shutil.rmtree(os.path.join(self.directory, step_dir(step)), ignore_errors=True)
            return
        for part in parts:
            steps = self.steps([part])
            for step in steps[:-k]:
                for path in reversed(self._part_paths(step, part)):  # the meta first: never a listed torn part
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
                try:
                    os.rmdir(os.path.join(self.directory, step_dir(step)))
                except OSError:
                    pass  # other parts still there

    def destroy(self) -> None:
        """Remove this job's directory and everything in it (at job end)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def _write_atomic(path: str, data: Buffers | bytes) -> int:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    size = 0
    try:
        with open(tmp, "wb", buffering=0) as f:
            for chunk in data.chunks if isinstance(data, Buffers) else (data,):
                view = memoryview(chunk)
                while view:
                    n = f.write(view)
                    size += n
                    view = view[n:]
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return size
