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

Tiers (:mod:`.tiers`): a :class:`TierWriter` saves often into fast tiers — this node's shared memory
(:class:`MemoryTier`) and a buddy rank's memory over TCP (:class:`PeerTier` to its :class:`PeerServer`) — while
the :class:`CheckpointWriter` saves less often to the durable storage (:class:`DurableTier` for reading it)::

    shm = MemoryTier(job_id, key=job_key)                       # /dev/shm/pdft-<tag>-<job_id>, private
    server = PeerServer(shm, host=node_address, token=peer_token(job_key)).start()  # publish its address
    fast = TierWriter([shm, PeerTier(buddy_address, token=peer_token(job_key))], part_name, keep=2)
    fast.save(step, state)                                      # each tier's policy decides when
    ...
    tiers = [shm, PeerTier(buddy_address, token=peer_token(job_key)), DurableTier(storage)]
    mine = available_steps(tiers, part_name)                    # agree across ranks on a step every part has
    step, tier_name, state = load_newest(tiers, part_name, agreed_steps)
    ...
    shm.destroy()                                               # at job end

A process holding several parts (one per stage) serves all its writers, of every tier, from one thread
(:mod:`.background`)::

    background = Background("checkpoint-writer")
    writers = [CheckpointWriter(storage, name, expected_parts=all_parts, background=background) for name in mine]
    fast = [TierWriter([shm], name, background=background) for name in mine]
    ...                                                         # close the writers, then the background
    background.close()
"""

from __future__ import annotations

from .background import Background
from .checksum import ALGORITHMS as CHECKSUM_ALGORITHMS
from .format import CheckpointError, CommitRecord, CorruptCheckpointError, PartMeta
from .reader import (check_compatible, decode_verified, latest_committed, list_committed, load_latest, load_part,
                     read_commit)
from .owner import Owner, OwnershipError
from .peer import PeerClient, PeerError, PeerServer, PeerTier
from .shm import MemoryTier
from .snapshot import Immutable, SnapshotPool, immutable
from .storage import Buffers, RetryConfig, Storage, StorageError
from .tiers import DurableTier, Tier, TierSave, TierWriter, available_steps, load_newest
from .writer import CheckpointWriter, SaveHandle

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "Background",
    "Buffers",
    "CheckpointError",
    "CheckpointWriter",
    "CommitRecord",
    "CorruptCheckpointError",
    "DurableTier",
    "Immutable",
    "MemoryTier",
    "Owner",
    "OwnershipError",
    "PartMeta",
    "PeerClient",
    "PeerError",
    "PeerServer",
    "PeerTier",
    "RetryConfig",
    "SaveHandle",
    "SnapshotPool",
    "Storage",
    "StorageError",
    "Tier",
    "TierSave",
    "TierWriter",
    "available_steps",
    "check_compatible",
    "decode_verified",
    "immutable",
    "latest_committed",
    "list_committed",
    "load_latest",
    "load_newest",
    "load_part",
    "read_commit",
]
