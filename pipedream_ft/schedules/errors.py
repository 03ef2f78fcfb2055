"""The error a schedule raises when it cannot run: a deadlock, an unmatched message, a missing dependency."""

from __future__ import annotations

__all__ = ["ScheduleError"]


class ScheduleError(ValueError):
    """A schedule is malformed or cannot run to completion; the message names the offending action."""
