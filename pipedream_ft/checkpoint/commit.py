"""The committer's side of the commit protocol.

On the committer (one :class:`~.writer.CheckpointWriter` among all ranks), a step whose own part is durable waits
(:class:`Pending`) until the meta of every expected part exists for that step and the part file it describes has
the recorded size; then ``before_commit`` (the job's owner check) runs, ``COMMIT.json`` is written (last,
atomically, durably) with every part's checksum, older pending steps are superseded, and old checkpoints are
collected (:mod:`.collect`). A step not complete by its deadline is given up and its directory removed.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .collect import collect_garbage, remove_uncommitted
from .format import (CheckpointError, CommitRecord, CorruptCheckpointError, PartMeta, commit_path, part_data_path,
                     part_meta_path)
from .handle import SaveHandle
from .storage import Storage
from .trouble import Trouble

__all__ = ["Committing", "Pending"]

logger = logging.getLogger("pipedream_ft.checkpoint.writer")


@dataclass(slots=True)
class Pending:
    """A step whose own part is durable, waiting for the other parts (committer only)."""

    step: int
    metadata: dict[str, Any]
    handle: SaveHandle
    deadline: float
    durable_at: float
    found: dict[str, PartMeta] = field(default_factory=dict)


class Committing(ABC):
    """The commit protocol, as a part of :class:`~.writer.CheckpointWriter` (which defines the attributes
    below and calls :meth:`_poll_commits` from its background unit of work)."""

    storage: Storage
    expected_parts: tuple[str, ...]
    keep: int
    commit_timeout_s: float
    max_poll_interval_s: float
    on_commit: Callable[[int], None] | None
    before_commit: Callable[[int], None] | None
    stopped: BaseException | None
    _cond: threading.Condition
    _pending: dict[int, Pending]
    _poll_delay: float
    _last_committed: int | None
    _progress_at: float
    _commit_trouble: Trouble

    @abstractmethod
    def _finish(self, handle: SaveHandle, error: BaseException | None = None) -> None:
        """Mark ``handle`` done (with ``error``, if it failed)."""

    @abstractmethod
    def _since_progress(self) -> str:
        """How long since the writer last made progress, as words for a message."""

    def give_up(self, reason: str) -> list[int]:
        """Committer: give up every commit waiting for parts now (a part is known never to come: its rank's
        storage refused it) and remove those steps' directories; returns their steps."""
        with self._cond:
            doomed = [self._pending.pop(s) for s in sorted(self._pending)]
        for p in doomed:
            remove_uncommitted(self.storage, p.step)
            self._finish(p.handle, CheckpointError(f"step {p.step} not committed: {reason}"))
        return [p.step for p in doomed]

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
                remove_uncommitted(self.storage, step)
                self._finish(p.handle, CheckpointError(f"step {step} not committed: parts missing: {missing}"))
        self._poll_delay = min(self._poll_delay * 2, self.max_poll_interval_s)

    def _committed(self, p: Pending) -> None:
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
            with self._cond:
                pending = set(self._pending)
            collect_garbage(self.storage, step, self.keep, pending)
        except Exception as exc:
            logger.warning("checkpoint garbage collection failed: %s", self.storage.describe_error(exc))
        if self.on_commit is not None:
            try:
                self.on_commit(step)
            except Exception:
                logger.exception("checkpoint on_commit callback failed for step %d", step)
        self._finish(p.handle)
