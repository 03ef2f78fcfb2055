"""Asynchronous, committed, verified checkpoints of pipeline parts on local disk or object storage.

Typical use, on every rank::

    storage = Storage("s3://bucket/run-7", {"client_kwargs": {"endpoint_url": url}})
    storage.check_writable()                       # fail fast with one clear message
    writer = CheckpointWriter(storage, f"stage{stage}-r{replica}", expected_parts=all_parts,
                              is_committer=(rank == 0), metadata={"plan_hash": plan_hash})
    ...
    # weight versions are never modified after creation: referenced, not copied; the rest is copied
    handle = writer.save(step, {"versions": immutable(versions), "optim": opt.state_dict()})
    ...                                            # stage 0 defers its next cut while writer.backlog > 0
    ...
    writer.close()

and on restart::

    found = load_latest(storage, part_name, expected={"plan_hash": plan_hash})
"""

from __future__ import annotations

from .checksum import ALGORITHMS as CHECKSUM_ALGORITHMS
from .format import CheckpointError, CommitRecord, CorruptCheckpointError, PartMeta
from .reader import (check_compatible, decode_verified, latest_committed, list_committed, load_latest, load_part,
                     read_commit)
from .snapshot import Immutable, SnapshotPool, immutable
from .storage import Buffers, RetryConfig, Storage, StorageError
from .writer import CheckpointWriter, SaveHandle

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "Buffers",
    "CheckpointError",
    "CheckpointWriter",
    "CommitRecord",
    "CorruptCheckpointError",
    "Immutable",
    "PartMeta",
    "RetryConfig",
    "SaveHandle",
    "SnapshotPool",
    "Storage",
    "StorageError",
    "check_compatible",
    "decode_verified",
    "immutable",
    "latest_committed",
    "list_committed",
    "load_latest",
    "load_part",
    "read_commit",
]
