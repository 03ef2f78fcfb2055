"""Removing checkpoints from durable storage: old commits (``keep``), steps given up, a rolled-back history.

The committer's garbage collection (:func:`collect_garbage`), what it removes when a step is given up
(:func:`remove_uncommitted`) and when the training state is rolled back past committed steps
(:func:`retire_after`). Commit records are always removed before their directories, newest first when several
go: a reader never sees a torn commit, nor two histories mixed.
"""

from __future__ import annotations

import logging
from typing import Collection

from .format import commit_path, parse_step_dir, step_dir
from .storage import Storage

__all__ = ["collect_garbage", "remove_uncommitted", "retire_after"]

logger = logging.getLogger("pipedream_ft.checkpoint.writer")


def _steps(storage: Storage) -> list[int]:
    return sorted(s for s in (parse_step_dir(n) for n in storage.list("")) if s is not None)


def collect_garbage(storage: Storage, newest_commit: int, keep: int, pending: Collection[int] = ()) -> None:
    """Keep the newest ``keep`` committed checkpoints up to ``newest_commit``, and remove the uncommitted step
    directories older than it (but those in ``pending``: steps still waiting for their parts)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    steps = _steps(storage)
    committed = [s for s in steps if s <= newest_commit and storage.exists(commit_path(s))]
    doomed_committed = committed[: max(0, len(committed) - keep)]
    committed_set = set(committed)
    for s in doomed_committed:
        # Remove the commit record first: a crash midway leaves an uncommitted directory, never a torn commit.
        storage.delete(commit_path(s))
        storage.delete(step_dir(s), recursive=True)
        logger.debug("checkpoint step %d removed (keep=%d)", s, keep)
    for s in steps:
        if s < newest_commit and s not in committed_set and s not in pending:
            storage.delete(step_dir(s), recursive=True)
            logger.debug("uncommitted checkpoint step %d removed", s)


def remove_uncommitted(storage: Storage, step: int) -> None:
    """Remove the directory of a step given up, unless it is committed (a resumed run must not find it
    half-written). Failures are logged at DEBUG (a read-only storage refuses that too)."""
    try:
        if not storage.exists(commit_path(step)):
            storage.delete(step_dir(step), recursive=True)
    except Exception as exc:
        logger.debug("checkpoint step %d: cannot remove its directory: %s", step, exc)


def retire_after(storage: Storage, step: int) -> list[int]:
    """Retire every step after ``step`` (a history rolled back to ``step``): commit records first, newest first
    (what is left committed is always a prefix of the old history), then the directories. Returns the steps that
    were committed."""
    later = [s for s in reversed(_steps(storage)) if s > step]
    retired = [s for s in later if storage.exists(commit_path(s))]
    for s in retired:
        storage.delete(commit_path(s))
    for s in later:
        storage.delete(step_dir(s), recursive=True)
    if retired:
        logger.warning("checkpoint steps %s retired: committed by a history that was rolled back to step %d "
                       "(they are written anew as training reaches them again)",
                       ", ".join(map(str, sorted(retired))), step)
    return sorted(retired)
