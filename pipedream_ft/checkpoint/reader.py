"""Reading committed checkpoints: find them, verify them, load them, check they fit the current run.

Only committed checkpoints (with a ``COMMIT.json``) are ever read. A part is verified against the size and
checksum recorded in the commit record before it is decoded: :mod:`.tensorfile` parts are parsed (JSON header,
tensors viewing the bytes read; nothing is unpickled), parts of the previous format (``torch.save``) are loaded
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

from .format import (
    CheckpointError,
    CommitRecord,
    CorruptCheckpointError,
    commit_path,
    deserialize_state,
    parse_step_dir,
    part_data_path,
    validate_part_name,
    validate_step,
)
from .checksum import checksum, parse_checksum
from .storage import Storage
from .tensorfile import decode_part, is_tensorfile

__all__ = [
    "check_compatible",
    "decode_verified",
    "latest_committed",
    "list_committed",
    "load_latest",
    "load_part",
    "read_commit",
]

logger = logging.getLogger(__name__)


def list_committed(storage: Storage) -> list[int]:
    """Steps that have a commit record, oldest first (the records themselves are not validated here)."""
    steps = sorted(s for s in (parse_step_dir(n) for n in storage.list("")) if s is not None)
    return [s for s in steps if storage.exists(commit_path(s))]


def read_commit(storage: Storage, step: int) -> CommitRecord:
    """The commit record of ``step``.

    Raises :class:`CheckpointError` if ``step`` is not committed, :class:`CorruptCheckpointError` if its
    record is malformed or belongs to another step.
    """
    validate_step(step)
    try:
        data = storage.read_bytes(commit_path(step))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint step {step} is not committed in {storage.url}") from None
    record = CommitRecord.from_json(data)
    if record.step != step:
        raise CorruptCheckpointError(f"commit record of step {step} names step {record.step}")
    return record


def latest_committed(storage: Storage) -> CommitRecord | None:
    """The newest valid commit record, or ``None`` if there is none (malformed records are skipped)."""
    for step in reversed(list_committed(storage)):
        try:
            return read_commit(storage, step)
        except CorruptCheckpointError as exc:
            logger.warning("checkpoint step %d in %s skipped: %s", step, storage.url, exc)
    return None


def load_part(
    storage: Storage,
    step: int,
    part_name: str,
    verify: bool = True,
    *,
    record: CommitRecord | None = None,
) -> dict[str, Any]:
    """Load ``part_name`` of committed checkpoint ``step``.

    With ``verify`` (the default) the part's size and SHA-256 are checked against the commit record.
    Raises :class:`CorruptCheckpointError` if the part is missing, truncated, fails its checksum or cannot be
    deserialized; :class:`CheckpointError` if the step is not committed or has no such part.
    """
    validate_part_name(part_name)
    if record is None:
        record = read_commit(storage, step)
    elif record.step != step:
        raise ValueError(f"record is for step {record.step}, not step {step}")
    info = record.parts.get(part_name)
    if info is None:
        raise CheckpointError(
            f"checkpoint step {step} has no part {part_name!r} (parts: {', '.join(sorted(record.parts))})"
        )
    try:
        data = storage.read_buffer(part_data_path(step, part_name))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint step {step}: part {part_name!r} is missing") from None
    return decode_verified(data, info.checksum if verify else None, info.size if verify else None,
                           f"checkpoint step {step}: part {part_name!r}")


def decode_verified(data: bytearray | bytes, expected_checksum: str | None, expected_size: int | None,
                    what: str) -> dict[str, Any]:
    """Verify a part file's bytes (size, checksum ``"algo:hex"``; ``None`` skips a check) and decode them
    (either format). Raises :class:`CorruptCheckpointError` starting with ``what`` on any mismatch."""
    if expected_size is not None and len(data) != expected_size:
        raise CorruptCheckpointError(f"{what} has {len(data)} bytes, the record says {expected_size}")
    if expected_checksum is not None:
        algorithm, _ = parse_checksum(expected_checksum)
        got = checksum([data], algorithm)
        if got != expected_checksum:
            raise CorruptCheckpointError(f"{what}: checksum {got} does not match the record ({expected_checksum})")
    try:
        state = decode_part(data) if is_tensorfile(data) else deserialize_state(bytes(data))
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{what}: {exc}") from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{what} holds a {type(state).__name__}, expected a dict")
    return state


def load_latest(
    storage: Storage,
    part_name: str,
    *,
    verify: bool = True,
    expected: Mapping[str, Any] | None = None,
) -> tuple[int, dict[str, Any]] | None:
    """``(step, state)`` of the newest committed checkpoint whose ``part_name`` loads and verifies.

    Corrupt checkpoints (torn commit record, truncated or altered part) are skipped with a warning and the
    previous committed one is tried. Returns ``None`` if no committed checkpoint is usable. With ``expected``,
    every record is first checked with :func:`check_compatible` (an incompatible one raises).
    """
    validate_part_name(part_name)
    for step in reversed(list_committed(storage)):
        try:
            record = read_commit(storage, step)
            if expected:
                check_compatible(record, **expected)
            return step, load_part(storage, step, part_name, verify=verify, record=record)
        except CorruptCheckpointError as exc:
            logger.warning("checkpoint step %d in %s is corrupt, trying an older one: %s", step, storage.url, exc)
    return None


def _json_normal(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return value


def check_compatible(record: CommitRecord, **expected: Any) -> None:
    """Raise :class:`CheckpointError` naming the field if ``record.metadata`` differs from ``expected``.

    Example: ``check_compatible(record, plan_hash=plan.hash, profile_hash=profile.hash, world_size=4)``.
    Values are compared as they read back from JSON (tuples compare equal to lists). A field missing from the
    record is an error too.
    """
    for key, want in expected.items():
        if key not in record.metadata:
            raise CheckpointError(
                f"checkpoint step {record.step} is incompatible: its metadata has no {key!r} "
                f"(this run expects {want!r})"
            )
        have = record.metadata[key]
        if _json_normal(have) != _json_normal(want):
            raise CheckpointError(
                f"checkpoint step {record.step} is incompatible: {key} is {have!r} in the checkpoint, "
                f"this run expects {want!r}"
            )
