"""Asynchronous checkpoint writer: snapshot now, persist in a low-priority thread, commit when all parts are durable.

A process owns one :class:`CheckpointWriter` per *part* of each checkpoint it writes (one per stage it holds).

**Save.** :meth:`CheckpointWriter.save` takes a snapshot (:mod:`.snapshot`) — the only time training waits:
tensors marked :func:`~.snapshot.immutable` are referenced, every other tensor is copied into reused buffers —
and queues it. A background thread persists each writer's queued snapshots in order: one
:class:`~.background.Background` serves every writer of the process (every part, and the memory tier's
:class:`~.tiers.TierWriter` too), so a process of several stages has no more threads than one of a single stage;
a writer given none has a thread of its own. The work is mostly GIL-free (``O_DIRECT`` writes straight from the
snapshot's memory, ``zlib.crc32``), and ``persist_nice`` can lower the thread's CPU priority:

1. delete a stale part meta left by an earlier run, if any;
2. write ``part-{name}.pt`` (:mod:`.tensorfile`: JSON header, then the tensors' bytes straight from memory, no
   serialization copy) atomically with a single fsync, then ``part-{name}.json`` (name, step, checksum, size).

On the committer (one writer among all ranks, ``is_committer=True``) the thread then polls storage until the meta
of every part in ``expected_parts`` exists for that step and the part file it describes has the recorded size,
and writes ``COMMIT.json`` (last, atomically, durably) with every part's checksum, then garbage-collects: keeps
the newest ``keep`` committed checkpoints and removes uncommitted step directories older than the newest commit
(:mod:`.commit`, :mod:`.collect`).

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

**Failures never block training.** A part that cannot be written is retried (with backoff; the thread serves the
other writers in between) until the step's
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
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .background import Background, Client, lower_thread_priority
from .checksum import DEFAULT_ALGORITHM, validate_algorithm
from .collect import retire_after
from .commit import Committing, Pending
from .format import (
    CheckpointError,
    PartMeta,
    commit_path,
    normalize_metadata,
    part_data_path,
    part_meta_path,
    step_dir,
    validate_part_name,
    validate_step,
)
from .handle import SaveHandle
from .snapshot import Snapshot, SnapshotPool
from .storage import Buffers, Storage, StorageError
from .trouble import Trouble

__all__ = ["CheckpointWriter", "SaveHandle", "lower_thread_priority"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    step: int
    snapshot: Snapshot
    metadata: dict[str, Any]
    handle: SaveHandle
    deadline: float
    generation: int = 0
    data: Buffers | None = None
    """The encoded part (``None`` until the first attempt)."""
    meta: PartMeta | None = None
    attempt_at: float = 0.0
    """When the next attempt is due (``time.monotonic()``), after a failed one."""
    delay: float = 0.0
    """The wait before the attempt after next (doubled after each failure)."""
    reason: Any = None
    """Why the last attempt failed."""
    t0: float = 0.0
    cpu_s: float = 0.0
    """CPU seconds the background thread spent on this job so far."""


class CheckpointWriter(Committing, Client):
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
            persist thread's CPU work is small anyway (O_DIRECT writes, crc32: ~0.3 s per GB). Only for a
            writer with a thread of its own (a shared ``background`` has its own ``nice``).
        background: the thread serving this writer, shared with the process's other writers (see
            :mod:`.background`; the caller closes it after the writers); ``None``: a thread of its own.
    """

    priority = 1  # after the fast tiers' writers

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
        background: Background | None = None,
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
        if background is not None and not isinstance(background, Background):
            raise TypeError(f"background must be a Background, got {type(background).__name__}")
        if background is not None and persist_nice is not None:
            raise ValueError(f"persist_nice={persist_nice!r} is for a writer's own thread; a shared background "
                             f"({background.name!r}) has its own nice ({background.nice!r})")

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
        self._own_background = background is None
        self._background = background if background is not None else \
            Background(f"checkpoint-writer-{part_name}", nice=persist_nice)
        self._cond = self._background.cond
        self._queue: collections.deque[_Job] = collections.deque()
        self._pending: dict[int, Pending] = {}
        self._outstanding = 0
        self._last_step: int | None = None
        self._last_committed: int | None = None
        self._last_durable: int | None = None
        self._started = time.monotonic()
        self._progress_at = self._started
        self._closing = False
        self._closed = False
        self._poll_delay = self.poll_interval_s
        self._next_poll = 0.0
        self._generation = 0
        self._current: _Job | None = None
        """The job taken off the queue and not finished: being written, or waiting to be tried again."""
        self._writing: int | None = None
        """The step of the job being written now (the thread is in storage)."""
        self.refused: CheckpointError | None = None
        """The last write that storage refused for good (full, read-only, over a size limit, forbidden), until a
        later part is written: see :attr:`StorageError.refused`."""
        self.stopped: BaseException | None = None
        """Why this writer commits nothing any more (``before_commit`` raised), or ``None``."""
        self._write_trouble = Trouble(f"checkpoint part {part_name}")
        self._commit_trouble = Trouble("checkpoint commit")
        self._background.attach(self)

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
        idle = self._background.detach(self, timeout=None if flushed else 5.0)
        if self._own_background:
            self._background.close(timeout=None if idle else 0.0)
        with self._cond:
            leftovers: list[Any] = list(self._queue) + list(self._pending.values())
            if self._current is not None and idle:  # (one still being written is left to its write)
                leftovers.append(self._current)
                self._current = None
            self._queue.clear()
            self._pending.clear()
        for item in leftovers:
            if isinstance(item, _Job):
                item.snapshot.release()
                item.data = None
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
            if self._current is not None and self._current.step > step and self._writing is None:
                dropped.append(self._current)  # waiting to be tried again: never will
                self._current = None
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
                item.data = None
            self._finish(item.handle, CheckpointError(f"step {item.step} abandoned: the state was rolled back "
                                                      f"to step {step}"))
        if not self.is_committer:
            return []
        return retire_after(self.storage, step)

    def flush_parts(self, timeout: float | None = None) -> bool:
        """Wait until no save is queued or being written (commits may still wait for other ranks' parts)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._current is not None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 0.5)
        return True

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

    # The background thread serves this writer one unit at a time (see :mod:`.background`): the first attempt
    # of the next queued save (encode it, write it), another attempt of a failed one once its delay passed (or
    # giving it up once a newer save is queued), or (committer) one polling round over the commits waiting for
    # parts. Nothing here sleeps: the thread serves the process's other writers meanwhile.

    def due(self, now: float) -> float | None:
        if self._closing:
            return None
        current = self._current
        if current is not None:
            if self._queue or current.generation != self._generation:
                return now  # superseded (a newer save, a roll-back): give it up now
            due = current.attempt_at
        else:
            due = now if self._queue else None
        if self._pending and (due is None or self._next_poll < due):
            due = self._next_poll
        return due

    def serve(self, now: float) -> None:
        with self._cond:
            job, taken = self._current, False
            if job is not None and job.attempt_at > now and not self._queue \
                    and job.generation == self._generation:
                job = None  # its next attempt is not due yet
            elif job is None and self._queue:
                job, taken = self._queue.popleft(), True
                self._cond.notify_all()  # a save waiting for queue space may go on
                if job.generation != self._generation:  # rolled back past it while it was queued
                    job.snapshot.release()
                    self._finish(job.handle, CheckpointError(f"step {job.step} abandoned: the state was rolled back"))
                    self._after_job()
                    return
                self._current = job
            if job is not None:
                self._writing = job.step
        if job is not None:
            try:
                self._write(job, taken)
            finally:
                with self._cond:
                    self._writing = None
                    self._cond.notify_all()
            return
        if self._pending and self._next_poll <= now:
            self._poll_commits()
            self._next_poll = time.monotonic() + self._poll_delay

    def _after_job(self) -> None:
        """A job is finished with (durable, failed or given up): poll for commits at once, then at the first
        interval again."""
        self._poll_delay = self.poll_interval_s
        self._next_poll = 0.0

    def _done(self, job: _Job, error: BaseException | None = None, *, finish: bool = True,
              pending: Pending | None = None) -> None:
        """This writer is finished with ``job``'s write: release its snapshot, then (``finish``) its handle."""
        with self._cond:
            if self._current is job:
                self._current = None
            if pending is not None:
                self._pending[job.step] = pending
            self._after_job()
        job.data = None
        job.snapshot.release()
        if finish:
            self._finish(job.handle, error)

    def _write(self, job: _Job, first: bool) -> None:
        """One attempt at ``job``'s part (the first: encode it first), or give it up if it was superseded."""
        step = job.step
        c0 = time.thread_time()
        if first:
            job.t0, job.delay = time.perf_counter(), self.poll_interval_s
            try:
                data, digest = job.snapshot.encoded(self.checksum)
                job.data, job.meta = data, PartMeta(name=self.part_name, step=step, checksum=digest, size=len(data))
            except Exception as exc:
                logger.warning("checkpoint part %s step %d: cannot serialize: %s", self.part_name, step, exc)
                self._done(job, CheckpointError(f"step {step}: cannot serialize part: {exc}"))
                return
        else:
            with self._cond:
                superseded = bool(self._queue) or self._closing or job.generation != self._generation
            if superseded:
                logger.debug("checkpoint part %s step %d: giving up, a newer save is queued", self.part_name, step)
                self._done(job, CheckpointError(f"step {step}: part {self.part_name!r} not written: {job.reason}"))
                return
        try:
            self._attempt(job, c0)
        finally:
            job.cpu_s += time.thread_time() - c0

    def _attempt(self, job: _Job, c0: float) -> None:
        step, handle, storage = job.step, job.handle, self.storage
        data, meta = job.data, job.meta
        assert data is not None and meta is not None
        try:
            if storage.exists(commit_path(step)):
                # Not after a roll-back (rewind() retired later commits): an earlier attempt of this same
                # history committed it; its parts are the ones the commit record describes, so leave them and
                # count the step as done (the durable position advances; later cuts are not deferred)
                logger.info("checkpoint step %d is already committed; not rewriting part %s", step, self.part_name)
                handle.persist_s = time.perf_counter() - job.t0
                handle.persist_cpu_s = job.cpu_s + time.thread_time() - c0
                self._last_durable = step
                if self.is_committer:
                    handle.committed = True
                    self._last_committed = step
                self._progress_at = time.monotonic()
                self._done(job)
                return
            storage.delete(part_meta_path(step, self.part_name))
            storage.write_bytes(part_data_path(step, self.part_name), data)
            storage.write_bytes_unsynced(part_meta_path(step, self.part_name), meta.to_json())
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
                self._done(job, CheckpointError(f"step {step}: part {self.part_name!r} not written: {reason}"))
                return
            self._write_trouble.fail(
                "step %d: write failed (%s), retrying until the step's deadline (%s)",
                step, reason, self._since_progress(),
            )
            with self._cond:  # tried again once the delay passed (capped at the deadline), unless superseded
                job.reason = reason
                job.attempt_at = now + max(0.0, min(job.delay, job.deadline - now))
                job.delay = min(job.delay * 2, self.max_poll_interval_s)
            return
        self._write_trouble.ok("writes succeed again")
        self.refused = None
        if job.generation != self._generation:  # rolled back while it was being written: never durable
            self._done(job, CheckpointError(f"step {step} abandoned: the state was rolled back"))
            return
        handle.persist_s = time.perf_counter() - job.t0
        handle.persist_cpu_s = job.cpu_s + time.thread_time() - c0
        handle.bytes = meta.size
        self._last_durable = step
        if not self.is_committer:
            self._progress_at = time.monotonic()
        logger.debug(
            "checkpoint part %s step %d durable (%d bytes, %.3fs)", self.part_name, step, meta.size, handle.persist_s
        )
        if not self.is_committer:
            self._done(job)
            return
        pending = Pending(
            step=step, metadata=job.metadata, handle=handle, deadline=job.deadline, durable_at=time.perf_counter()
        )
        pending.found[self.part_name] = meta
        self._done(job, finish=False, pending=pending)

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
        self._done(job, self.refused)
