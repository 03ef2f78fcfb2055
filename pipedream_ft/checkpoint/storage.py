"""A thin, retrying storage layer for checkpoints: local directories, ``memory://``, ``s3://`` and any fsspec URL.

Paths given to :class:`Storage` methods are relative to the root URL and use ``/`` as separator.

* Local paths (a plain path or ``file://...``) are written atomically and durably: a temporary file in the
  same directory is written, flushed and fsynced, renamed over the target, and the directory is fsynced.
  Large parts given as :class:`Buffers` are written with ``O_DIRECT`` (:mod:`.directio`) where the file system
  allows it.
* Object stores (``s3://bucket/prefix`` through s3fs, ...) get a single put per object, which is atomic.

``fsspec`` (and s3fs) are imported lazily, on the first operation on a non-local URL.

Transient errors (connection refused, timeouts, 5xx, ...) are retried with exponential backoff, logging a
warning per retry. Permanent errors (missing file, permission denied, missing credentials, ...) are not
retried; among them, those of storage that refuses writes for good (``EFBIG``, ``ENOSPC``, ``EDQUOT``,
``EROFS``, ``EACCES``, ``EPERM``) are marked :attr:`StorageError.refused`, and the checkpoint writer gives the
step up at once instead of retrying it. :meth:`Storage.per_process` tells file systems whose data lives inside
each process (``memory://``), which a multi-process job cannot use. Credentials are never logged: every message built here goes through :meth:`Storage.redact`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

from ..atomic import replace_atomically, write_all
from . import directio
from .format import CheckpointError

__all__ = ["Buffers", "RetryConfig", "Storage", "StorageError"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TMP_MARKER = ".tmp-"
_PROBE_PREFIX = ".probe-"
_SECRET_KEY_RE = re.compile(r"(secret|password|passwd|token|key|credential|auth|signature)", re.IGNORECASE)
_SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ACCESS_KEY_ID",
)
_URL_USERINFO_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/@\s]+@")
_REFUSED_ERRNOS = {
    errno.EFBIG,  # a file-size limit (RLIMIT_FSIZE, the file system's maximum)
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
}
"""Errors of storage that refuses writes for good (full, over quota, read-only, forbidden): retrying the same
write cannot help, so a checkpoint step that meets one is given up at once (see :attr:`StorageError.refused`)."""
_PERMANENT_ERRNOS = {
    errno.EFBIG,
    errno.ENOSPC,  # a full disk does not empty itself within a few retries; the writer retries at its pace
    errno.EDQUOT,
    errno.ENOENT,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
    errno.EINVAL,
    errno.ENAMETOOLONG,
    errno.ENOTEMPTY,
}
_PERMANENT_NAMES = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "NoRegionError",
    "ParamValidationError",
    "InvalidConfigError",
    "UnknownCredentialError",
    "ProfileNotFound",
    "ConfigNotFound",
}
_DIRECT_MIN_BYTES = 1 << 20
_BUCKET_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "oss"}
_S3_DEFAULT_CONFIG = {"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 2}}



def _make_dirs(directory: str) -> None:
    """``os.makedirs`` with every created level 0755 before the umask (``makedirs`` gives only the leaf its
    mode): checkpoint directories honour the umask but are never writable by others, even under umask 000."""
    if os.path.isdir(directory):
        return
    parent = os.path.dirname(directory)
    if parent and parent != directory:
        _make_dirs(parent)
    try:
        os.mkdir(directory, 0o755)
    except FileExistsError:
        if not os.path.isdir(directory):
            raise


class StorageError(CheckpointError):
    """A storage operation failed permanently, or kept failing after all retries."""

    def __init__(self, message: str, *, permanent: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.permanent: bool = permanent
        """The error is not transient (retrying the same operation gives the same error)."""
        self.refused: bool = refused
        """Storage refuses writes for good: a full disk or quota, a file-size limit, a read-only file system,
        permission denied (``EFBIG``, ``ENOSPC``, ``EDQUOT``, ``EROFS``, ``EACCES``, ``EPERM``)."""


_PER_PROCESS_PROTOCOLS = {"memory"}
"""fsspec protocols whose data lives inside each process (see :meth:`Storage.per_process`)."""


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


@dataclass(kw_only=True, slots=True)
class RetryConfig:
    """How transient storage errors are retried."""

    attempts: int = 4
    """Total number of tries per operation (1 = no retry)."""
    delay_s: float = 0.2
    """Sleep before the first retry."""
    backoff: float = 2.0
    """Factor applied to the sleep after each retry."""
    max_delay_s: float = 5.0
    """Upper bound on the sleep between two tries."""

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, got {self.attempts!r}")
        if not self.delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s!r}")
        if not self.backoff >= 1:
            raise ValueError(f"backoff must be >= 1, got {self.backoff!r}")
        if not self.max_delay_s >= 0:
            raise ValueError(f"max_delay_s must be >= 0, got {self.max_delay_s!r}")


def _is_local_url(url: str) -> bool:
    return url.startswith("file://") or "://" not in url


def _collect_secrets(value: Any, key: str = "", out: set[str] | None = None) -> set[str]:
    out = set() if out is None else out
    if isinstance(value, Mapping):
        for k, v in value.items():
            _collect_secrets(v, str(k), out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_secrets(v, key, out)
    elif isinstance(value, str) and _SECRET_KEY_RE.search(key) and len(value) >= 3:
        out.add(value)
    return out


class Storage:
    """Checkpoint storage rooted at ``url``.

    Args:
        url: a local path, ``file://path``, ``memory://name``, ``s3://bucket/prefix`` or any fsspec URL.
        storage_options: passed to the fsspec filesystem (for s3fs e.g.
            ``{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}, "key": ..., "secret": ...}``).
            Credentials otherwise come from the standard AWS environment/config. For ``s3://`` URLs, short
            botocore timeouts and a single botocore retry are used unless ``config_kwargs`` sets them, since
            this layer retries by itself.
        retry: how transient errors are retried.
        direct_io: on local disk, write large parts (:class:`Buffers` of 1 MiB or more) with ``O_DIRECT``
            (:mod:`.directio`: a fraction of the CPU time of a write through the page cache); turned off by itself
            where the file system refuses it.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryConfig | None = None,
        direct_io: bool = True,
        before_write: Callable[[Storage, str, Any], None] | None = None,
    ) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise TypeError(f"url must be a str or path, got {type(url).__name__}")
        url = os.fspath(url)
        if not url:
            raise ValueError("url must be non-empty, got ''")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping, got {type(storage_options).__name__}")
        self._before_write = before_write
        """A declared seam: called as ``before_write(storage, rel, data)`` before each :meth:`write_bytes`
        (fault injection crashes a rank mid-write there)."""
        self._raw_url = url
        self._options: dict[str, Any] = dict(storage_options or {})
        self._retry = retry if retry is not None else RetryConfig()
        self._secrets = _collect_secrets(self._options)
        for name in _SECRET_ENV:
            val = os.environ.get(name)
            if val and len(val) >= 3:
                self._secrets.add(val)
        m = re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://([^/@\s]+)@", url)
        if m:
            self._secrets.update(s for s in m.group(1).split(":") if len(s) >= 3)
            self._secrets.add(m.group(1))
        self.url: str = self.redact(url)
        """The root URL, with any credentials removed (safe to log)."""
        self._local_root: str | None = None
        if _is_local_url(url):
            path = url[len("file://") :] if url.startswith("file://") else url
            self._local_root = os.path.abspath(os.path.expanduser(path))
        self.direct_io: bool = bool(direct_io)
        """Whether large local writes use O_DIRECT (set to False when the file system refuses it)."""
        self._fs: Any = None
        self._root = ""
        self._fs_lock = threading.Lock()
        self._failing_since: float | None = None
        """``time.monotonic()`` of the first retried failure since the last success (``None`` when healthy)."""

    # ------------------------------------------------------------------------------------ helpers

    @property
    def is_local(self) -> bool:
        """Whether the root is a local directory."""
        return self._local_root is not None

    @property
    def protocol(self) -> str:
        """The URL's protocol (``"file"`` for a local directory)."""
        return "file" if self.is_local else self._raw_url.split("://", 1)[0].split("::", 1)[0]

    def per_process(self) -> bool:
        """Whether this storage keeps its data inside each process (fsspec's ``memory://``, or any filesystem
        class derived from its ``MemoryFileSystem``): the ranks of a job would each see only their own writes,
        so no checkpoint could ever commit, and nothing would outlive the job."""
        if self.is_local:
            return False
        if self.protocol in _PER_PROCESS_PROTOCOLS:
            return True
        try:
            from fsspec.implementations.memory import MemoryFileSystem
        except ImportError:  # pragma: no cover - fsspec is a dependency
            return False
        try:
            fs, _ = self._filesystem()
        except StorageError:
            return False
        return isinstance(fs, MemoryFileSystem)

    @property
    def retry(self) -> RetryConfig:
        return self._retry

    def redact(self, text: str) -> str:
        """``text`` with credentials (from the options, the AWS environment and the URL) replaced by ``***``."""
        for secret in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(secret, "***")
        return _URL_USERINFO_RE.sub(r"\g<scheme>***@", text)

    def describe_error(self, exc: BaseException) -> str:
        """A one-line, redacted description of ``exc``."""
        msg = " ".join(str(exc).split())
        return f"{type(exc).__name__}: {self.redact(msg)[:400]}" if msg else type(exc).__name__

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def _filesystem(self) -> tuple[Any, str]:
        if self._fs is None:
            with self._fs_lock:
                if self._fs is None:
                    import fsspec.core  # lazy: only needed for non-local URLs

                    options = dict(self._options)
                    protocol = self._raw_url.split("://", 1)[0]
                    if protocol in ("s3", "s3a"):
                        config = dict(_S3_DEFAULT_CONFIG)
                        if _botocore_knows("request_checksum_calculation"):
                            # parts carry their own checksum; botocore's extra CRC of every body is CPU for nothing
                            config["request_checksum_calculation"] = "when_required"
                        config.update(options.get("config_kwargs") or {})
                        options["config_kwargs"] = config
                    try:
                        fs, root = fsspec.core.url_to_fs(self._raw_url, **options)
                    except Exception as exc:
                        raise StorageError(
                            f"cannot open checkpoint storage {self.url}: {self.describe_error(exc)}"
                        ) from None
                    self._root = root.rstrip("/")
                    self._fs = fs
        return self._fs, self._root

    def _local(self, rel: str) -> str:
        assert self._local_root is not None
        return os.path.join(self._local_root, *[p for p in rel.split("/") if p])

    def _remote(self, rel: str) -> str:
        fs, root = self._filesystem()
        rel = rel.strip("/")
        return f"{root}/{rel}" if rel else root

    @staticmethod
    def _check_rel(rel: str) -> str:
        if not isinstance(rel, str):
            raise TypeError(f"path must be a str, got {type(rel).__name__}")
        parts = rel.split("/")
        if any(p in ("..", ".") for p in parts):
            raise ValueError(f"path must not contain '.' or '..' components, got {rel!r}")
        return rel

    @staticmethod
    def _is_transient(exc: BaseException) -> bool:
        if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        if isinstance(exc, (FileExistsError, ValueError, TypeError, NotImplementedError, KeyError)):
            return False
        if any(cls.__name__ in _PERMANENT_NAMES for cls in type(exc).__mro__):
            return False
        if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
            return False
        return isinstance(exc, Exception)

    def _call(self, op: str, rel: str, fn: Callable[[], T]) -> T:
        cfg = self._retry
        delay = cfg.delay_s
        for attempt in range(1, cfg.attempts + 1):
            try:
                result = fn()
            except FileNotFoundError:
                self._healthy()
                raise
            except Exception as exc:
                transient = self._is_transient(exc)
                if not transient or attempt == cfg.attempts:
                    tail = f" after {attempt} tries" if transient and attempt > 1 else ""
                    refused = isinstance(exc, OSError) and exc.errno in _REFUSED_ERRNOS
                    raise StorageError(
                        f"checkpoint storage {self.url}: {op} {rel!r} failed{tail}: {self.describe_error(exc)}",
                        permanent=not transient, refused=refused,
                    ) from None
                first = self._failing_since is None
                if first:
                    self._failing_since = time.monotonic()
                logger.log(
                    logging.WARNING if first else logging.DEBUG,
                    "checkpoint storage %s: %s %r failed (%s); retry %d/%d in %.2fs"
                    + ("; further retries are logged at DEBUG until an operation succeeds" if first else ""),
                    self.url,
                    op,
                    rel,
                    self.describe_error(exc),
                    attempt,
                    cfg.attempts - 1,
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * cfg.backoff, cfg.max_delay_s)
                continue
            self._healthy()
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _healthy(self) -> None:
        since, self._failing_since = self._failing_since, None
        if since is not None:
            logger.info("checkpoint storage %s: operations succeed again after %.1fs", self.url, time.monotonic() - since)

    # -------------------------------------------------------------------------------- operations

    def write_bytes(self, rel: str, data: bytes | bytearray | memoryview | Buffers) -> None:
        """Write ``data`` to ``rel`` atomically (readers see the old object, or the complete new one).

        ``data`` may be a :class:`Buffers`: on local disk its chunks are written one after the other (no
        copy) and fsynced once; object stores get them joined into a single put."""
        self._check_rel(rel)
        if not isinstance(data, (bytes, bytearray, memoryview, Buffers)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        if self._before_write is not None:
            self._before_write(self, rel, data)
        if self.is_local:
            if not isinstance(data, Buffers):
                data = bytes(data)  # the caller may change a bytearray while we retry
            self._call("write", rel, lambda: self._write_local(rel, data))
        else:
            body = data.join() if isinstance(data, Buffers) else bytes(data)
            path = self._remote(rel)

            def put() -> None:
                fs, _ = self._filesystem()
                fs.pipe_file(path, body)
                fs.invalidate_cache(path)

            self._call("write", rel, put)

    def _write_local(self, rel: str, data: bytes | Buffers, durable: bool = True) -> None:
        path = self._local(rel)
        directory = os.path.dirname(path)
        created = not os.path.isdir(directory)
        _make_dirs(directory)
        tmp = os.path.join(directory, f".{os.path.basename(path)}{_TMP_MARKER}{uuid.uuid4().hex[:12]}")

        def write(tmp: str) -> None:
            if self._write_file_direct(tmp, data, durable):
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
            _fsync_dir(directory)
            if created:
                _fsync_dir(os.path.dirname(directory))

    def _write_file_direct(self, tmp: str, data: bytes | Buffers, durable: bool) -> bool:
        """Write ``tmp`` with O_DIRECT if it pays (large :class:`Buffers`, durable) and the file system allows it;
        returns False (nothing left behind) where it does not, so the caller writes it buffered."""
        if not (self.direct_io and durable and isinstance(data, Buffers) and len(data) >= _DIRECT_MIN_BYTES):
            return False
        try:
            fd = directio.open_direct(tmp)
        except directio.DirectIOUnsupported:
            self.direct_io = False
            logger.info("checkpoint storage %s: O_DIRECT refused by the file system; writing through the page "
                        "cache", self.url)
            return False
        try:
            directio.write_direct(fd, data.chunks)
            os.fsync(fd)
        except directio.DirectIOUnsupported:
            self.direct_io = False
            logger.info("checkpoint storage %s: O_DIRECT write refused; writing through the page cache", self.url)
            os.close(fd)
            os.unlink(tmp)
            return False
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return True

    def write_bytes_unsynced(self, rel: str, data: bytes) -> None:
        """Like :meth:`write_bytes` (atomic) but, on local disk, without fsync: for small records whose loss in
        a machine crash is harmless (a part's meta file: the commit record that matters is durable)."""
        self._check_rel(rel)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        if not self.is_local:
            self.write_bytes(rel, data)
            return
        data = bytes(data)
        self._call("write", rel, lambda: self._write_local(rel, data, durable=False))

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create ``rel`` with ``data`` unless it exists; returns whether this call created it.

        On local disk this is exact (the complete file is hard-linked into place, which fails if the name
        exists). Object stores have no portable create-if-absent: there it is a check then a put, so two
        writers racing within a request's time may both get ``True`` (callers read the object back later to
        find out who won)."""
        self._check_rel(rel)
        data = bytes(data)
        if not self.is_local:
            if self.exists(rel):
                return False
            self.write_bytes(rel, data)
            return True

        def create_local() -> bool:
            path = self._local(rel)
            directory = os.path.dirname(path)
            _make_dirs(directory)
            tmp = os.path.join(directory, f".{os.path.basename(path)}{_TMP_MARKER}{uuid.uuid4().hex[:12]}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                try:
                    os.write(fd, data)
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
            _fsync_dir(directory)
            return True

        return self._call("create", rel, create_local)

    def read_bytes(self, rel: str) -> bytes:
        """The content of ``rel``; ``FileNotFoundError`` if it does not exist."""
        self._check_rel(rel)
        if self.is_local:
            path = self._local(rel)

            def read_local() -> bytes:
                with open(path, "rb") as f:
                    return f.read()

            return self._call("read", rel, read_local)
        path = self._remote(rel)
        return self._call("read", rel, lambda: self._filesystem()[0].cat_file(path))

    def read_buffer(self, rel: str) -> bytearray:
        """The content of ``rel`` in a new, writable ``bytearray`` (read in place on local disk, so tensors can
        view it without another copy); ``FileNotFoundError`` if it does not exist."""
        self._check_rel(rel)
        if self.is_local:
            path = self._local(rel)

            def read_local() -> bytearray:
                with open(path, "rb", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    buf = bytearray(size)
                    view, got = memoryview(buf), 0
                    while got < size:
                        n = f.readinto(view[got:])
                        if not n:
                            break
                        got += n
                    return buf if got == size else buf[:got]

            return self._call("read", rel, read_local)
        return bytearray(self.read_bytes(rel))

    def size(self, rel: str) -> int | None:
        """Size in bytes of the object ``rel``, or ``None`` if it does not exist."""
        self._check_rel(rel)
        if self.is_local:
            path = self._local(rel)

            def size_local() -> int | None:
                try:
                    return os.stat(path).st_size
                except FileNotFoundError:
                    return None

            return self._call("size", rel, size_local)
        path = self._remote(rel)

        def size_remote() -> int | None:
            fs, _ = self._filesystem()
            fs.invalidate_cache(path)
            try:
                return int(fs.info(path)["size"])
            except FileNotFoundError:
                return None

        return self._call("size", rel, size_remote)

    def exists(self, rel: str) -> bool:
        """Whether the object (or directory) ``rel`` exists."""
        self._check_rel(rel)
        if self.is_local:
            path = self._local(rel)
            return self._call("exists", rel, lambda: os.path.exists(path))
        path = self._remote(rel)

        def remote_exists() -> bool:
            fs, _ = self._filesystem()
            fs.invalidate_cache(path)
            return bool(fs.exists(path))

        return self._call("exists", rel, remote_exists)

    def list(self, prefix: str = "") -> list[str]:
        """Sorted names directly under ``prefix`` (files and directories); ``[]`` if it does not exist."""
        self._check_rel(prefix)
        if self.is_local:
            path = self._local(prefix)

            def list_local() -> list[str]:
                try:
                    return os.listdir(path)
                except (FileNotFoundError, NotADirectoryError):
                    return []

            names = self._call("list", prefix, list_local)
        else:
            path = self._remote(prefix)

            def list_remote() -> list[str]:
                fs, _ = self._filesystem()
                fs.invalidate_cache(path)
                try:
                    entries = fs.ls(path, detail=False)
                except (FileNotFoundError, NotADirectoryError):
                    return []
                base = path.rstrip("/")
                out = []
                for e in entries:
                    e = e.rstrip("/")
                    if e == base:
                        continue
                    out.append(e.rsplit("/", 1)[-1])
                return out

            names = self._call("list", prefix, list_remote)
        return sorted({n for n in names if n and _TMP_MARKER not in n and not n.startswith(_PROBE_PREFIX)})

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        """Delete ``rel`` (a directory only with ``recursive=True``); deleting a missing path is not an error."""
        self._check_rel(rel)
        if not rel.strip("/"):
            raise ValueError("refusing to delete the storage root")
        if self.is_local:
            path = self._local(rel)

            def delete_local() -> None:
                try:
                    if os.path.isdir(path) and not os.path.islink(path):
                        if not recursive:
                            raise IsADirectoryError(errno.EISDIR, "is a directory (use recursive=True)", rel)
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
                except FileNotFoundError:
                    pass

            self._call("delete", rel, delete_local)
            return
        path = self._remote(rel)

        def delete_remote() -> None:
            fs, _ = self._filesystem()
            try:
                fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass
            fs.invalidate_cache(path)

        self._call("delete", rel, delete_remote)

    def check_writable(self) -> None:
        """Create, read back and delete a probe object under the root.

        Raises :class:`~pipedream_ft.checkpoint.CheckpointError` with one message naming the (redacted) URL if
        the endpoint is unreachable, the bucket is missing, credentials are missing or rejected, or the
        directory cannot be written.
        """
        probe = f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
        try:
            self.write_bytes(probe, b"probe")
            if self.read_bytes(probe) != b"probe":
                raise StorageError("probe object read back with different content")
            self.delete(probe)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint storage {self.url} is not writable: {self._explain(exc)}"
            ) from None

    def _explain(self, exc: BaseException) -> str:
        text = str(exc) if isinstance(exc, StorageError) else self.describe_error(exc)
        prefix = f"checkpoint storage {self.url}: "
        if text.startswith(prefix):
            text = text[len(prefix) :]
        low = text.lower()
        unreachable = "could not connect" in low or "connection" in low or "timeout" in low or "timed out" in low
        if not self.is_local and not unreachable and self._container_missing():
            low = "nosuchbucket " + low
        if "nocredentialserror" in low or "partialcredentialserror" in low or "unable to locate credentials" in low:
            hint = "no credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or storage_options)"
        elif "nosuchbucket" in low or "bucket does not exist" in low:
            hint = "the bucket does not exist"
        elif isinstance(exc, FileNotFoundError):
            hint = "the bucket or path does not exist"
        elif unreachable:
            hint = "the endpoint is unreachable"
        elif "accessdenied" in low or "access denied" in low or "permission" in low or "forbidden" in low:
            hint = "permission denied (check credentials and access rights)"
        elif "invalidaccesskeyid" in low or "signaturedoesnotmatch" in low:
            hint = "credentials were rejected"
        elif "not a directory" in low or "notadirectory" in low or "file exists" in low:
            hint = "a path component is not a directory"
        elif "read-only" in low:
            hint = "the file system is read-only"
        else:
            hint = "storage error"
        return f"{hint} ({text})"

    def _container_missing(self) -> bool:
        """For object stores: whether the bucket (first component of the root) is known not to exist."""
        if self._raw_url.split("://", 1)[0] not in _BUCKET_PROTOCOLS:
            return False
        try:
            fs, root = self._filesystem()
            bucket = root.strip("/").split("/", 1)[0]
            if not bucket:
                return False
            fs.invalidate_cache(bucket)
            fs.ls(bucket, detail=False)
        except FileNotFoundError:
            return True
        except Exception:
            return False
        return False


def _botocore_knows(option: str) -> bool:
    try:
        from botocore.config import Config
    except ImportError:
        return False
    return option in getattr(Config, "OPTION_DEFAULTS", {})


def _fsync_dir(path: str) -> None:
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
