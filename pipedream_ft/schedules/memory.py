"""How many minibatches' activations a schedule keeps at once, per stage.

A stage holds a minibatch's activations from its ``F`` until its backward is done: the end of ``B``, or of
``W`` when the backward is split (``W`` still reads the stored activations, so a zero-bubble schedule that
defers ``W`` holds them longer than 1F1B). The peak depends on each rank's order only, not on timing.
"""

from __future__ import annotations

from collections import defaultdict

from .actions import Kind, Schedule

__all__ = ["peak_in_flight"]


def peak_in_flight(schedule: Schedule) -> dict[int, int]:
    """stage -> the most minibatches whose activations the stage holds at one time."""
    held: dict[int, int] = defaultdict(int)
    peak: dict[int, int] = defaultdict(int)
    for actions in schedule.values():
        for a in actions:
            if a is None:
                continue
            if a.kind == Kind.F:
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind in (Kind.B, Kind.W):
                held[a.stage] -= 1
    return dict(sorted(peak.items()))
