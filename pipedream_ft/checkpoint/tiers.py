"""Checkpoint tiers: where a rank's part of a checkpoint can be kept, from fast and volatile to slow and durable.

A :class:`Tier` stores encoded parts (:mod:`.tensorfile` bytes with their checksum) by step and part name:

* :class:`~.shm.MemoryTier`: files under ``/dev/shm/<job-scoped dir>`` on this node; survives the death of the
  process that wrote it (not of the node); removed with :meth:`~.shm.MemoryTier.destroy` at job end;
* :class:`~.peer.PeerTier`: my part pushed over TCP to a peer rank's process (on another node), which keeps it
  in its own :class:`~.shm.MemoryTier` (:class:`~.peer.PeerServer`): covers the loss of my node;
* :class:`DurableTier`: the fsspec :class:`~.storage.Storage` (local disk, S3) with the commit protocol of
  :class:`~.writer.CheckpointWriter`; only committed steps count as complete there.

:class:`TierWriter` saves a state asynchronously into one or more tiers (snapshot now, encode once, put into
each tier in the background: a :class:`~.background.Background` thread shared with the process's other parts'
tier writers, or a thread of its own). The runtime decides when each tier saves (its own policy per tier) and which
to restore from: :func:`available_steps` tells, per tier, the steps for which this rank's part can be read, and
:func:`load_newest` loads the newest step every rank can get (the runtime agrees on it across ranks first:
``min`` over ranks of the newest available step is *not* enough, it must intersect the sets), verifying the part
against its checksum and falling back to older steps or slower tiers when a part is corrupt or missing.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .background import Background, Client
from .checksum import DEFAULT_ALGORITHM, validate_algorithm
from .format import CheckpointError, CorruptCheckpointError, validate_part_name, validate_step
from .reader import list_committed, load_part
from .snapshot import Snapshot, SnapshotPool
from .storage import Buffers, Storage

__all__ = ["DurableTier", "Tier", "TierSave", "TierWriter", "available_steps", "load_newest"]

logger = logging.getLogger(__name__)


class Tier(ABC):
    """Where parts of checkpoints are kept. Implementations must make :meth:`put` atomic: a part is either
    listed by :meth:`steps` complete and verifiable, or not listed."""

    name: str = "tier"

    @abstractmethod
    def put(self, step: int, part: str, data: Buffers | bytes, checksum: str) -> None:
        """Store the encoded ``part`` of ``step`` (its bytes and their ``"algo:hex"`` checksum)."""

    @abstractmethod
    def steps(self, parts: Sequence[str]) -> list[int]:
        """Steps (oldest first) for which every part in ``parts`` is stored here."""

    @abstractmethod
    def get(self, step: int, part: str) -> dict[str, Any]:
        """Load ``part`` of ``step``, verified against its checksum. :class:`CorruptCheckpointError` if it is
        torn or corrupt, :class:`CheckpointError` if it is not there."""

    @abstractmethod
    def keep_last(self, k: int, parts: Sequence[str] | None = None) -> None:
        """Delete all but the newest ``k`` steps (of ``parts``; all parts stored here by default)."""

    def close(self) -> None:
        """Release resources (connections); stored parts stay."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class DurableTier(Tier):
    """The fsspec storage as a tier, for reading: complete steps are the committed ones, parts verified.

    Writing goes through :class:`~.writer.CheckpointWriter` (its commit protocol makes a step complete);
    :meth:`put` is not offered here."""

    name = "durable"

    def __init__(self, storage: Storage) -> None:
        if not isinstance(storage, Storage):
            raise TypeError(f"storage must be a Storage, got {type(storage).__name__}")
        self.storage = storage

    def put(self, step: int, part: str, data: Buffers | bytes, checksum: str) -> None:
        raise CheckpointError(f"the durable tier is read-only here (step {step}, part {part!r}): write it with "
                              "CheckpointWriter, whose commit protocol makes a step complete")

    def steps(self, parts: Sequence[str]) -> list[int]:
        return list_committed(self.storage)

    def get(self, step: int, part: str) -> dict[str, Any]:
        return load_part(self.storage, step, part)

    def keep_last(self, k: int, parts: Sequence[str] | None = None) -> None:
        raise CheckpointError(f"the durable tier is read-only here (keep_last({k})): CheckpointWriter(keep=) "
                              "collects old commits")


def available_steps(tiers: Iterable[Tier], part: str) -> dict[str, list[int]]:
    """For each tier (by name), the steps at which ``part`` is stored there (unreachable tiers: ``[]``)."""
    out: dict[str, list[int]] = {}
    for tier in tiers:
        try:
            out[tier.name] = tier.steps([part])
        except Exception as exc:  # a dead peer, an unreachable bucket: that tier has nothing for us
            logger.warning("checkpoint tier %s: cannot list steps: %s", tier.name, exc)
            out[tier.name] = []
    return out


def load_newest(tiers: Sequence[Tier], part: str, steps: Iterable[int]) -> tuple[int, str, dict[str, Any]] | None:
    """Load ``part`` at the newest of ``steps`` (the steps every rank can get, agreed by the caller) from the
    first tier in ``tiers`` (fastest first) that has it and verifies; older steps are tried if none does.

    Returns ``(step, tier name, state)``, or ``None`` if no step can be loaded from any tier.
    """
    for step in sorted(set(steps), reverse=True):
        for tier in tiers:
            try:
                return step, tier.name, tier.get(step, part)
            except CorruptCheckpointError as exc:
                logger.warning("checkpoint step %d part %s in tier %s is corrupt: %s", step, part, tier.name, exc)
            except (CheckpointError, OSError) as exc:
                logger.debug("checkpoint step %d part %s not in tier %s: %s", step, part, tier.name, exc)
    return None


@dataclass(slots=True)
class TierSave:
    """Progress of one :meth:`TierWriter.save`: done once every tier has the part, or has failed."""

    step: int
    snapshot_s: float
    """Seconds the save blocked (the snapshot)."""
    put_s: dict[str, float]
    """Seconds each tier took to store the part (tiers that failed are absent)."""
    errors: dict[str, str]
    """Why a tier did not store the part, by tier name."""
    bytes: int = 0
    _event: threading.Event | None = None

    def wait(self, timeout: float | None = None) -> bool:
        assert self._event is not None
        return self._event.wait(timeout)

    def done(self) -> bool:
        assert self._event is not None
        return self._event.is_set()

    @property
    def ok(self) -> bool:
        return self.done() and not self.errors


class TierWriter(Client):
    """Saves this rank's part into fast tiers in the background: ``save`` snapshots (immutable tensors referenced,
    the rest copied into reused buffers), the background thread encodes the part once and puts it into every tier
    in order. ``background``: the thread serving it, shared with the process's other parts' tier writers (the
    caller closes it after them; see :mod:`.background`); ``None``: a thread of its own.

    Like :class:`~.writer.CheckpointWriter` it never drops a save: :attr:`backlog` counts saves not finished, and
    ``save`` waits while ``max_queued`` are queued. A tier that fails is logged once per run of failures, and
    the other tiers still get the part.
    """

    priority = 0  # served before the durable writers: the fast tiers are what in-place recovery restores

    def __init__(
        self,
        tiers: Sequence[Tier],
        part_name: str,
        *,
        keep: int = 2,
        max_queued: int = 1,
        checksum_algorithm: str = DEFAULT_ALGORITHM,
        background: Background | None = None,
    ) -> None:
        if not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise TypeError(f"tiers must be a non-empty sequence of Tier, got {tiers!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ValueError(f"max_queued must be an int >= 1, got {max_queued!r}")
        if background is not None and not isinstance(background, Background):
            raise TypeError(f"background must be a Background, got {type(background).__name__}")
        self.tiers = tuple(tiers)
        self.part_name = validate_part_name(part_name)
        self.keep = keep
        self.max_queued = max_queued
        self.checksum_algorithm = validate_algorithm(checksum_algorithm)
        self._pool = SnapshotPool(max_arenas=max_queued + 1)
        self._own_background = background is None
        self._background = background if background is not None else Background(f"checkpoint-tiers-{part_name}")
        self._cond = self._background.cond
        self._queue: collections.deque[tuple[TierSave, Any]] = collections.deque()
        self._outstanding = 0
        self._closing = False
        self._last_step: int | None = None
        self._failing: dict[str, float] = {}
        self._background.attach(self)

    @property
    def backlog(self) -> int:
        """Saves not finished yet (queued or being put)."""
        with self._cond:
            return self._outstanding

    def save(self, step: int, state: Mapping[str, Any] | Snapshot) -> TierSave:
        """Snapshot ``state`` and put it into every tier in the background; returns after the snapshot. ``state``
        may be a snapshot taken already (by another writer, for the same cut): this writer then holds it too, and
        the caller still releases its own hold."""
        validate_step(step)
        if not isinstance(state, (Mapping, Snapshot)):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        t0 = time.perf_counter()
        with self._cond:
            self._check(step)
            while len(self._queue) >= self.max_queued and not self._closing:
                self._cond.wait()
            self._check(step)
        snap = state.retain() if isinstance(state, Snapshot) else self._pool.take(dict(state))
        handle = TierSave(step, time.perf_counter() - t0, {}, {}, _event=threading.Event())
        with self._cond:
            self._last_step = step
            self._queue.append((handle, snap))
            self._outstanding += 1
            self._cond.notify_all()
        return handle

    def _check(self, step: int) -> None:
        if self._closing:
            raise CheckpointError(f"tier writer {self.part_name!r} is closed")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step must increase: got {step} after {self._last_step}")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is finished; ``False`` if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._outstanding:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush (up to ``timeout``; what is queued then still gets up to 5 s), stop serving it (its own thread
        stops) and close the tiers; saves left then fail. Idempotent."""
        flushed = self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if not flushed:
            self.flush(5.0)
        idle = self._background.detach(self, timeout=None if flushed else 5.0)
        if self._own_background:
            self._background.close(timeout=None if idle else 0.0)
        with self._cond:
            leftovers = list(self._queue)
            self._queue.clear()
        for handle, snap in leftovers:
            handle.errors["*"] = f"step {handle.step} abandoned: tier writer {self.part_name!r} closed"
            self._done(handle, snap)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                pass
        return flushed

    def due(self, now: float) -> float | None:
        return now if self._queue else None

    def serve(self, now: float) -> None:
        with self._cond:
            if not self._queue:
                return
            handle, snap = self._queue.popleft()
            self._cond.notify_all()  # a save waiting for queue space may go on
        try:
            self._put(handle, snap)
        except Exception as exc:  # never let the thread die
            logger.exception("checkpoint tiers %s: unexpected error", self.part_name)
            handle.errors["*"] = str(exc)
        finally:
            self._done(handle, snap)

    def _done(self, handle: TierSave, snap: Any) -> None:
        snap.release()
        assert handle._event is not None
        handle._event.set()
        with self._cond:
            self._outstanding -= 1
            self._cond.notify_all()

    def _put(self, handle: TierSave, snap: Any) -> None:
        data, digest = snap.encoded(self.checksum_algorithm)
        handle.bytes = len(data)
        for tier in self.tiers:
            t0 = time.perf_counter()
            try:
                tier.put(handle.step, self.part_name, data, digest)
                tier.keep_last(self.keep, [self.part_name])
            except Exception as exc:
                handle.errors[tier.name] = f"{type(exc).__name__}: {exc}"
                if tier.name not in self._failing:
                    self._failing[tier.name] = time.monotonic()
                    logger.warning("checkpoint tier %s: part %s step %d not stored (%s); training goes on; further "
                                   "failures of this tier are logged at DEBUG until it works again",
                                   tier.name, self.part_name, handle.step, handle.errors[tier.name])
                else:
                    logger.debug("checkpoint tier %s: part %s step %d not stored (%s)", tier.name, self.part_name,
                                 handle.step, handle.errors[tier.name])
                continue
            handle.put_s[tier.name] = time.perf_counter() - t0
            since = self._failing.pop(tier.name, None)
            if since is not None:
                logger.info("checkpoint tier %s works again after %.1fs", tier.name, time.monotonic() - since)
