"""What a checkpoint cut's flags say: the value stage 0's decision puts in a minibatch's activation header.

The executor carries the value without reading it — non-zero marks a cut after that minibatch, and it asks
:func:`stops` whether the job stops there — and every rank's checkpointer reads it back after its update for the
last minibatch before the cut (:meth:`~pipedream_ft.ft.checkpointer.Checkpointer.on_cut`).
"""

from __future__ import annotations

__all__ = ["CUT", "STOP", "DURABLE", "REPLAN", "stops", "describe"]

CUT = 2
"""A checkpoint cut follows this minibatch (the memory tier, at least)."""
STOP = 4
"""And the job stops after it (a preemption, or a re-planning cut)."""
DURABLE = 8
"""The cut's checkpoint goes to the durable tier too (not only the memory tier)."""
REPLAN = 16
"""The job stops at the cut to continue on a better plan (with ``STOP`` and ``DURABLE``)."""

_NAMES = ((CUT, "cut"), (STOP, "stop"), (DURABLE, "durable"), (REPLAN, "replan"))


def stops(flags: int) -> bool:
    """Whether the job stops at a cut with ``flags`` (no minibatch after it runs in this attempt)."""
    return bool(flags & STOP)


def describe(flags: int) -> str:
    """``"cut+durable"``-style names of ``flags`` (for logs)."""
    return "+".join(name for bit, name in _NAMES if flags & bit) or "none"
