"""Checkpoint objects behind any fsspec URL (``s3://bucket/prefix`` through s3fs, ``gs://``, ...).

Each object is written with a single put, which object stores make atomic. ``fsspec`` (and s3fs) are imported
on the first operation. Listings and sizes bypass fsspec's directory cache, since other ranks write beside
this one. Paths are relative to the root and use ``/``; retrying, redaction and the checks on arguments are
:class:`~.storage.Storage`'s.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

from .buffers import Buffers

__all__ = ["FsspecFiles"]

_BUCKET_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "oss"}
_PER_PROCESS_PROTOCOLS = {"memory"}
"""fsspec protocols whose data lives inside each process."""
_S3_DEFAULT_CONFIG = {"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 2}}


class FsspecFiles:
    """The objects under the fsspec URL ``url``, opened with ``options``.

    ``open_failed(exc)`` builds the error raised when the file system cannot be opened at all (the caller's
    :class:`~.storage.StorageError`, with the URL redacted).
    """

    exact_create = False
    """Object stores have no portable create-if-absent: :meth:`~.storage.Storage.create_exclusive` is a check then
    a put there, so two writers racing within a request's time may both get ``True`` (callers read the object back
    to find who won)."""
    direct_io = False

    def __init__(self, url: str, options: Mapping[str, Any], *,
                 open_failed: Callable[[BaseException], Exception]) -> None:
        self.url = url
        self.protocol = url.split("://", 1)[0].split("::", 1)[0]
        self._options = dict(options)
        self._open_failed = open_failed
        self._fs: Any = None
        self._root = ""
        self._lock = threading.Lock()

    def filesystem(self) -> tuple[Any, str]:
        """The fsspec file system and the root path in it (opened once)."""
        if self._fs is None:
            with self._lock:
                if self._fs is None:
                    import fsspec.core  # lazy: only needed for non-local URLs

                    options = dict(self._options)
                    if self.url.split("://", 1)[0] in ("s3", "s3a"):
                        config: dict[str, Any] = dict(_S3_DEFAULT_CONFIG)
                        if _botocore_knows("request_checksum_calculation"):
                            # parts carry their own checksum; botocore's extra CRC of every body is CPU for nothing
                            config["request_checksum_calculation"] = "when_required"
                        config.update(options.get("config_kwargs") or {})
                        options["config_kwargs"] = config
                    try:
                        fs, root = fsspec.core.url_to_fs(self.url, **options)
                    except Exception as exc:
                        raise self._open_failed(exc) from None
                    self._root = root.rstrip("/")
                    self._fs = fs
        return self._fs, self._root

    def path(self, rel: str) -> str:
        _, root = self.filesystem()
        rel = rel.strip("/")
        return f"{root}/{rel}" if rel else root

    def per_process(self) -> bool:
        """Whether the data lives inside each process (``memory://``, or a subclass of fsspec's
        ``MemoryFileSystem``)."""
        if self.protocol in _PER_PROCESS_PROTOCOLS:
            return True
        try:
            from fsspec.implementations.memory import MemoryFileSystem
        except ImportError:  # pragma: no cover - fsspec is a dependency
            return False
        try:
            fs, _ = self.filesystem()
        except Exception:
            return False
        return isinstance(fs, MemoryFileSystem)

    def write(self, rel: str, data: bytes | Buffers, durable: bool) -> None:
        """One put (``durable`` changes nothing: an acknowledged put is stored)."""
        body = data.join() if isinstance(data, Buffers) else bytes(data)
        fs, path = self.filesystem()[0], self.path(rel)
        fs.pipe_file(path, body)
        fs.invalidate_cache(path)

    def read(self, rel: str) -> bytes:
        return self.filesystem()[0].cat_file(self.path(rel))

    def read_buffer(self, rel: str) -> bytearray:
        return bytearray(self.read(rel))

    def size(self, rel: str) -> int | None:
        fs, path = self.filesystem()[0], self.path(rel)
        fs.invalidate_cache(path)
        try:
            return int(fs.info(path)["size"])
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        fs, path = self.filesystem()[0], self.path(rel)
        fs.invalidate_cache(path)
        return bool(fs.exists(path))

    def list(self, prefix: str) -> list[str]:
        fs, path = self.filesystem()[0], self.path(prefix)
        fs.invalidate_cache(path)
        try:
            entries = fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = path.rstrip("/")
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != base]

    def delete(self, rel: str, recursive: bool) -> None:
        fs, path = self.filesystem()[0], self.path(rel)
        try:
            fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        fs.invalidate_cache(path)

    def container_missing(self) -> bool:
        """For object stores: whether the bucket (the root's first component) is known not to exist."""
        if self.url.split("://", 1)[0] not in _BUCKET_PROTOCOLS:
            return False
        try:
            fs, root = self.filesystem()
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
