"""Checkpoint files in a local directory: atomic, durable writes and exact create-if-absent.

A write goes to a temporary file in the same directory, which is flushed and fsynced, renamed over the target,
and the directory fsynced. Large parts given as :class:`~.buffers.Buffers` are written with ``O_DIRECT``
(:mod:`.directio`) where the file system allows it. Paths are relative to the root and use ``/``; retrying,
redaction and the checks on arguments are :class:`~.storage.Storage`'s.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid

from ..atomic import replace_atomically, write_all
from . import directio
from .buffers import Buffers

__all__ = ["LocalFiles", "TMP_MARKER"]

logger = logging.getLogger(__name__)

TMP_MARKER = ".tmp-"
"""In the name of every temporary file a write leaves while it runs (listings skip them)."""
_DIRECT_MIN_BYTES = 1 << 20


class LocalFiles:
    """The files under the directory ``root`` (an absolute path)."""

    protocol = "file"
    exact_create = True
    """:meth:`create` is exact: of two racing creators, one gets ``True``."""

    def __init__(self, root: str, *, direct_io: bool = True, name: str = "") -> None:
        self.root = root
        self.direct_io = bool(direct_io)
        """Whether large writes use O_DIRECT (turned off for good when the file system refuses it)."""
        self._name = name or root
        """How log lines name this storage (a redacted URL)."""

    def path(self, rel: str) -> str:
        return os.path.join(self.root, *[p for p in rel.split("/") if p])

    def per_process(self) -> bool:
        return False

    def container_missing(self) -> bool:
        return False

    def write(self, rel: str, data: bytes | Buffers, durable: bool) -> None:
        path = self.path(rel)
        directory = os.path.dirname(path)
        created = not os.path.isdir(directory)
        make_dirs(directory)
        tmp = os.path.join(directory, f".{os.path.basename(path)}{TMP_MARKER}{uuid.uuid4().hex[:12]}")

        def write(tmp: str) -> None:
            if self._write_direct(tmp, data, durable):
                return
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_all(fd, data.chunks if isinstance(data, Buffers) else (data,))
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)

        replace_atomically(path, write, tmp=tmp)
        if durable:
            fsync_dir(directory)
            if created:
                fsync_dir(os.path.dirname(directory))

    def _write_direct(self, tmp: str, data: bytes | Buffers, durable: bool) -> bool:
        """Write ``tmp`` with O_DIRECT if it pays (large :class:`Buffers`, durable) and the file system allows it;
        returns False (nothing left behind) where it does not, so the caller writes it buffered."""
        if not (self.direct_io and durable and isinstance(data, Buffers) and len(data) >= _DIRECT_MIN_BYTES):
            return False
        try:
            fd = directio.open_direct(tmp)
        except directio.DirectIOUnsupported:
            self.direct_io = False
            logger.info("checkpoint storage %s: O_DIRECT refused by the file system; writing through the page "
                        "cache", self._name)
            return False
        try:
            directio.write_direct(fd, data.chunks)
            os.fsync(fd)
        except directio.DirectIOUnsupported:
            self.direct_io = False
            logger.info("checkpoint storage %s: O_DIRECT write refused; writing through the page cache", self._name)
            os.close(fd)
            os.unlink(tmp)
            return False
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return True

    def create(self, rel: str, data: bytes) -> bool:
        """The complete file is hard-linked into place, which fails if the name exists."""
        path = self.path(rel)
        directory = os.path.dirname(path)
        make_dirs(directory)
        tmp = os.path.join(directory, f".{os.path.basename(path)}{TMP_MARKER}{uuid.uuid4().hex[:12]}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                write_all(fd, (data,))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        fsync_dir(directory)
        return True

    def read(self, rel: str) -> bytes:
        with open(self.path(rel), "rb") as f:
            return f.read()

    def read_buffer(self, rel: str) -> bytearray:
        """Read in place into a new ``bytearray`` (tensors can view it without another copy)."""
        with open(self.path(rel), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            return buf if got == size else buf[:got]

    def size(self, rel: str) -> int | None:
        try:
            return os.stat(self.path(rel)).st_size
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def list(self, prefix: str) -> list[str]:
        try:
            return os.listdir(self.path(prefix))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, rel: str, recursive: bool) -> None:
        path = self.path(rel)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                if not recursive:
                    raise IsADirectoryError(errno.EISDIR, "is a directory (use recursive=True)", rel)
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass


def make_dirs(directory: str) -> None:
    """``os.makedirs`` with every created level 0755 before the umask (``makedirs`` gives only the leaf its
    mode): checkpoint directories honour the umask but are never writable by others, even under umask 000."""
    if os.path.isdir(directory):
        return
    parent = os.path.dirname(directory)
    if parent and parent != directory:
        make_dirs(parent)
    try:
        os.mkdir(directory, 0o755)
    except FileExistsError:
        if not os.path.isdir(directory):
            raise


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
