"""A thin, retrying storage layer for checkpoints: local directories, ``s3://`` and any fsspec URL.

Paths given to :class:`Storage` methods are relative to the root URL and use ``/`` as separator. Where the bytes
go is one of two classes: :class:`~.local_files.LocalFiles` (a plain path or ``file://...``: atomic, durable
writes, ``O_DIRECT`` for large parts) or :class:`~.fsspec_files.FsspecFiles` (``s3://bucket/prefix`` through
s3fs, ...: a single put per object, which is atomic). :class:`Storage` adds what every backend shares: argument
checks, the fault-injection seam, retries and redaction.

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
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar, Union

from .buffers import Buffers
from .format import CheckpointError
from .fsspec_files import FsspecFiles
from .local_files import TMP_MARKER, LocalFiles

__all__ = ["Buffers", "RetryConfig", "Storage", "StorageError"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

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
Files = Union[LocalFiles, FsspecFiles]



class StorageError(CheckpointError):
    """A storage operation failed permanently, or kept failing after all retries."""

    def __init__(self, message: str, *, permanent: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.permanent: bool = permanent
        """The error is not transient (retrying the same operation gives the same error)."""
        self.refused: bool = refused
        """Storage refuses writes for good: a full disk or quota, a file-size limit, a read-only file system,
        permission denied (``EFBIG``, ``ENOSPC``, ``EDQUOT``, ``EROFS``, ``EACCES``, ``EPERM``)."""


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
        url: a local path, ``file://path``, ``s3://bucket/prefix`` or any fsspec URL.
        storage_options: passed to the fsspec filesystem (for s3fs e.g.
            ``{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}, "key": ..., "secret": ...}``).
            Credentials otherwise come from the standard AWS environment/config. For ``s3://`` URLs, short
            botocore timeouts and a single botocore retry are used unless ``config_kwargs`` sets them, since
            this layer retries by itself.
        retry: how transient errors are retried.
        direct_io: on local disk, write large parts (:class:`Buffers` of 1 MiB or more) with ``O_DIRECT``
            (:mod:`.directio`: a fraction of the CPU time of a write through the page cache); turned off by itself
            where the file system refuses it.
        before_write: a declared seam, called as ``before_write(storage, rel, data)`` before each
            :meth:`write_bytes` (fault injection crashes a rank mid-write there).
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
        self._raw_url = url
        self._retry = retry if retry is not None else RetryConfig()
        options = dict(storage_options or {})
        self._secrets = _collect_secrets(options)
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
        self.files: Files
        """Where the bytes go: a local directory or an fsspec file system (one class each)."""
        if _is_local_url(url):
            path = url[len("file://") :] if url.startswith("file://") else url
            self.files = LocalFiles(os.path.abspath(os.path.expanduser(path)), direct_io=direct_io, name=self.url)
        else:
            self.files = FsspecFiles(url, options, open_failed=lambda exc: StorageError(
                f"cannot open checkpoint storage {self.url}: {self.describe_error(exc)}"))
        self._failing_since: float | None = None
        """``time.monotonic()`` of the first retried failure since the last success (``None`` when healthy)."""

    # ------------------------------------------------------------------------------------ helpers

    @property
    def is_local(self) -> bool:
        """Whether the root is a local directory."""
        return isinstance(self.files, LocalFiles)

    @property
    def exact_create(self) -> bool:
        """Whether :meth:`create_exclusive` is exact (of two racing creators, one gets ``True``)."""
        return self.files.exact_create

    @property
    def direct_io(self) -> bool:
        """Whether large local writes use O_DIRECT (False once the file system refused it, and off local disk)."""
        return self.files.direct_io

    @property
    def protocol(self) -> str:
        """The URL's protocol (``"file"`` for a local directory)."""
        return self.files.protocol

    def per_process(self) -> bool:
        """Whether this storage keeps its data inside each process (fsspec's ``memory://``, or any filesystem
        class derived from its ``MemoryFileSystem``): the ranks of a job would each see only their own writes,
        so no checkpoint could ever commit, and nothing would outlive the job."""
        return self.files.per_process()

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
            except StorageError:  # the file system cannot be opened at all: already said, retrying cannot help
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
        body = data if isinstance(data, Buffers) else bytes(data)  # the caller may change a bytearray while we retry
        self._call("write", rel, lambda: self.files.write(rel, body, True))

    def write_bytes_unsynced(self, rel: str, data: bytes) -> None:
        """Like :meth:`write_bytes` (atomic) but, on local disk, without fsync: for small records whose loss in
        a machine crash is harmless (a part's meta file: the commit record that matters is durable)."""
        self._check_rel(rel)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        if not self.is_local:
            self.write_bytes(rel, data)
            return
        body = bytes(data)
        self._call("write", rel, lambda: self.files.write(rel, body, False))

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create ``rel`` with ``data`` unless it exists; returns whether this call created it.

        Exact where :attr:`exact_create` (local disk). Object stores have no portable create-if-absent: there it
        is a check then a put, so two writers racing within a request's time may both get ``True`` (callers
        read the object back later to find out who won)."""
        self._check_rel(rel)
        body = bytes(data)
        if not self.exact_create:
            if self.exists(rel):
                return False
            self.write_bytes(rel, body)
            return True
        return self._call("create", rel, lambda: self.files.create(rel, body))

    def read_bytes(self, rel: str) -> bytes:
        """The content of ``rel``; ``FileNotFoundError`` if it does not exist."""
        self._check_rel(rel)
        return self._call("read", rel, lambda: self.files.read(rel))

    def read_buffer(self, rel: str) -> bytearray:
        """The content of ``rel`` in a new, writable ``bytearray`` (read in place on local disk, so tensors can
        view it without another copy); ``FileNotFoundError`` if it does not exist."""
        self._check_rel(rel)
        return self._call("read", rel, lambda: self.files.read_buffer(rel))

    def size(self, rel: str) -> int | None:
        """Size in bytes of the object ``rel``, or ``None`` if it does not exist."""
        self._check_rel(rel)
        return self._call("size", rel, lambda: self.files.size(rel))

    def exists(self, rel: str) -> bool:
        """Whether the object (or directory) ``rel`` exists."""
        self._check_rel(rel)
        return self._call("exists", rel, lambda: self.files.exists(rel))

    def list(self, prefix: str = "") -> list[str]:
        """Sorted names directly under ``prefix`` (files and directories); ``[]`` if it does not exist."""
        self._check_rel(prefix)
        names = self._call("list", prefix, lambda: self.files.list(prefix))
        return sorted({n for n in names if n and TMP_MARKER not in n and not n.startswith(_PROBE_PREFIX)})

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        """Delete ``rel`` (a directory only with ``recursive=True``); deleting a missing path is not an error."""
        self._check_rel(rel)
        if not rel.strip("/"):
            raise ValueError("refusing to delete the storage root")
        self._call("delete", rel, lambda: self.files.delete(rel, recursive))

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
        if not unreachable and self.files.container_missing():
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
