"""The pass that adds the optimizer update of each stage to a synchronous schedule."""

from __future__ import annotations

from .actions import Action, Kind, Schedule
from .errors import ScheduleError

__all__ = ["add_updates"]


def add_updates(schedule: Schedule, update: int = 0) -> dict[int, list[Action]]:
    """``schedule`` with ``U`` number ``update`` of each stage right after the stage's last backward (``B`` or
    ``W``) on its rank: one update per step, on the step's summed gradients. Idle slots are dropped; stages
    with no backward (a forward-only schedule) get no update."""
    out: dict[int, list[Action]] = {}
    for rank, acts in sorted(schedule.items()):
        actions = [a for a in acts if a is not None]
        last: dict[int, int] = {}
        for i, a in enumerate(actions):
            if a.kind == Kind.U:
                raise ScheduleError(f"rank {rank}'s schedule already has updates ({a})")
            if a.kind in (Kind.B, Kind.W):
                last[a.stage] = i
        after = {i: s for s, i in last.items()}
        out[rank] = []
        for i, a in enumerate(actions):
            out[rank].append(a)
            if i in after:
                out[rank].append(Action(after[i], Kind.U, update))
    return out
