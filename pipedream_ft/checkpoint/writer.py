"""Asynchronous checkpoint writer: snapshot now, persist in a background thread, commit when all parts are durable.

Every rank owns one :class:`CheckpointWriter` writing its *part* of each checkpoint. :meth:`CheckpointWriter.save`
copies the state to CPU immediately (the only time training waits) and queues it; one background thread per
writer serializes and persists the queued snapshots in order:

1. delete a stale part meta left by an earlier run, if any;
2. write ``part-{name}.pt`` atomically, then ``part-{name}.json`` (name, step, sha256, size) atomically.

On the committer (one writer among all ranks, ``is_committer=True``) the thread then polls storage until the meta
of every part in ``expected_parts`` exists for that step, and writes ``COMMIT.json`` (last, atomically) with every
part's checksum, then garbage-collects: keeps the newest ``keep`` committed checkpoints and removes uncommitted
step directories older than the newest commit.

Failures never block training: a part that cannot be written is retried (with backoff) until the step's deadline
(``commit_timeout_s`` after ``save``) or until a newer save is queued; a step whose parts do not all appear before
the deadline is given up (warning, no commit). A commit record is never written unless every part's meta, which
is written only after the part itself is durable, was read back.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

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
    serialize_state,
    sha256_hex,
    snapshot_state,
    step_dir,
    validate_part_name,
    validate_step,
)
from .storage import Storage

__all__ = ["CheckpointWriter", "SaveHandle"]

logger = logging.getLogger(__name__)


class SaveHandle:
    """Progress of one :meth:`CheckpointWriter.save`.

    The handle is *done* when this writer has finished with the step: its part is durable (or was given up),
    and on the committer the commit record is written (or the commit was given up).
    """

    __slots__ = ("step", "snapshot_s", "persist_s", "commit_s", "error", "committed", "finished_at", "_event")

    def __init__(self, step: int, snapshot_s: float) -> None:
        self.step: int = step
        """Update number of the checkpoint."""
        self.snapshot_s: float = snapshot_s
        """Seconds spent copying the state (the time training waited)."""
        self.persist_s: float | None = None
        """Seconds spent serializing and writing this writer's part (``None`` until done)."""
        self.commit_s: float | None = None
        """Committer only: seconds from the part being durable to the commit record being written."""
        self.error: BaseException | None = None
        """Why the part was not persisted or the step not committed; ``None`` on success."""
        self.committed: bool | None = None
        """Committer only: whether the step is committed; ``None`` on other writers."""
        self.finished_at: float | None = None
        """Wall-clock time (``time.time()``) the handle became done."""
        self._event = threading.Event()

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
    state: Any
    metadata: dict[str, Any]
    handle: SaveHandle
    deadline: float


@dataclass(slots=True)
class _Pending:
    step: int
    metadata: dict[str, Any]
    handle: SaveHandle
    deadline: float
    durable_at: float
    found: dict[str, PartMeta] = field(default_factory=dict)


class _Superseded(Exception):
    pass


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
        poll_interval_s: first delay between polls for missing parts (doubled up to ``max_poll_interval_s``).
        max_poll_interval_s: longest delay between polls and between retries of a failed write.
        max_queued: saves waiting to be persisted beyond this many are dropped, oldest first, so that
            memory stays bounded and training never blocks when storage is slow.
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
        poll_interval_s: float = 0.05,
        max_poll_interval_s: float = 2.0,
        max_queued: int = 2,
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

        self.storage = storage
        self.part_name = part_name
        self.expected_parts: tuple[str, ...] = tuple(expected)
        self.is_committer = bool(is_committer)
        self.keep = keep
        self.commit_timeout_s = float(commit_timeout_s)
        self.metadata = normalize_metadata(metadata)
        self.on_commit = on_commit
        self.poll_interval_s = float(poll_interval_s)
        self.max_poll_interval_s = float(max_poll_interval_s)
        self.max_queued = max_queued

        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._pending: dict[int, _Pending] = {}
        self._outstanding = 0
        self._last_step: int | None = None
        self._closing = False
        self._closed = False
        self._poll_delay = self.poll_interval_s
        self._thread = threading.Thread(
            target=self._run, name=f"checkpoint-writer-{part_name}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------------------ public API

    def save(self, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None = None) -> SaveHandle:
        """Snapshot ``state`` now and persist it in the background; return immediately after the snapshot.

        ``state`` is a dict of tensors and plain Python values (nested lists/tuples/dicts allowed). Tensors are
        copied to CPU before this returns, so the caller may modify them right away. Steps must increase.
        """
        validate_step(step)
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        meta = dict(self.metadata)
        meta.update(normalize_metadata(metadata))
        with self._cond:
            if self._closing:
                raise CheckpointError(f"checkpoint writer {self.part_name!r} is closed")
            if self._last_step is not None and step <= self._last_step:
                raise ValueError(f"step must increase: got {step} after {self._last_step}")
        t0 = time.perf_counter()
        snap = snapshot_state(dict(state))
        handle = SaveHandle(step, time.perf_counter() - t0)
        deadline = time.monotonic() + self.commit_timeout_s
        job = _Job(step=step, state=snap, metadata=meta, handle=handle, deadline=deadline)
        dropped: list[_Job] = []
        with self._cond:
            if self._closing:
                raise CheckpointError(f"checkpoint writer {self.part_name!r} is closed")
            if self._last_step is not None and step <= self._last_step:
                raise ValueError(f"step must increase: got {step} after {self._last_step}")
            self._last_step = step
            self._queue.append(job)
            self._outstanding += 1
            while len(self._queue) > self.max_queued:
                dropped.append(self._queue.popleft())
            self._cond.notify_all()
        for old in dropped:
            logger.warning(
                "checkpoint part %s: dropping queued step %d, superseded by step %d (storage too slow)",
                self.part_name,
                old.step,
                step,
            )
            self._finish(old.handle, CheckpointError(f"step {old.step} dropped: superseded by step {step}"))
        return handle

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
            leftovers = list(self._queue) + [p for p in self._pending.values()]
            self._queue.clear()
            self._pending.clear()
        for item in leftovers:
            self._finish(item.handle, CheckpointError(f"step {item.step} abandoned: writer closed"))
        self._closed = True
        return flushed

    @property
    def pending_steps(self) -> list[int]:
        """Steps queued, being written, or (committer) waiting for parts."""
        with self._cond:
            return sorted({j.step for j in self._queue} | set(self._pending))

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ background

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
        while True:
            with self._cond:
                if not self._queue and not self._closing:
                    self._cond.wait(self._poll_delay if self._pending else None)
                if self._closing:
                    return
                job = self._queue.popleft() if self._queue else None
            try:
                if job is not None:
                    self._persist(job)
                    self._poll_delay = self.poll_interval_s
                if self._pending:
                    self._poll_commits()
            except Exception:  # never let the thread die; the handles carry the errors
                logger.exception("checkpoint part %s: unexpected error in the writer thread", self.part_name)

    def _wait_or_superseded(self, delay: float, deadline: float) -> bool:
        """Sleep ``delay`` (capped at the deadline); return True if a newer save arrived or the writer closes."""
        with self._cond:
            if self._queue or self._closing:
                return True
            self._cond.wait(max(0.0, min(delay, deadline - time.monotonic())))
            return bool(self._queue) or self._closing

    def _persist(self, job: _Job) -> None:
        step, handle, storage = job.step, job.handle, self.storage
        t0 = time.perf_counter()
        try:
            data = serialize_state(job.state)
        except Exception as exc:
            logger.warning("checkpoint part %s step %d: cannot serialize: %s", self.part_name, step, exc)
            self._finish(handle, CheckpointError(f"step {step}: cannot serialize part: {exc}"))
            return
        finally:
            job.state = None
        meta = PartMeta(name=self.part_name, step=step, sha256=sha256_hex(data), size=len(data))
        delay = self.poll_interval_s
        while True:
            try:
                if storage.exists(commit_path(step)):
                    logger.info("checkpoint step %d is already committed; not rewriting part %s", step, self.part_name)
                    handle.persist_s = time.perf_counter() - t0
                    if self.is_committer:
                        handle.committed = True
                    self._finish(handle)
                    return
                storage.delete(part_meta_path(step, self.part_name))
                storage.write_bytes(part_data_path(step, self.part_name), data)
                storage.write_bytes(part_meta_path(step, self.part_name), meta.to_json())
                break
            except Exception as exc:
                now = time.monotonic()
                reason = exc if isinstance(exc, CheckpointError) else storage.describe_error(exc)
                if now >= job.deadline:
                    logger.warning(
                        "checkpoint part %s step %d: giving up after %.1fs: %s",
                        self.part_name, step, self.commit_timeout_s, reason,
                    )
                    self._finish(handle, CheckpointError(f"step {step}: part {self.part_name!r} not written: {reason}"))
                    return
                logger.warning(
                    "checkpoint part %s step %d: write failed (%s); retrying in %.2fs",
                    self.part_name, step, reason, delay,
                )
                if self._wait_or_superseded(delay, job.deadline):
                    logger.warning(
                        "checkpoint part %s step %d: giving up, a newer save is queued", self.part_name, step
                    )
                    self._finish(handle, CheckpointError(f"step {step}: part {self.part_name!r} not written: {reason}"))
                    return
                delay = min(delay * 2, self.max_poll_interval_s)
        handle.persist_s = time.perf_counter() - t0
        logger.debug(
            "checkpoint part %s step %d durable (%d bytes, %.3fs)", self.part_name, step, len(data), handle.persist_s
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

    def _poll_commits(self) -> None:
        """One polling round over the pending steps, newest first; commit the first complete one."""
        storage = self.storage
        for step in sorted(self._pending, reverse=True):
            p = self._pending[step]
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
                logger.warning("checkpoint step %d: cannot check or commit (%s); will retry", step, reason)
                missing = [n for n in self.expected_parts if n not in p.found]
            if time.monotonic() >= p.deadline:
                logger.warning(
                    "checkpoint step %d: giving up the commit after %.1fs, parts missing: %s",
                    step, self.commit_timeout_s, ", ".join(missing),
                )
                with self._cond:
                    self._pending.pop(step, None)
                self._finish(p.handle, CheckpointError(f"step {step} not committed: parts missing: {missing}"))
        self._poll_delay = min(self._poll_delay * 2, self.max_poll_interval_s)

    def _committed(self, p: _Pending) -> None:
        step = p.step
        p.handle.commit_s = time.perf_counter() - p.durable_at
        p.handle.committed = True
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
