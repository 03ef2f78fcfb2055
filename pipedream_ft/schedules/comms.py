"""The pass that adds sends and receives to a compute-only schedule.

After ``F`` of stage ``s`` its rank sends the activation (``sSEND_Fm``) and the rank of stage ``s + 1``
receives it (``s+1RECV_Fm``); after ``B``/``I`` of stage ``s`` the gradient goes to stage ``s - 1``
(``sSEND_Bm``, ``s-1RECV_Bm``). Nothing is sent between stages on the same rank. Ranks are walked in turns,
one action each, and a receive is placed on the receiving rank when its send is placed, so every receive is
posted in the order its sends happen: no rank waits on a message that is sent after one it needs later.
This is ``torch.distributed.pipelining``'s lowering (``_add_send_recv``), and gives the same lists.
"""

from __future__ import annotations

from collections import deque
from typing import Mapping

from .actions import BACKWARD, COMMUNICATION, Action, Kind, Schedule
from .errors import ScheduleError
from .placement import stage_to_rank

__all__ = ["add_communication", "messages_of"]


def messages_of(action: Action, placement: Mapping[int, int]) -> tuple[Action, Action] | None:
    """The (send, receive) that ``action``'s output needs, or None if its consumer is on the same rank."""
    s, m = action.stage, action.index
    if action.kind == Kind.F and s + 1 in placement and placement[s + 1] != placement[s]:
        return Action(s, Kind.SEND_F, m), Action(s + 1, Kind.RECV_F, m)
    if action.kind in BACKWARD and s > 0 and placement[s - 1] != placement[s]:
        return Action(s, Kind.SEND_B, m), Action(s - 1, Kind.RECV_B, m)
    return None


def add_communication(schedule: Schedule, placement: Mapping[int, int] | None = None) -> dict[int, list[Action]]:
    """``schedule`` (compute and update actions; idle slots are dropped) with its sends and receives added.

    ``placement`` maps stage -> rank (default: read from the schedule). Raises :class:`ScheduleError`
    naming the blocked actions if the compute order cannot run (a rank needs an input that no order of the
    others produces first), or if the schedule already has communication.
    """
    if placement is None:
        placement = stage_to_rank(schedule)
    queues = {r: deque(a for a in acts if a is not None) for r, acts in sorted(schedule.items())}
    for rank, queue in queues.items():
        for a in queue:
            if a.kind in COMMUNICATION:
                raise ScheduleError(f"rank {rank}'s schedule already has communication ({a})")
            if placement.get(a.stage) != rank:
                raise ScheduleError(f"{a} is on rank {rank} but stage {a.stage} is placed on rank "
                                    f"{placement.get(a.stage)}")
    out: dict[int, list[Action]] = {r: [] for r in queues}
    have: dict[int, set[Action]] = {r: set() for r in queues}
    last = max(placement, default=0)

    def needs(a: Action) -> tuple[Action, ...]:
        """Any one of these, already on the rank, lets ``a`` run (its input, local or received)."""
        s, m = a.stage, a.index
        if a.kind == Kind.F and s > 0:
            return Action(s, Kind.RECV_F, m), Action(s - 1, Kind.F, m)
        if a.kind in BACKWARD and s < last:
            return Action(s, Kind.RECV_B, m), Action(s + 1, Kind.I, m), Action(s + 1, Kind.B, m)
        return ()

    while any(queues.values()):
        progress = False
        for rank, queue in queues.items():
            if not queue:
                continue
            a = queue[0]
            wanted = needs(a)
            if wanted and not any(w in have[rank] for w in wanted):
                continue
            queue.popleft()
            out[rank].append(a)
            have[rank].add(a)
            progress = True
            message = messages_of(a, placement)
            if message is not None:
                send, recv = message
                out[rank].append(send)
                have[rank].add(send)
                target = placement[recv.stage]
                out[target].append(recv)
                have[target].add(recv)
        if not progress:
            stuck = "; ".join(f"rank {r} at {q[0]} waits for {' or '.join(map(str, needs(q[0])[1:]))}"
                              for r, q in queues.items() if q)
            raise ScheduleError(f"cannot place the messages, the schedule deadlocks: {stuck}")
    return out
