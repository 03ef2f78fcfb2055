"""On-storage layout and records of checkpoints.

Layout under a checkpoint root URL::

    step-0000000120/
        part-stage0.pt       # the part's state in the tensorfile format (JSON header + raw tensor bytes)
        part-stage0.json     # part meta: name, step, checksum, size (written after the part is durable)
        part-stage1.pt
        part-stage1.json
        COMMIT.json          # commit record, written last and atomically by the committer

A checkpoint is *committed* iff its ``COMMIT.json`` exists; the commit record carries the checksum
(``"crc32:<hex>"`` by default, ``"sha256:<hex>"`` optionally) and size of every part, so a reader
never needs the part meta files.

Format 2 (this one) writes parts with :mod:`.tensorfile`: decoding parses JSON and views raw bytes, nothing is
unpickled. Format 1 checkpoints (``torch.save`` parts, SHA-256 in records with ``"format": 1``) are still
read, only ever with ``torch.load(weights_only=True)``; a part's first bytes tell the two formats apart (the
file name ``part-*.pt`` is the same in both).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from ..errors import EXIT_SETUP
from .checksum import parse_checksum

__all__ = [
    "COMMIT_FILE",
    "FORMAT_VERSION",
    "KEY_CHECKSUM",
    "KEY_FORMAT",
    "KEY_METADATA",
    "KEY_NAME",
    "KEY_PARTS",
    "KEY_SHA256",
    "KEY_SIZE",
    "KEY_STEP",
    "KEY_WALL_TIME",
    "PART_DATA_SUFFIX",
    "PART_META_SUFFIX",
    "PART_PREFIX",
    "STEP_DIR_PREFIX",
    "CheckpointError",
    "CommitRecord",
    "CorruptCheckpointError",
    "PartMeta",
    "READABLE_FORMAT_VERSIONS",
    "commit_path",
    "deserialize_state",
    "normalize_metadata",
    "parse_step_dir",
    "part_data_path",
    "part_meta_path",
    "serialize_state",
    "sha256_hex",
    "snapshot_state",
    "step_dir",
    "validate_part_name",
    "validate_step",
]

# ----------------------------------------------------------------------------------------------- layout

FORMAT_VERSION = 2
"""Version of the layout and of the JSON records written; bumped on incompatible changes."""
READABLE_FORMAT_VERSIONS = (1, 2)
"""1: records with ``sha256`` (parts written by ``torch.save``); 2: records with ``checksum`` (parts written as
:mod:`.tensorfile`, or ``torch.save`` parts carried over). A part's own format is told by its first bytes."""

STEP_DIR_PREFIX = "step-"
PART_PREFIX = "part-"
PART_DATA_SUFFIX = ".pt"
PART_META_SUFFIX = ".json"
COMMIT_FILE = "COMMIT.json"

KEY_FORMAT = "format"
KEY_STEP = "step"
KEY_NAME = "name"
KEY_SHA256 = "sha256"
KEY_CHECKSUM = "checksum"
KEY_SIZE = "size"
KEY_PARTS = "parts"
KEY_WALL_TIME = "wall_time"
KEY_METADATA = "metadata"

_STEP_DIR_RE = re.compile(r"^step-(\d{10,})$")
_PART_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (storage unusable, incompatible or missing checkpoint)."""

    exit_code: ClassVar[int] = EXIT_SETUP


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint is torn, truncated, fails its checksum or cannot be deserialized."""


def validate_step(step: int) -> int:
    """Return ``step`` if it is a non-negative ``int``; raise ``ValueError``/``TypeError`` otherwise."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


def validate_part_name(name: str) -> str:
    """Return ``name`` if it is usable in a file name (``[A-Za-z0-9_][A-Za-z0-9_.-]*``, at most 128 chars)."""
    if not isinstance(name, str) or not _PART_NAME_RE.match(name):
        raise ValueError(
            f"part name must match [A-Za-z0-9_][A-Za-z0-9_.-]* (at most 128 characters), got {name!r}"
        )
    return name


def step_dir(step: int) -> str:
    """Directory (relative to the root) of checkpoint ``step``: ``step-{step:010d}``."""
    return f"{STEP_DIR_PREFIX}{validate_step(step):010d}"


def parse_step_dir(name: str) -> int | None:
    """Inverse of :func:`step_dir`; ``None`` for names that are not step directories."""
    m = _STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def part_data_path(step: int, name: str) -> str:
    """Path of a part file (the name is the same in both formats: the content tells them apart)."""
    return f"{step_dir(step)}/{PART_PREFIX}{validate_part_name(name)}{PART_DATA_SUFFIX}"


def part_meta_path(step: int, name: str) -> str:
    return f"{step_dir(step)}/{PART_PREFIX}{validate_part_name(name)}{PART_META_SUFFIX}"


def commit_path(step: int) -> str:
    return f"{step_dir(step)}/{COMMIT_FILE}"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class PartMeta:
    """What is known about one durable part: its name, step, checksum and size."""

    name: str
    """Part name (e.g. ``stage0`` or ``rank3``)."""
    step: int
    """Update number of the checkpoint."""
    checksum: str
    """Checksum of the part file, ``"<algorithm>:<hex>"`` (see :mod:`.checksum`); a bare 64-digit hex string
    is taken as a SHA-256 (the previous format)."""
    size: int
    """Size of the part file in bytes."""

    def __post_init__(self) -> None:
        if isinstance(self.checksum, str) and _SHA256_RE.match(self.checksum):
            object.__setattr__(self, "checksum", f"sha256:{self.checksum}")

    @property
    def sha256(self) -> str | None:
        """The hex SHA-256, if that is the checksum's algorithm."""
        algo, digest = self.checksum.split(":", 1)
        return digest if algo == "sha256" else None

    def path(self) -> str:
        """Path of the part file relative to the checkpoint root."""
        return part_data_path(self.step, self.name)

    def _entry(self) -> dict[str, Any]:
        return {KEY_CHECKSUM: self.checksum, KEY_SIZE: self.size}

    def to_json(self) -> bytes:
        doc = {KEY_FORMAT: FORMAT_VERSION, KEY_NAME: self.name, KEY_STEP: self.step, **self._entry()}
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> PartMeta:
        """Parse a part meta file (this format or the previous one); raise :class:`CorruptCheckpointError`
        if it is malformed."""
        doc = _load_json(data, "part meta")
        version = _check_format(doc, "part meta")
        name = _get(doc, KEY_NAME, str, "part meta")
        step = _get(doc, KEY_STEP, int, "part meta")
        return _part(name, step, doc, version, "part meta")


def _part(name: str, step: int, entry: Mapping[str, Any], version: int, what: str) -> PartMeta:
    if not isinstance(name, str) or not _PART_NAME_RE.match(name):
        raise CorruptCheckpointError(f"{what}: bad part name {name!r}")
    size = _get(entry, KEY_SIZE, int, what)
    if version == 1:
        return PartMeta(name, step, _get_sha(entry, what), size)
    value = entry.get(KEY_CHECKSUM)
    try:
        parse_checksum(value)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{what}: {exc}") from None
    return PartMeta(name, step, value, size)


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """The commit record of one checkpoint (``COMMIT.json``)."""

    step: int
    """Update number of the checkpoint."""
    parts: Mapping[str, PartMeta]
    """Every part of the checkpoint, by name, with its checksum and size."""
    wall_time: float
    """``time.time()`` when the commit record was written."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """JSON metadata given by the committer (plan hash, profile hash, world size, ...)."""

    def to_json(self) -> bytes:
        doc = {
            KEY_FORMAT: FORMAT_VERSION,
            KEY_STEP: self.step,
            KEY_WALL_TIME: self.wall_time,
            KEY_PARTS: {name: p._entry() for name, p in sorted(self.parts.items())},
            KEY_METADATA: dict(self.metadata),
        }
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> CommitRecord:
        """Parse a commit record (this format or the previous one); raise :class:`CorruptCheckpointError` if
        it is malformed."""
        what = "commit record"
        doc = _load_json(data, what)
        version = _check_format(doc, what)
        step = _get(doc, KEY_STEP, int, what)
        wall_time = doc.get(KEY_WALL_TIME)
        if isinstance(wall_time, bool) or not isinstance(wall_time, (int, float)):
            raise CorruptCheckpointError(f"{what}: '{KEY_WALL_TIME}' must be a number, got {wall_time!r}")
        raw_parts = doc.get(KEY_PARTS)
        if not isinstance(raw_parts, dict) or not raw_parts:
            raise CorruptCheckpointError(f"{what}: '{KEY_PARTS}' must be a non-empty object")
        parts: dict[str, PartMeta] = {}
        for name, entry in raw_parts.items():
            if not isinstance(entry, dict):
                raise CorruptCheckpointError(f"{what}: part {name!r} must be an object, got {entry!r}")
            parts[name] = _part(name, step, entry, version, f"{what} part {name!r}")
        metadata = doc.get(KEY_METADATA, {})
        if not isinstance(metadata, dict):
            raise CorruptCheckpointError(f"{what}: '{KEY_METADATA}' must be an object, got {metadata!r}")
        return cls(step=step, parts=parts, wall_time=float(wall_time), metadata=metadata)


def normalize_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return ``metadata`` as it will read back from JSON; ``TypeError`` if it is not JSON-serializable."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be JSON-serializable (str keys, plain values): {exc}") from None


def _load_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{what} must be a JSON object, got {type(doc).__name__}")
    return doc


def _check_format(doc: Mapping[str, Any], what: str) -> int:
    version = doc.get(KEY_FORMAT)
    if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
        raise CorruptCheckpointError(
            f"{what}: unsupported format version {version!r} (this version reads "
            f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))})"
        )
    return int(version)


def _get(doc: Mapping[str, Any], key: str, typ: type, what: str) -> Any:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, typ):
        raise CorruptCheckpointError(f"{what}: '{key}' must be {typ.__name__}, got {value!r}")
    if typ is int and value < 0:
        raise CorruptCheckpointError(f"{what}: '{key}' must be >= 0, got {value}")
    return value


def _get_sha(doc: Mapping[str, Any], what: str) -> str:
    value = doc.get(KEY_SHA256)
    if not isinstance(value, str) or not _SHA256_RE.match(value):
        raise CorruptCheckpointError(f"{what}: '{KEY_SHA256}' must be 64 lowercase hex digits, got {value!r}")
    return value


# -------------------------------------------------------------------------------------- serialization

_SCALARS = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def snapshot_state(state: Any) -> Any:
    """Deep-copy ``state`` with every tensor detached and copied to CPU.

    Accepted values: tensors, ``int``/``float``/``complex``/``str``/``bytes``/``bool``/``None``,
    ``torch.dtype``/``torch.device``/``torch.Size``, and ``list``/``tuple``/``dict`` (keys ``str`` or ``int``)
    of them. Anything else raises ``TypeError`` naming the offending path, so that the state can always be
    loaded back with ``torch.load(weights_only=True)``.
    """
    return _snapshot(state, "state")


def _snapshot(value: Any, path: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if type(value) in _SCALARS:
        return value
    if type(value) is torch.Size:
        return torch.Size(value)
    if type(value) in (dict, OrderedDict):
        out = type(value)()
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"{path}: dict keys must be str or int, got {type(k).__name__} {k!r}")
            out[k] = _snapshot(v, f"{path}[{k!r}]")
        return out
    if type(value) is list:
        return [_snapshot(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return tuple(_snapshot(v, f"{path}[{i}]") for i, v in enumerate(value))
    raise TypeError(
        f"{path}: cannot checkpoint a value of type {type(value).__module__}.{type(value).__qualname__}; "
        "use tensors, plain Python values (int, float, str, bool, None) and list/tuple/dict of them"
    )


def serialize_state(state: Any) -> bytes:
    """Serialize an already snapshotted state with :func:`torch.save`."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def deserialize_state(data: bytes) -> Any:
    """Load a part with ``torch.load(weights_only=True, map_location="cpu")``.

    Raises :class:`CorruptCheckpointError` if the bytes are truncated, corrupt or contain anything that
    ``weights_only`` refuses (arbitrary pickled objects are never executed).
    """
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types (pickle.UnpicklingError, RuntimeError, EOFError, ...)
        msg = str(exc).splitlines()[0] if str(exc) else ""
        raise CorruptCheckpointError(f"cannot load checkpoint part: {type(exc).__name__}: {msg[:300]}") from None
