"""Private files: refusing what another user could have planted or changed, and keyed MACs.

The memory tier and the job's key files live in shared places (``/dev/shm``) where any local user can create
names. What this user's processes open there must be this user's and writable by nobody else; a part must also
carry an HMAC under the job's key (:func:`mac`), so that a file of the right owner but of another job (or
written by anything without the key) is rejected too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from typing import Any

__all__ = ["check_private", "mac", "open_private"]


def mac(key: bytes, *fields: Any) -> str:
    """HMAC-SHA256 (hex) under ``key`` of ``fields`` (each as text or bytes, length-prefixed so that no two
    lists of fields collide)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for f in fields:
        raw = bytes(f) if isinstance(f, (bytes, bytearray, memoryview)) else str(f).encode()
        h.update(len(raw).to_bytes(8, "big"))
        h.update(raw)
    return h.hexdigest()


def check_private(path: str, st: os.stat_result, *, directory: bool) -> None:
    """Refuse (:class:`PermissionError`, one line naming ``path``) a file or directory that another user owns,
    that group or others may write, or that is not what it should be (a symlink, a device...). Root passes
    every permission check of the kernel, so this check is what stops a root process from using another user's
    files."""
    what = "directory" if directory else "file"
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        raise PermissionError(f"{path} is not a regular {what} (mode {stat.filemode(st.st_mode)}); refusing it")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); "
                              "refusing it")
    if st.st_mode & 0o022:
        raise PermissionError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                              "refusing it")


def open_private(path: str) -> int:
    """A read-only descriptor of ``path`` (never through a symlink), after :func:`check_private`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        check_private(path, os.fstat(fd), directory=False)
    except BaseException:
        os.close(fd)
        raise
    return fd
