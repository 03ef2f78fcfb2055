"""Asynchronous checkpoint writer: snapshot now, persist in a low-priority thread, commit when all parts are durable.

Every rank owns one :class:`CheckpointWriter` writing its *part* of each checkpoint.

**Save.** :meth:`CheckpointWriter.save` takes a snapshot (:mod:`.snapshot`) — the only time training waits:
tensors marked :func:`~.snapshot.immutable` are referenced, every other tensor is copied into reused buffers —
and queues it. One background thread per writer persists the queued snapshots in order; its work is mostly
GIL-free (``O_DIRECT`` writes straight from the snapshot's memory, ``zlib.crc32``), and ``persist_nice`` can
lower its CPU priority:

1. delete a stale part meta left by an earlier run, if any;
2. write ``part-{name}.pt`` (:mod:`.tensorfile`: JSON header, then the tensors' bytes straight from memory, no
   serialization copy) atomically with a single fsync, then ``part-{name}.json`` (name, step, checksum, size).

On the committer (one writer among all ranks, ``is_committer=True``) the thread then polls storage until the meta
of every part in ``expected_parts`` exists for that step and the part file it describes has the recorded size,
and writes ``COMMIT.json`` (last, atomically, durably) with every part's checksum, then garbage-collects: keeps
the newest ``keep`` committed checkpoints and removes uncommitted step directories older than the newest commit.

**Never dropped.** The writer never drops a save on its own. Contract with the caller (the runtime):

* :attr:`CheckpointWriter.backlog` is the number of saves not finished yet: not durable (on every writer), or
  not committed (on the committer). Stage 0 runs on rank 0, the committer: before deciding a new cut it
  passes ``busy=writer.backlog > 0`` to :meth:`~pipedream_ft.policies.CheckpointPolicy.should_save`, which then
  defers the checkpoint (stretching the interval, and logging it) instead of queueing saves that storage
  cannot absorb. Since every part is durable before its step commits, the other ranks' backlogs are then
  empty whenever stage 0 decides a cut.
* If a caller queues faster anyway, :meth:`save` waits (training waits, with a warning) while ``max_queued``
  saves are queued; nothing is dropped.
* :attr:`CheckpointWriter.last_committed` (committer) and :attr:`CheckpointWriter.last_durable` give the newest
  committed step and the newest durable part; every :class:`SaveHandle` carries the measured ``snapshot_s``
  (blocking), ``persist_s`` / ``persist_cpu_s`` (background) and ``commit_s``, to feed
  :meth:`~pipedream_ft.policies.CheckpointPolicy.observe`.

**Failures never block training.** A part that cannot be written is retried (with backoff) until the step's
deadline (``commit_timeout_s`` after ``save``) or until a newer save is queued; a step whose parts do not all
appear (or whose part files vanished) before the deadline is given up (no commit). A commit record is never
written unless every part's meta, written only after the part itself is durable, was read back and the part
file has the recorded size. The log says once what failed and how long since the last commit; further failures
go to DEBUG until storage works again, which is logged too. Storage that refuses a write for good (full,
read-only, over a file-size limit, forbidden: :attr:`~.storage.StorageError.refused`) is not retried: the step
is given up at once and what was written of it removed (:attr:`CheckpointWriter.refused` says why).

**One history.** After the training state is rolled back to a step (a resume from an older checkpoint because
the newest did not verify, an in-place recovery), :meth:`CheckpointWriter.rewind` abandons the saves of later
steps and the committer retires the later commits (records first, newest first), so the steps are written
anew when training reaches them again and a reader never sees two histories mixed.

**One owner.** ``before_commit`` (the job's :class:`~.owner.Owner` check) runs before each commit record is
written; once it raises, this writer commits nothing more.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .checksum import DEFAULT_ALGORITHM, validate_algorithm
from .format import (
    CheckpointError,
    CommitRecord,
    CorruptCheckpointError,
    PartMeta,
    commit_path,
    normalize_metadata,
    parse_step_dir,
    part_data_path,
    part_meta_path,
    step_dir,
    validate_part_name,
    validate_step,
)
from .snapshot import Snapshot, SnapshotPool
from .storage import Buffers, Storage, StorageError

__all__ = ["CheckpointWriter", "SaveHandle", "lower_thread_priority"]

logger = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> bool:
    """Set the calling thread's nice value to ``nice`` (Linux: threads have their own). Returns whether it
    worked; raising the priority (lowering the value) needs privileges and is not attempted."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return False
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except OSError:
        return False


class SaveHandle:
    """Progress of one :meth:`CheckpointWriter.save`.

    The handle is *done* when this writer has finished with the step: its part is durable (or was given up),
    and on the committer the commit record is written (or the commit was given up).
    """

    __slots__ = (
        "step", "snapshot_s", "copied_bytes", "referenced_bytes", "persist_s", "persist_cpu_s", "bytes",
        "commit_s", "error", "committed", "finished_at", "_event",
    )

    def __init__(self, step: int, snapshot_s: float, copied_bytes: int = 0, referenced_bytes: int = 0) -> None:
        self.step: int = step
        """Update number of the checkpoint."""
        self.snapshot_s: float = snapshot_s
        """Seconds :meth:`CheckpointWriter.save` blocked (the snapshot: the time training waited)."""
        self.copied_bytes: int = copied_bytes
        """Bytes of mutable tensors copied by the snapshot."""
        self.referenced_bytes: int = referenced_bytes
        """Bytes of immutable tensors referenced by the snapshot, not copied."""
        self.persist_s: float | None = None
        """Seconds from the persist thread taking the save to the part being durable (``None`` until then)."""
        self.persist_cpu_s: float | None = None
        """CPU seconds the persist thread spent on it (encoding, checksum, writing; not the waits)."""
        self.bytes: int | None = None
        """Size of the part file written."""
        self.commit_s: float | None = None
        """Committer only: seconds from the part being durable to the commit record being written."""
        self.error: BaseException | None = None
        """Why the part was not persisted or the step not committed; ``None`` on success."""
        self.committed: bool | None = None
        """Committer only: whether the step is committed; ``None`` on other writers."""
        self.finished_at: float | None = None
        """Wall-clock time (``time.time()``) the handle became done."""
        self._event = threading.Event()

    @property
    def blocking_s(self) -> float:
        """Same as :attr:`snapshot_s`."""
        return self.snapshot_s

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or ``timeout`` seconds passed; return :meth:`done`. Errors are in :attr:`error`."""
        return self._event.wait(timeout)

    @property
    def ok(self) -> bool:
        """Done without error."""
        return self.done() and self.error is None

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("ok" if self.error is None else f"error={self.error}")
        return f"SaveHandle(step={self.step}, {state})"


@dataclass(slots=True)
class _Job:
    step: int
    snapshot: Snapshot
    metadata: dict[str, Any]
    handle: SaveHandle
    deadline: float
    generation: int = 0


@dataclass(slots=True)
class _Pending:
    step: int
    metadata: dict[str, Any]
    handle: SaveHandle
    deadline: float
    durable_at: float
    found: dict[str, PartMeta] = field(default_factory=dict)


class _Trouble:
    """Logs a run of failures once: a WARNING for the first, DEBUG for the rest, INFO when it ends."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None
        self.count = 0

    def fail(self, message: str, *args: Any) -> None:
        self.count += 1
        if self.since is None:
            self.since = time.monotonic()
            logger.warning(
                f"{self.what}: {message}; training goes on; further failures are logged at DEBUG until it works again",
                *args,
            )
        else:
            logger.debug(f"{self.what}: {message}", *args)

    def ok(self, message: str) -> None:
        if self.since is not None:
            logger.info("%s: %s after %.1fs (%d failures)", self.what, message, time.monotonic() - self.since, self.count)
        self.since, self.count = None, 0


class CheckpointWriter:
    """Writes this rank's part of each checkpoint in the background; on the committer, also commits.

    Args:
        storage: where checkpoints live (shared by all ranks).
        part_name: this writer's part (e.g. ``f"stage{s}"`` or ``f"rank{r}"``); unique among the ranks.
        expected_parts: committer only: every part a checkpoint must have (defaults to ``[part_name]``).
        is_committer: whether this writer writes the commit records (exactly one rank should).
        keep: committer only: how many committed checkpoints to keep.
        commit_timeout_s: a step not committed this long after its ``save`` is given up.
        metadata: JSON metadata put in every commit record (plan hash, profile hash, world size, ...);
            ``save(metadata=...)`` adds to it.
        on_commit: committer only: called with the step in the background thread after each commit.
        before_commit: committer only: called with the step right before each commit record is written; if it
            raises, the step is not committed and no later one will be (:attr:`stopped` says why): the location
            is no longer this job's (see :mod:`.owner`).
        poll_interval_s: first delay between polls for missing parts (doubled up to ``max_poll_interval_s``).
        max_poll_interval_s: longest delay between polls and between retries of a failed write.
        max_queued: :meth:`save` waits while this many saves are queued (never drops one). Callers should not
            get there: see :attr:`backlog`.
        checksum: ``"crc32"`` (default, fast) or ``"sha256"`` (see :mod:`.checksum`).
        persist_nice: nice value for the persist thread (``None``, the default: the caller's). Measured on a
            shared 2-core machine, 19 starved the persist thread behind other processes (persist 4x slower,
            commits late, most checkpoints deferred) and risks the GIL being held by a descheduled thread; the
            persist thread's CPU work is small anyway (O_DIRECT writes, crc32: ~0.3 s per GB).
    """

    def __init__(
        self,
        storage: Storage,
        part_name: str,
        *,
        expected_parts: list[str] | None = None,
        is_committer: bool = False,
        keep: int = 3,
        commit_timeout_s: float = 300.0,
        metadata: Mapping[str, Any] | None = None,
        on_commit: Callable[[int], None] | None = None,
        before_commit: Callable[[int], None] | None = None,
        poll_interval_s: float = 0.05,
        max_poll_interval_s: float = 2.0,
        max_queued: int = 2,
        checksum: str = DEFAULT_ALGORITHM,
        persist_nice: int | None = None,
    ) -> None:
        if not isinstance(storage, Storage):
            raise TypeError(f"storage must be a Storage, got {type(storage).__name__}")
        validate_part_name(part_name)
        if expected_parts is not None:
            expected = [validate_part_name(p) for p in expected_parts]
            if len(set(expected)) != len(expected):
                raise ValueError(f"expected_parts must be unique, got {expected_parts!r}")
            if not expected:
                raise ValueError("expected_parts must be non-empty, got []")
        else:
            expected = [part_name]
        if is_committer and part_name not in expected:
            raise ValueError(f"the committer's part {part_name!r} must be in expected_parts {expected!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if not commit_timeout_s > 0:
            raise ValueError(f"commit_timeout_s must be > 0, got {commit_timeout_s!r}")
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        if not max_poll_interval_s >= poll_interval_s:
            raise ValueError(
                f"max_poll_interval_s must be >= poll_interval_s ({poll_interval_s}), got {max_poll_interval_s!r}"
            )
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ValueError(f"max_queued must be an int >= 1, got {max_queued!r}")
        if on_commit is not None and not callable(on_commit):
            raise TypeError(f"on_commit must be callable, got {type(on_commit).__name__}")
        validate_algorithm(checksum)
        if persist_nice is not None and (isinstance(persist_nice, bool) or not isinstance(persist_nice, int)
                                         or not -20 <= persist_nice <= 19):
            raise ValueError(f"persist_nice must be None or an int in [-20, 19], got {persist_nice!r}")

        self.storage = storage
        self.part_name = part_name
        self.expected_parts: tuple[str, ...] = tuple(expected)
        self.is_committer = bool(is_committer)
        self.keep = keep
        self.commit_timeout_s = float(commit_timeout_s)
        self.metadata = normalize_metadata(metadata)
        self.on_commit = on_commit
        self.before_commit = before_commit
        self.poll_interval_s = float(poll_interval_s)
        self.max_poll_interval_s = float(max_poll_interval_s)
        self.max_queued = max_queued
        self.checksum = checksum
        self.persist_nice = persist_nice

        self._pool = SnapshotPool(max_arenas=max_queued + 1)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._pending: dict[int, _Pending] = {}
        self._outstanding = 0
        self._last_step: int | None = None
        self._last_committed: int | None = None
        self._last_durable: int | None = None
        self._started = time.monotonic()
        self._progress_at = self._started
        self._closing = False
        self._closed = False
        self._poll_delay = self.poll_interval_s
        self._generation = 0
        self._writing: int | None = None
        self.refused: CheckpointError | None = None
        """The last write that storage refused for good (full, read-only, over a size limit, forbidden), until a
        later part is written: see :attr:`StorageError.refused`."""
        self.stopped: BaseException | None = None
        """Why this writer commits nothing any more (``before_commit`` raised), or ``None``."""
        self._write_trouble = _Trouble(f"checkpoint part {part_name}")
        self._commit_trouble = _Trouble("checkpoint commit")
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-writer-{part_name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ public API

    def snapshot(self, state: Mapping[str, Any]) -> Snapshot:
        """Snapshot ``state`` into this writer's reused buffers, to hand to :meth:`save` — and to other writers
        (a :class:`~.tiers.TierWriter`'s ``save``), so that a state saved to several places is copied once. The
        caller releases it (:meth:`Snapshot.release`) once it handed it on."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        return self._pool.take(dict(state))

    def save(self, step: int, state: Mapping[str, Any] | Snapshot,
             metadata: Mapping[str, Any] | None = None) -> SaveHandle:
        """Snapshot ``state`` now and persist it in the background; return right after the snapshot.

        ``state`` is a dict of tensors and plain Python values (nested lists/tuples/dicts allowed), or a snapshot
        of one taken already (:meth:`snapshot`; this writer then holds it too, and the caller still releases its
        own hold). Tensors not marked :func:`~.snapshot.immutable` are copied before this returns, so the caller
        may modify them right away; immutable ones must never be modified. Steps must increase. Storage failures
        never raise here.
        """
        validate_step(step)
        if not isinstance(state, (Mapping, Snapshot)):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        meta = dict(self.metadata)
        meta.update(normalize_metadata(metadata))
        t0 = time.perf_counter()
        with self._cond:
            self._check_open(step)
            if len(self._queue) >= self.max_queued:
                logger.warning(
                    "checkpoint part %s: %d saves queued (storage slower than the checkpoint interval); step %d "
                    "waits for one to finish (callers should defer checkpoints while writer.backlog > 0)",
                    self.part_name, len(self._queue), step,
                )
                while len(self._queue) >= self.max_queued and not self._closing:
                    self._cond.wait()
                self._check_open(step)
        snap = state.retain() if isinstance(state, Snapshot) else self._pool.take(dict(state))
        handle = SaveHandle(step, time.perf_counter() - t0, snap.copied_bytes, snap.referenced_bytes)
        job = _Job(step=step, snapshot=snap, metadata=meta, handle=handle,
                   deadline=time.monotonic() + self.commit_timeout_s, generation=self._generation)
        with self._cond:
            try:
                self._check_open(step)
            except BaseException:
                snap.release()
                raise
            self._last_step = step
            self._queue.append(job)
            self._outstanding += 1
            self._cond.notify_all()
        return handle

    def _check_open(self, step: int) -> None:
        if self._closing:
            raise CheckpointError(f"checkpoint writer {self.part_name!r} is closed")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step must increase: got {step} after {self._last_step}")

    @property
    def backlog(self) -> int:
        """Saves not finished yet: queued, being written, or (committer) waiting for the other parts."""
        with self._cond:
            return self._outstanding

    @property
    def last_committed(self) -> int | None:
        """Committer only: the newest step this writer committed (``None`` before the first commit)."""
        return self._last_committed

    @property
    def last_durable(self) -> int | None:
        """The newest step whose part this writer made durable."""
        return self._last_durable

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is persisted (and, on the committer, committed or given up).

        Returns ``False`` if ``timeout`` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._outstanding > 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush (up to ``timeout``), then stop the background thread; unfinished saves fail. Idempotent."""
        flushed = self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=None if flushed else 5.0)
        with self._cond:
            leftovers: list[Any] = list(self._queue) + list(self._pending.values())
            self._queue.clear()
            self._pending.clear()
        for item in leftovers:
            if isinstance(item, _Job):
                item.snapshot.release()
            self._finish(item.handle, CheckpointError(f"step {item.step} abandoned: writer closed"))
        self._closed = True
        return flushed

    @property
    def pending_steps(self) -> list[int]:
        """Steps queued, being written, or (committer) waiting for parts."""
        with self._cond:
            return sorted({j.step for j in self._queue} | set(self._pending))

    def rewind(self, step: int, *, wait_s: float = 30.0) -> list[int]:
        """The training state was rolled back to ``step`` (a resume, an in-place recovery): what this writer
        holds of later steps belongs to a history that will not go on.

        Queued saves and commits waiting for parts of steps after ``step`` are abandoned (their handles fail),
        a part of such a step being written now is not reported durable (this waits up to ``wait_s`` for that
        write to end, so it cannot land after the caller goes on), and the next save may be of any step after
        ``step``. On the committer, the commits newer than ``step`` are *retired*: their commit records are
        deleted newest first (a reader sees, at every moment, a prefix of the old history, never a mix), then
        their directories; the new history writes those steps anew. Returns the retired steps."""
        validate_step(step)
        deadline = time.monotonic() + wait_s
        with self._cond:
            self._generation += 1
            dropped: list[Any] = [j for j in self._queue if j.step > step]
            self._queue = collections.deque(j for j in self._queue if j.step <= step)
            dropped += [self._pending.pop(s) for s in sorted(self._pending) if s > step]
            if self._last_step is not None and self._last_step > step:
                self._last_step = step
            if self._last_durable is not None and self._last_durable > step:
                self._last_durable = None
            if self._last_committed is not None and self._last_committed > step:
                self._last_committed = None
            self._cond.notify_all()
            while self._writing is not None and self._writing > step and time.monotonic() < deadline:
                self._cond.wait(max(0.0, min(0.5, deadline - time.monotonic())))
        for item in dropped:
            if isinstance(item, _Job):
                item.snapshot.release()
            self._finish(item.handle, CheckpointError(f"step {item.step} abandoned: the state was rolled back "
                                                      f"to step {step}"))
        if not self.is_committer:
            return []
        return self._retire_after(step)

    def give_up(self, reason: str) -> list[int]:
        """Committer: give up every commit waiting for parts now (a part is known never to come: its rank's
        storage refused it) and remove those steps' directories; returns their steps."""
        with self._cond:
            doomed = [self._pending.pop(s) for s in sorted(self._pending)]
        for p in doomed:
            self._remove_uncommitted(p.step)
            self._finish(p.handle, CheckpointError(f"step {p.step} not committed: {reason}"))
        return [p.step for p in doomed]

    def _remove_uncommitted(self, step: int) -> None:
        """Remove the directory of a step given up (a resumed run must not find it half-written)."""
        try:
            if not self.storage.exists(commit_path(step)):
                self.storage.delete(step_dir(step), recursive=True)
        except Exception as exc:
            logger.debug("checkpoint step %d: cannot remove its directory: %s", step, exc)

    def flush_parts(self, timeout: float | None = None) -> bool:
        """Wait until no save is queued or being written (commits may still wait for other ranks' parts)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._writing is not None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 0.5)
        return True

    def _retire_after(self, step: int) -> list[int]:
        storage = self.storage
        later = sorted((s for s in (parse_step_dir(n) for n in storage.list("")) if s is not None and s > step),
                       reverse=True)
        retired = [s for s in later if storage.exists(commit_path(s))]
        for s in retired:  # newest first: what is left committed is always a prefix of the old history
            storage.delete(commit_path(s))
        for s in later:
            storage.delete(step_dir(s), recursive=True)
        if retired:
            logger.warning("checkpoint steps %s retired: committed by a history that was rolled back to step %d "
                           "(they are written anew as training reaches them again)",
                           ", ".join(map(str, sorted(retired))), step)
        return sorted(retired)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ background

    def _since_progress(self) -> str:
        what = "commit" if self.is_committer else "durable part"
        last = self._last_committed if self.is_committer else self._last_durable
        if last is None:
            return f"no {what} yet, {time.monotonic() - self._started:.0f}s since start"
        return f"last {what} step {last}, {time.monotonic() - self._progress_at:.0f}s ago"

    def _finish(self, handle: SaveHandle, error: BaseException | None = None) -> None:
        if handle.done():
            return
        handle.error = error
        if self.is_committer and handle.committed is None:
            handle.committed = False
        handle.finished_at = time.time()
        handle._event.set()
        with self._cond:
            self._outstanding -= 1
            self._cond.notify_all()

    def _run(self) -> None:
        if self.persist_nice is not None:
            lower_thread_priority(self.persist_nice)
        while True:
            with self._cond:
                if not self._queue and not self._closing:
                    self._cond.wait(self._poll_delay if self._pending else None)
                if self._closing:
                    return
                job = self._queue.popleft() if self._queue else None
                if job is not None:
                    self._cond.notify_all()  # a save waiting for queue space may go on
            try:
                if job is not None:
                    self._persist(job)
                    self._poll_delay = self.poll_interval_s
                if self._pending:
                    self._poll_commits()
            except Exception:  # never let the thread die; the handles carry the errors
                logger.exception("checkpoint part %s: unexpected error in the writer thread", self.part_name)

    def _wait_or_superseded(self, delay: float, deadline: float, generation: int) -> bool:
        """Sleep ``delay`` (capped at the deadline); return True if a newer save arrived, the state was rolled
        back, or the writer closes."""
        with self._cond:
            if self._queue or self._closing or generation != self._generation:
                return True
            self._cond.wait(max(0.0, min(delay, deadline - time.monotonic())))
            return bool(self._queue) or self._closing or generation != self._generation

    def _persist(self, job: _Job) -> None:
        with self._cond:
            if job.generation != self._generation:  # rolled back past it while it was being taken off the queue
                job.snapshot.release()
                self._finish(job.handle, CheckpointError(f"step {job.step} abandoned: the state was rolled back"))
                return
            self._writing = job.step
        try:
            self._persist_job(job)
        finally:
            with self._cond:
                self._writing = None
                self._cond.notify_all()

    def _persist_job(self, job: _Job) -> None:
        step, handle = job.step, job.handle
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            data, digest = job.snapshot.encoded(self.checksum)
            meta = PartMeta(name=self.part_name, step=step, checksum=digest, size=len(data))
        except Exception as exc:
            job.snapshot.release()
            logger.warning("checkpoint part %s step %d: cannot serialize: %s", self.part_name, step, exc)
            self._finish(handle, CheckpointError(f"step {step}: cannot serialize part: {exc}"))
            return
        try:
            self._write_part(job, data, meta, t0, c0)
        finally:
            job.snapshot.release()
            del data

    def _write_part(self, job: _Job, data: Buffers, meta: PartMeta, t0: float, c0: float) -> None:
        step, handle, storage = job.step, job.handle, self.storage
        delay = self.poll_interval_s
        while True:
            try:
                if storage.exists(commit_path(step)):
                    # Not after a roll-back (rewind() retired later commits): an earlier attempt of this same
                    # history committed it; its parts are the ones the commit record describes, so leave them and
                    # count the step as done (the durable position advances; later cuts are not deferred)
                    logger.info("checkpoint step %d is already committed; not rewriting part %s", step, self.part_name)
                    handle.persist_s, handle.persist_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
                    self._last_durable = step
                    if self.is_committer:
                        handle.committed = True
                        self._last_committed = step
                    self._progress_at = time.monotonic()
                    self._finish(handle)
                    return
                storage.delete(part_meta_path(step, self.part_name))
                storage.write_bytes(part_data_path(step, self.part_name), data)
                storage.write_bytes_unsynced(part_meta_path(step, self.part_name), meta.to_json())
                break
            except Exception as exc:
                now = time.monotonic()
                reason = exc if isinstance(exc, CheckpointError) else storage.describe_error(exc)
                if isinstance(exc, StorageError) and exc.refused:
                    self._refused(job, exc)
                    return
                if now >= job.deadline:
                    self._write_trouble.fail(
                        "step %d: write failed, giving up after %.1fs (%s): %s",
                        step, self.commit_timeout_s, self._since_progress(), reason,
                    )
                    self._finish(handle, CheckpointError(f"step {step}: part {self.part_name!r} not written: {reason}"))
                    return
                self._write_trouble.fail(
                    "step %d: write failed (%s), retrying until the step's deadline (%s)",
                    step, reason, self._since_progress(),
                )
                if self._wait_or_superseded(delay, job.deadline, job.generation):
                    logger.debug("checkpoint part %s step %d: giving up, a newer save is queued", self.part_name, step)
                    self._finish(handle, CheckpointError(f"step {step}: part {self.part_name!r} not written: {reason}"))
                    return
                delay = min(delay * 2, self.max_poll_interval_s)
        self._write_trouble.ok("writes succeed again")
        self.refused = None
        if job.generation != self._generation:  # rolled back while it was being written: never durable
            self._finish(handle, CheckpointError(f"step {step} abandoned: the state was rolled back"))
            return
        handle.persist_s = time.perf_counter() - t0
        handle.persist_cpu_s = time.thread_time() - c0
        handle.bytes = meta.size
        self._last_durable = step
        if not self.is_committer:
            self._progress_at = time.monotonic()
        logger.debug(
            "checkpoint part %s step %d durable (%d bytes, %.3fs)", self.part_name, step, meta.size, handle.persist_s
        )
        if not self.is_committer:
            self._finish(handle)
            return
        pending = _Pending(
            step=step, metadata=job.metadata, handle=handle, deadline=job.deadline, durable_at=time.perf_counter()
        )
        pending.found[self.part_name] = meta
        with self._cond:
            self._pending[step] = pending

    def _refused(self, job: _Job, exc: StorageError) -> None:
        """Storage refuses this part for good (full, read-only, over a file-size limit, forbidden): give the step
        up now, without retrying, and remove what was written of it (the part here; the whole step directory on
        the committer), so that a resumed run finds no half-written step."""
        step = job.step
        self.refused = CheckpointError(f"step {step}: part {self.part_name!r} not written, storage refuses it: "
                                       f"{exc}")
        self._write_trouble.fail("step %d: storage refuses the write, giving up the step without retrying (%s): %s",
                                 step, self._since_progress(), exc)
        for path in ((step_dir(step),) if self.is_committer else
                     (part_meta_path(step, self.part_name), part_data_path(step, self.part_name))):
            try:
                if not self.storage.exists(commit_path(step)):
                    self.storage.delete(path, recursive=path == step_dir(step))
            except Exception as cleanup:  # a read-only file system refuses that too: nothing half-written, then
                logger.debug("checkpoint step %d: cannot remove %s: %s", step, path, cleanup)
        self._finish(job.handle, self.refused)

    def _part_complete(self, meta: PartMeta) -> bool:
        """Whether the part file described by ``meta`` is there with the recorded size."""
        return self.storage.size(part_data_path(meta.step, meta.name)) == meta.size

    def _poll_commits(self) -> None:
        """One polling round over the pending steps, oldest first; commit the first complete one. Committing in
        order keeps every checkpoint that became complete (a fallback if a newer one turns out damaged); a step
        still incomplete when a newer one commits is given up."""
        storage = self.storage
        for step in sorted(self._pending):
            p = self._pending[step]
            missing: list[str] = []
            try:
                for name in self.expected_parts:
                    if name in p.found:
                        continue
                    try:
                        got = PartMeta.from_json(storage.read_bytes(part_meta_path(step, name)))
                    except (FileNotFoundError, CorruptCheckpointError):
                        continue
                    if got.name == name and got.step == step:
                        p.found[name] = got
                missing = [n for n in self.expected_parts if n not in p.found]
                if not missing:
                    vanished = [n for n in self.expected_parts if not self._part_complete(p.found[n])]
                    for n in vanished:  # deleted or truncated between its write and now: never commit it
                        del p.found[n]
                    missing = vanished
                if not missing and self.stopped is None and self.before_commit is not None:
                    try:
                        self.before_commit(step)
                    except Exception as exc:
                        self.stopped = exc
                        logger.error("checkpoint step %d: not committed, and no later step will be: %s", step, exc)
                if self.stopped is not None:
                    with self._cond:
                        stopped = [self._pending.pop(s) for s in list(self._pending)]
                    for q in stopped:
                        self._finish(q.handle, CheckpointError(f"step {q.step} not committed: {self.stopped}"))
                    return
                if not missing:
                    record = CommitRecord(
                        step=step,
                        parts={n: p.found[n] for n in self.expected_parts},
                        wall_time=time.time(),
                        metadata=p.metadata,
                    )
                    storage.write_bytes(commit_path(step), record.to_json())
                    self._committed(p)
                    return
            except Exception as exc:
                reason = exc if isinstance(exc, CheckpointError) else storage.describe_error(exc)
                self._commit_trouble.fail("step %d: cannot check or commit (%s; %s); will retry",
                                          step, reason, self._since_progress())
                missing = [n for n in self.expected_parts if n not in p.found]
            if time.monotonic() >= p.deadline:
                self._commit_trouble.fail(
                    "step %d: not committed, giving up after %.1fs, parts missing or incomplete: %s (%s)",
                    step, self.commit_timeout_s, ", ".join(missing), self._since_progress(),
                )
                with self._cond:
                    self._pending.pop(step, None)
                self._remove_uncommitted(step)
                self._finish(p.handle, CheckpointError(f"step {step} not committed: parts missing: {missing}"))
        self._poll_delay = min(self._poll_delay * 2, self.max_poll_interval_s)

    def _committed(self, p: _Pending) -> None:
        step = p.step
        p.handle.commit_s = time.perf_counter() - p.durable_at
        p.handle.committed = True
        self._last_committed = step
        self._progress_at = time.monotonic()
        self._commit_trouble.ok(f"step {step} committed")
        logger.info("checkpoint step %d committed (%d parts)", step, len(self.expected_parts))
        with self._cond:
            older = [s for s in self._pending if s <= step]
            superseded = [self._pending.pop(s) for s in older]
        for q in superseded:
            if q is not p:
                logger.warning("checkpoint step %d: not committed, superseded by step %d", q.step, step)
                self._finish(q.handle, CheckpointError(f"step {q.step} not committed: superseded by step {step}"))
        try:
            self._collect_garbage(step)
        except Exception as exc:
            logger.warning("checkpoint garbage collection failed: %s", self.storage.describe_error(exc))
        if self.on_commit is not None:
            try:
                self.on_commit(step)
            except Exception:
                logger.exception("checkpoint on_commit callback failed for step %d", step)
        self._finish(p.handle)

    def _collect_garbage(self, newest_commit: int) -> None:
        storage = self.storage
        steps = sorted(s for s in (parse_step_dir(n) for n in storage.list("")) if s is not None)
        committed = [s for s in steps if s <= newest_commit and storage.exists(commit_path(s))]
        doomed_committed = committed[: max(0, len(committed) - self.keep)]
        committed_set = set(committed)
        for s in doomed_committed:
            # Remove the commit record first: a crash midway leaves an uncommitted directory, never a torn commit.
            storage.delete(commit_path(s))
            storage.delete(step_dir(s), recursive=True)
            logger.debug("checkpoint step %d removed (keep=%d)", s, self.keep)
        with self._cond:
            pending = set(self._pending)
        for s in steps:
            if s < newest_commit and s not in committed_set and s not in pending:
                storage.delete(step_dir(s), recursive=True)
                logger.debug("uncommitted checkpoint step %d removed", s)
