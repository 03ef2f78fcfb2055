"""The in-memory tier: parts kept as files in shared memory (``/dev/shm``) on this node, private to the job.

Layout under ``<root>/pdft-<tag>-<job>/`` (root ``/dev/shm`` by default; ``tag`` is derived from the job's key,
so the path cannot be guessed without it)::

    .lock                     # every process using the tier holds a shared flock on it while it lives
    step-0000000120/
        part-stage0.pt        # the encoded part (tensorfile bytes)
        part-stage0.json      # {"checksum", "size", "mac", "sig"}, written after the part (atomic rename)

Files in ``/dev/shm`` are memory that outlives the process that wrote it: a rank that crashes and is restarted
on the same node finds its parts there. A part counts once its ``.json`` exists (the part file is renamed into
place first), so a writer killed mid-write leaves nothing listed. Parts of several ranks (and, through
:class:`~.peer.PeerServer`, copies of other nodes' parts) share the directory: part names are unique.

**Private to the job.** ``/dev/shm`` is writable by every local user, so nothing found there is trusted:
directories are created with mode 0700 and files with 0600 (``O_EXCL | O_NOFOLLOW``); every directory and file
opened must be owned by this user and writable by nobody else (a tier directory that fails this is refused
with one line naming it: :class:`UntrustedTierError`); and each part carries an HMAC-SHA256 under the job's key
over the tier's name, its step, part name, size, checksum and bytes (``mac``), and one over its record
(``sig``). A part whose record does not verify is not listed by :meth:`MemoryTier.steps` and a part whose bytes
do not verify is not loaded (:class:`CorruptCheckpointError`): a part planted by anyone without the key, or
left by another job, counts as absent, and a warning says so once.

**Cleaning up.** :meth:`MemoryTier.destroy` removes the tier when the job ends for good; :meth:`MemoryTier.leave`
removes it only if no other live process holds it. A job that died leaves its tier behind: the next tier
created on the node by the same user removes every ``pdft-*`` directory of this user that no live process holds
and that has not changed for ``reclaim_after_s`` (:func:`reclaim_stale`) — the grace period covers a group that
torchrun is restarting, whose next attempt needs the parts.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import stat
import time
import weakref
from typing import Any, Sequence

from ..atomic import replace_atomically, write_all
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
from .private import check_private, mac, open_private
from .reader import decode_verified
from .storage import Buffers
from .tiers import Tier

__all__ = ["DEFAULT_RECLAIM_S", "DEFAULT_SHM_ROOT", "MemoryTier", "UntrustedTierError", "leave_all",
           "reclaim_stale", "tier_directory"]

log = logging.getLogger(__name__)

DEFAULT_SHM_ROOT = "/dev/shm"
DEFAULT_RECLAIM_S = 600.0
"""A tier that no live process holds and that has not changed for this long belongs to a job that is gone."""
LOCK_NAME = ".lock"
TIER_PREFIX = "pdft-"
_JOB_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_MIN_KEY = 16
_OPEN: weakref.WeakSet[MemoryTier] = weakref.WeakSet()


class UntrustedTierError(CheckpointError):
    """The tier's directory (or a file in it) is another user's, or writable by others: it is not used."""


def tier_directory(job: str, key: bytes, root: str = DEFAULT_SHM_ROOT) -> str:
    """Where the tier of ``job`` under ``key`` lives."""
    return os.path.join(root, f"{TIER_PREFIX}{mac(key, 'memory-tier directory', job)[:12]}-{job}")


class MemoryTier(Tier):
    """Parts in shared memory, private to the job; see the module docstring.

    Args:
        job: identifies the job (letters, digits, ``_.-``); every rank of the job on this node uses the same.
        key: the job's secret (at least 16 bytes, see :mod:`pipedream_ft.ft.secret`); every process of the job
            uses the same.
        root: the shared-memory file system (``/dev/shm``); a test may use any directory.
        reclaim_after_s: first remove this user's tiers of jobs that are gone (:func:`reclaim_stale`) with this
            grace period; ``None``: don't.

    Raises :class:`UntrustedTierError` (one line naming the path) if the tier's directory exists and is not this
    user's alone.
    """

    name = "memory"

    def __init__(self, job: str, *, key: bytes, root: str = DEFAULT_SHM_ROOT,
                 reclaim_after_s: float | None = DEFAULT_RECLAIM_S) -> None:
        if not isinstance(job, str) or not _JOB_RE.match(job):
            raise ValueError(f"job must match [A-Za-z0-9_][A-Za-z0-9_.-]* (at most 128 characters), got {job!r}")
        if not isinstance(key, bytes) or len(key) < _MIN_KEY:
            raise ValueError(f"key must be at least {_MIN_KEY} bytes, got {type(key).__name__} "
                             f"of {len(key) if isinstance(key, bytes) else '?'} bytes")
        if not os.path.isdir(root):
            raise CheckpointError(f"shared-memory directory {root!r} does not exist (is /dev/shm mounted?)")
        self.job = job
        self.key = key
        self.directory = tier_directory(job, key, root)
        self._warned: set[str] = set()
        self._lock_fd: int | None = None
        if reclaim_after_s is not None:
            for path in reclaim_stale(root, older_than_s=reclaim_after_s, keep=self.directory):
                log.info("memory tier: removed %s (its job is gone)", path)
        self._make_dir(self.directory)
        self._hold()
        _OPEN.add(self)

    # -- private files ----------------------------------------------------------------------------------------

    def _make_dir(self, path: str) -> None:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        try:
            st = os.lstat(path)
            check_private(path, st, directory=True)
        except PermissionError as exc:
            raise UntrustedTierError(f"memory tier: {exc}") from None
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, 0o700)  # ours, from an older version: readable by others no more

    def _hold(self) -> None:
        """Take a shared lock on the tier's lock file for as long as this process lives (see :func:`reclaim_stale`)."""
        path = os.path.join(self.directory, LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise UntrustedTierError(f"memory tier: cannot open {path}: {exc}") from None
        try:
            check_private(path, os.fstat(fd), directory=False)
            fcntl.flock(fd, fcntl.LOCK_SH)
        except PermissionError as exc:
            os.close(fd)
            raise UntrustedTierError(f"memory tier: {exc}") from None
        self._lock_fd = fd

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s", message)

    def _part_paths(self, step: int, part: str) -> tuple[str, str]:
        d = os.path.join(self.directory, step_dir(step))
        base = f"{PART_PREFIX}{validate_part_name(part)}"
        return os.path.join(d, base + PART_DATA_SUFFIX), os.path.join(d, base + PART_META_SUFFIX)

    def _header(self, step: int, part: str, size: int, checksum: str) -> tuple[Any, ...]:
        return ("pipedream-ft memory-tier part", self.job, step, part, size, checksum)

    def _data_mac(self, header: tuple[Any, ...], chunks: Sequence[Any]) -> str:
        h = hmac.new(self.key, mac(self.key, *header).encode(), hashlib.sha256)
        for chunk in chunks:
            h.update(chunk)
        return h.hexdigest()

    # -- the tier -----------------------------------------------------------------------------------------------

    def put(self, step: int, part: str, data: Buffers | bytes, checksum: str) -> None:
        validate_step(step)
        parse_checksum(checksum)
        data_path, meta_path = self._part_paths(step, part)
        self._make_dir(os.path.dirname(data_path))
        try:  # a stale meta must not describe the new data while it is written
            os.unlink(meta_path)
        except FileNotFoundError:
            pass
        chunks = data.chunks if isinstance(data, Buffers) else [memoryview(data)]
        size = _write_atomic(data_path, chunks)
        header = self._header(step, part, size, checksum)
        data_mac = self._data_mac(header, chunks)
        doc = {"checksum": checksum, "size": size, "mac": data_mac, "sig": mac(self.key, *header, data_mac)}
        _write_atomic(meta_path, [memoryview(json.dumps(doc).encode())])

    def _meta(self, step: int, part: str) -> dict[str, Any]:
        """The part's verified record; :class:`CheckpointError` if it is absent, :class:`CorruptCheckpointError`
        if it is unreadable or not this job's."""
        _, meta_path = self._part_paths(validate_step(step), part)
        what = f"memory tier: part {part!r} step {step}"
        try:
            fd = open_private(meta_path)
        except FileNotFoundError:
            raise CheckpointError(f"memory tier {self.directory}: no part {part!r} at step {step}") from None
        except PermissionError as exc:
            raise CorruptCheckpointError(f"{what}: {exc}") from None
        try:
            with os.fdopen(fd, "rb") as f:
                doc = json.loads(f.read(1 << 16))
            checksum, size, data_mac, sig = doc["checksum"], doc["size"], doc["mac"], doc["sig"]
            parse_checksum(checksum)
            if type(size) is not int or size < 0 or not isinstance(data_mac, str) or not isinstance(sig, str):
                raise ValueError("bad size or MAC")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{what}: bad meta: {exc}") from None
        expected = mac(self.key, *self._header(step, part, size, checksum), data_mac)
        if not _equal(sig, expected):
            raise CorruptCheckpointError(f"{what}: its record is not signed with this job's key (planted, or left "
                                         "by another job); ignored")
        return doc

    def steps(self, parts: Sequence[str]) -> list[int]:
        out = []
        for name in self._step_dirs():
            step = parse_step_dir(name)
            assert step is not None
            if all(self._listed(step, p) for p in parts):
                out.append(step)
        return sorted(out)

    def _listed(self, step: int, part: str) -> bool:
        try:
            self._meta(step, part)
            return True
        except CorruptCheckpointError as exc:
            self._warn_once(f"{step}/{part}", f"{exc} (treated as absent)")
            return False
        except CheckpointError:
            return False

    def _step_dirs(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.directory) if parse_step_dir(n) is not None]
        except FileNotFoundError:
            return []

    def meta(self, step: int, part: str) -> tuple[str, int]:
        """``(checksum, size)`` of a stored part; :class:`CheckpointError` if it is not stored (or not this
        job's: :class:`CorruptCheckpointError`)."""
        doc = self._meta(step, part)
        return doc["checksum"], doc["size"]

    def read_raw(self, step: int, part: str) -> tuple[bytearray, str, int]:
        """The stored bytes with their recorded checksum and size; their MAC is verified (a part not written
        with this job's key raises :class:`CorruptCheckpointError`), their checksum is not."""
        doc = self._meta(step, part)
        checksum, size = doc["checksum"], doc["size"]
        data_path, _ = self._part_paths(step, part)
        what = f"memory tier: part {part!r} step {step}"
        try:
            fd = open_private(data_path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{what}: data file missing") from None
        except PermissionError as exc:
            raise CorruptCheckpointError(f"{what}: {exc}") from None
        with os.fdopen(fd, "rb", buffering=0) as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(buf)
        if not _equal(doc["mac"], self._data_mac(self._header(step, part, len(buf), checksum), [buf])):
            self._warn_once(f"{step}/{part}/data", f"{what}: its bytes do not match the MAC of this job's key "
                            "(planted or changed); ignored")
            raise CorruptCheckpointError(f"{what}: its bytes do not match their MAC under this job's key")
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

    # -- the end --------------------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Remove this job's directory and everything in it (the job is done for good)."""
        shutil.rmtree(self.directory, ignore_errors=True)
        self.close()

    def leave(self) -> bool:
        """This process is done with the tier for good: remove it if no other live process holds it (the last
        one to leave removes it). Returns whether it was removed."""
        fd = self._lock_fd
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            self.close()
            return False
        self.destroy()
        return True

    def close(self) -> None:
        """Stop holding the tier (it stays, for the job's other processes)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        _OPEN.discard(self)


def leave_all() -> list[str]:
    """The job is over for good for this process: :meth:`~MemoryTier.leave` every tier it opened (the last
    process of the job to leave a tier removes it). Returns the removed directories."""
    removed = []
    for tier in list(_OPEN):
        try:
            if tier.leave():
                removed.append(tier.directory)
        except OSError as exc:
            log.warning("memory tier %s: could not remove it: %s", tier.directory, exc)
    return removed


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def reclaim_stale(root: str = DEFAULT_SHM_ROOT, *, older_than_s: float = DEFAULT_RECLAIM_S,
                  keep: str | None = None) -> list[str]:
    """Remove this user's ``pdft-*`` directories in ``root`` whose job is gone: no live process holds their lock
    (or they have none: a failed start, an older version) and nothing in them changed for ``older_than_s``.
    Other users' directories are left alone. Returns the removed paths."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(TIER_PREFIX)]
    except OSError:
        return removed
    now = time.time()
    for name in names:
        path = os.path.join(root, name)
        if path == keep:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or now - st.st_mtime < older_than_s:
            continue
        try:
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        except OSError:
            continue
        try:
            if fd is not None:
                if os.fstat(fd).st_uid != os.getuid():
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                        continue  # a live process of that job holds it
                    raise
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _write_atomic(path: str, chunks: Sequence[memoryview]) -> int:
    def write(tmp: str) -> int:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            return write_all(fd, chunks)
        finally:
            os.close(fd)

    return replace_atomically(path, write)
