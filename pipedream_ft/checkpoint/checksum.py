"""Checksums of part files: ``"<algorithm>:<hex digest>"`` strings, computed incrementally over buffers.

* ``crc32`` (the default): :func:`zlib.crc32`, several GB/s, detects torn and corrupted parts (any burst
  error of up to 32 bits, and any other corruption with probability 1 - 2**-32).
* ``sha256``: cryptographic, about 1 GB/s; for when parts must be tamper-evident.
* ``crc32c``: only where the ``google-crc32c`` package is installed (not a dependency).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from typing import Any, Iterable

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "Hasher", "checksum", "parse_checksum", "validate_algorithm"]

DEFAULT_ALGORITHM = "crc32"
_HEX_LEN = {"crc32": 8, "crc32c": 8, "sha256": 64}
_CHECKSUM_RE = re.compile(r"^(crc32|crc32c|sha256):([0-9a-f]+)$")


def _crc32c_module() -> Any:
    try:
        import google_crc32c  # type: ignore[import-not-found]
    except ImportError:
        return None
    return google_crc32c


ALGORITHMS: tuple[str, ...] = ("crc32", "sha256") + (("crc32c",) if _crc32c_module() is not None else ())
"""Algorithms usable for writing on this machine."""


def validate_algorithm(algorithm: str) -> str:
    """Return ``algorithm`` if usable here; ``ValueError`` naming the choices otherwise."""
    if algorithm not in ALGORITHMS:
        extra = " (crc32c needs the google-crc32c package)" if algorithm == "crc32c" else ""
        raise ValueError(f"checksum must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}{extra}")
    return algorithm


def parse_checksum(value: Any) -> tuple[str, str]:
    """``(algorithm, hex)`` of a checksum string; ``ValueError`` if it is malformed."""
    m = _CHECKSUM_RE.match(value) if isinstance(value, str) else None
    if m is None or len(m.group(2)) != _HEX_LEN[m.group(1)]:
        raise ValueError(f"checksum must be 'crc32:<8 hex>', 'crc32c:<8 hex>' or 'sha256:<64 hex>', got {value!r}")
    return m.group(1), m.group(2)


class Hasher:
    """Incremental checksum: :meth:`update` with buffers, then :meth:`value` (``"crc32:0badf00d"``)."""

    __slots__ = ("algorithm", "_crc", "_sha", "_c")

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        self.algorithm = algorithm
        self._crc = 0
        self._sha = hashlib.sha256() if algorithm == "sha256" else None
        self._c = None
        if algorithm == "crc32c":
            mod = _crc32c_module()
            if mod is None:
                raise ValueError("checksum 'crc32c' needs the google-crc32c package, which is not installed")
            self._c = mod.Checksum()
        elif algorithm not in ("crc32", "sha256"):
            raise ValueError(f"checksum must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")

    def update(self, data: Any) -> None:
        """Add ``data`` (any buffer: bytes, bytearray, memoryview)."""
        if self._sha is not None:
            self._sha.update(data)
        elif self._c is not None:
            self._c.update(bytes(data) if not isinstance(data, bytes) else data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> str:
        if self._sha is not None:
            return f"sha256:{self._sha.hexdigest()}"
        if self._c is not None:
            return f"crc32c:{self._c.digest().hex()}"
        return f"crc32:{self._crc:08x}"


def checksum(buffers: Iterable[Any], algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The checksum string of the concatenation of ``buffers``."""
    h = Hasher(algorithm)
    for b in buffers:
        h.update(b)
    return h.value()
