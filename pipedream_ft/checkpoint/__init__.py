"""Asynchronous, committed, verified checkpoints of pipeline parts on local disk or object storage.

Typical use, on every rank::

    storage = Storage("s3://bucket/run-7", {"client_kwargs": {"endpoint_url": url}})
    storage.check_writable()                       # fail fast with one clear message
    writer = CheckpointWriter(storage, f"stage{stage}-r{replica}", expected_parts=all_parts,
                              is_committer=(rank == 0), metadata={"plan_hash": plan_hash})
    ...
    handle = writer.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    ...
    writer.close()

and on restart::

    found = load_latest(storage, part_name, expected={"plan_hash": plan_hash})
"""

from __future__ import annotations

from .format import CheckpointError, CommitRecord, CorruptCheckpointError, PartMeta
from .reader import check_compatible, latest_committed, list_committed, load_latest, load_part, read_commit
from .storage import RetryConfig, Storage, StorageError
from .writer import CheckpointWriter, SaveHandle

__all__ = [
    "CheckpointError",
    "CheckpointWriter",
    "CommitRecord",
    "CorruptCheckpointError",
    "PartMeta",
    "RetryConfig",
    "SaveHandle",
    "Storage",
    "StorageError",
    "check_compatible",
    "latest_committed",
    "list_committed",
    "load_latest",
    "load_part",
    "read_commit",
]
