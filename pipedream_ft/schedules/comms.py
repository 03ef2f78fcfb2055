"""The pass that adds sends and receives to a compute-only schedule.

After ``F`` of stage ``s`` its rank sends the activation (``sSEND_Fm``) and the rank of stage ``s + 1``
receives it (``s+1RECV_Fm``); after ``B``/``I`` of stage ``s`` the gradient goes to stage ``s - 1``
(``sSEND_Bm``, ``s-1RECV_Bm``). Nothing is sent between stages on the same rank. Ranks are walked in turns,
one action each, and a receive is placed on the receiving rank when its send is placed, so every receive is
posted in the order its sends happen: no rank waits on a message that is sent after one it needs later.
This is ``torch.distributed.pipelining``'s lowering (``_add_send_recv``), and gives the same lists.

A plan with replicated stages (PipeDream's data-parallel stages) places a *minibatch* rather than a stage:
:class:`~pipedream_ft.schedules.placement.Replicated` runs minibatch ``m`` of stage ``s`` on one of the stage's
ranks, and a message goes to the replica of the neighbouring stage that runs ``m``.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator, Sequence

from .actions import BACKWARD, COMMUNICATION, Action, Kind, Schedule
from .errors import ScheduleError
from .placement import PlacementLike, Replicated, as_replicated, stage_to_rank

__all__ = ["add_communication", "iter_lower_rank", "lower_rank", "messages_of", "post_receives_early"]


def messages_of(action: Action, placement: PlacementLike) -> tuple[Action, Action] | None:
    """The (send, receive) that ``action``'s output needs, or None if its consumer is on the same rank."""
    where = as_replicated(placement)
    return _messages(action, where)


def _messages(action: Action, where: Replicated) -> tuple[Action, Action] | None:
    s, m = action.stage, action.index
    if action.kind is Kind.F and s + 1 < where.num_stages and where.rank(s + 1, m) != where.rank(s, m):
        return Action.trusted(s, Kind.SEND_F, m), Action.trusted(s + 1, Kind.RECV_F, m)
    if action.kind in BACKWARD and s > 0 and where.rank(s - 1, m) != where.rank(s, m):
        return Action.trusted(s, Kind.SEND_B, m), Action.trusted(s - 1, Kind.RECV_B, m)
    return None


def add_communication(schedule: Schedule, placement: PlacementLike | None = None) -> dict[int, list[Action]]:
    """``schedule`` (compute and update actions; idle slots are dropped) with its sends and receives added.

    ``placement`` maps stage -> rank (default: read from the schedule), or is a
    :class:`~pipedream_ft.schedules.placement.Replicated` placement of replicated stages. Raises
    :class:`ScheduleError` naming the blocked actions if the compute order cannot run (a rank needs an input
    that no order of the others produces first), if an action is on a rank that does not run it, or if the
    schedule already has communication.
    """
    where = as_replicated(placement if placement is not None else stage_to_rank(schedule))
    queues = {r: deque(a for a in acts if a is not None) for r, acts in sorted(schedule.items())}
    for rank, queue in queues.items():
        for a in queue:
            if a.kind in COMMUNICATION:
                raise ScheduleError(f"rank {rank}'s schedule already has communication ({a})")
            where.check(a, rank)
    out: dict[int, list[Action]] = {r: [] for r in queues}
    have: dict[int, set[tuple[int, Kind, int]]] = {r: set() for r in queues}
    """What each rank has placed so far, as ``(stage, kind, index)`` (cheaper to hash than actions)."""
    last = where.num_stages - 1

    def needs(a: Action) -> tuple[tuple[int, Kind, int], ...]:
        """Any one of these, already on the rank, lets ``a`` run (its input, local or received)."""
        s, m = a.stage, a.index
        if a.kind is Kind.F and s > 0:
            return (s, Kind.RECV_F, m), (s - 1, Kind.F, m)
        if a.kind in BACKWARD and s < last:
            return (s, Kind.RECV_B, m), (s + 1, Kind.I, m), (s + 1, Kind.B, m)
        return ()

    while any(queues.values()):
        progress = False
        for rank, queue in queues.items():
            if not queue:
                continue
            a = queue[0]
            mine = have[rank]
            wanted = needs(a)
            if wanted and not any(w in mine for w in wanted):
                continue
            queue.popleft()
            out[rank].append(a)
            mine.add((a.stage, a.kind, a.index))
            progress = True
            message = _messages(a, where) if a.kind is not Kind.U else None
            if message is not None:
                send, recv = message
                out[rank].append(send)
                mine.add((send.stage, send.kind, send.index))
                target = where.rank(recv.stage, recv.index)
                out[target].append(recv)
                have[target].add((recv.stage, recv.kind, recv.index))
        if not progress:
            stuck = "; ".join(f"rank {r} at {q[0]} waits for "
                              f"{' or '.join(str(Action(*w)) for w in needs(q[0])[1:])}"
                              for r, q in queues.items() if q)
            raise ScheduleError(f"cannot place the messages, the schedule deadlocks: {stuck}")
    return out


def post_receives_early(schedule: Schedule) -> dict[int, list[Action]]:
    """``schedule`` (lowered by :func:`add_communication`) with each receive moved as early as it is useful, so that
    a message never waits for its receive to be posted (gloo, for one, sends only once the receiver is ready):

    * ``RECV_B m`` right after ``SEND_F m`` on the same rank — the gradient's shape is that of the activation just
      sent — when the stage runs its backwards in the order of its forwards (so a link's receives stay in the
      order of its sends);
    * ``RECV_F`` of a stage's forward right before the stage's previous forward on the rank — two forwards' inputs
      on their way while one computes.

    Receives keep their order among themselves per stage and kind; every other action keeps its place.
    """
    out: dict[int, list[Action]] = {}
    for rank, acts in sorted(schedule.items()):
        lst = [a for a in acts if a is not None]
        # what the list holds, as (stage, index) per kind: plain tuples hash far faster than actions
        recv_f: set[tuple[int, int]] = set()
        recv_b: set[tuple[int, int]] = set()
        send_f: set[tuple[int, int]] = set()
        forwards: dict[int, list[int]] = {}
        backwards: dict[int, list[int]] = {}
        for a in lst:
            kind = a.kind
            if kind is Kind.F:
                forwards.setdefault(a.stage, []).append(a.index)
            elif kind in BACKWARD:
                backwards.setdefault(a.stage, []).append(a.index)
            elif kind is Kind.RECV_F:
                recv_f.add((a.stage, a.index))
            elif kind is Kind.RECV_B:
                recv_b.add((a.stage, a.index))
            elif kind is Kind.SEND_F:
                send_f.add((a.stage, a.index))
        in_order = {s for s, f in forwards.items() if backwards.get(s, f) == f}
        following = {(s, f[k]): f[k + 1] for s, f in forwards.items() for k in range(len(f) - 1)}
        first = {(s, f[0]) for s, f in forwards.items() if f}
        lowered: list[Action] = []
        for a in lst:
            kind = a.kind
            if kind is Kind.RECV_F:
                continue  # placed with the forwards below
            if kind is Kind.RECV_B and a.stage in in_order and (a.stage, a.index) in send_f:
                continue  # placed after its activation's send below
            if kind is Kind.F:
                key = (a.stage, a.index)
                if key in first and key in recv_f:
                    lowered.append(Action.trusted(a.stage, Kind.RECV_F, a.index))
                after = following.get(key)
                if after is not None and (a.stage, after) in recv_f:
                    lowered.append(Action.trusted(a.stage, Kind.RECV_F, after))
            lowered.append(a)
            if kind is Kind.SEND_F and a.stage in in_order and (a.stage, a.index) in recv_b:
                lowered.append(Action.trusted(a.stage, Kind.RECV_B, a.index))
        if len(lowered) != len(lst):
            raise ScheduleError(f"rank {rank}: moving the receives early lost actions ({len(lst)} -> {len(lowered)})")
        out[rank] = lowered
    return out


def lower_rank(rank: int, actions: Sequence[Action | None], placement: PlacementLike) -> list[Action] | None:
    """``rank``'s list of :func:`add_communication` then :func:`post_receives_early`, made from ``rank``'s own
    ``actions`` alone — or ``None`` where that list depends on the other ranks' order.

    Every send follows the action that produces it, and :func:`post_receives_early` moves every ``RECV_F`` to a
    place that ``rank``'s own forwards decide, and every ``RECV_B`` too when each stage of ``rank`` that receives
    gradients runs its backwards in the order of its forwards: then nothing of the other ranks' lists is needed,
    and lowering a run costs each process its own actions instead of every rank's (the pure tests check that the
    lists are the same). Otherwise (a stage's ``RECV_B`` stays where its send placed it) this returns ``None``.
    The schedule's deadlock check is not repeated here: the modes' generators and every table (at load) are
    checked whole. See ``benchmarks/bench_lowering.py`` for what it costs."""
    where = as_replicated(placement)
    own = [a for a in actions if a is not None]
    after_send = _receives_after_sends(rank, own, where)
    if after_send is None:
        return None
    return list(_lowered(rank, iter(own), where, after_send, checked=True))


def iter_lower_rank(rank: int, actions: Iterable[Action | None], placement: PlacementLike,
                    sample: Sequence[Action | None]) -> Iterator[Action] | None:
    """:func:`lower_rank` of ``actions`` made as they are read, so that a long run's list is never held whole —
    or ``None`` where it depends on the other ranks' order. Whether each stage of ``rank`` runs its backwards in
    the order of its forwards is read from ``sample``: the same schedule over a few windows (at least one whole
    period of its replicas). The run is checked against it as it goes: a stage that leaves that order where it
    matters raises :class:`ScheduleError` instead of running a list other than :func:`lower_rank`'s."""
    where = as_replicated(placement)
    after_send = _receives_after_sends(rank, [a for a in sample if a is not None], where)
    if after_send is None:
        return None
    return _lowered(rank, (a for a in actions if a is not None), where, after_send, checked=False)


def _receives_after_sends(rank: int, own: Sequence[Action], where: Replicated) -> set[int] | None:
    """The stages of ``rank`` whose gradient receives follow their activations' sends
    (:func:`post_receives_early`: a stage that runs its backwards in its forwards' order), or ``None`` if a stage
    that receives gradients does not run them in that order (its receives then depend on the other ranks')."""
    ranks = where.ranks
    last = len(ranks) - 1
    F, B, I = Kind.F, Kind.B, Kind.I  # locals: an enum member read off its class is slow
    forwards: dict[int, list[int]] = {}
    backwards: dict[int, list[int]] = {}
    receiving: set[int] = set()
    for a in own:
        kind, s, m = a.kind, a.stage, a.index
        if kind is F:
            forwards.setdefault(s, []).append(m)
        elif (kind is B or kind is I) and 0 <= s <= last:
            backwards.setdefault(s, []).append(m)
            if s < last:
                held = ranks[s + 1]
                if held[m % len(held)] != rank:
                    receiving.add(s)
    in_order = {s for s, f in forwards.items() if backwards.get(s, f) == f}
    if any(s not in in_order for s in receiving if s in forwards):
        return None
    return {s for s in in_order if s in backwards}


def _lowered(rank: int, actions: Iterator[Action], where: Replicated, after_send: set[int], *,
             checked: bool) -> Iterator[Action]:
    """``actions`` (compute and updates, no idle slot) with their sends and receives, receives moved early
    (:func:`post_receives_early`), each action checked to run on ``rank`` as it is read. ``after_send``: see
    :func:`_receives_after_sends`; unless ``checked`` (it was read from these very actions), the order it stands
    for is checked as the actions go by. Looks ahead in ``actions`` only as far as each stage's next forward."""
    ranks = where.ranks
    last = len(ranks) - 1
    F, U, B, I = Kind.F, Kind.U, Kind.B, Kind.I  # locals: an enum member read off its class is slow
    RECV_F, SEND_F, RECV_B, SEND_B = Kind.RECV_F, Kind.SEND_F, Kind.RECV_B, Kind.SEND_B
    made = Action.trusted
    ahead: deque[Action] = deque()
    """Actions read from ``actions`` but not placed yet (to find a stage's next forward)."""
    upcoming: dict[int, deque[int]] = {}
    """Per stage, the minibatches of its forwards in ``ahead`` and the one being placed, in order."""
    started: set[int] = set()
    """Stages whose first forward is placed."""
    open_: dict[int, deque[int]] = {} if checked else {s: deque() for s in after_send if s < last}
    """Per stage of ``after_send`` that may receive a gradient, its placed forwards whose backward has not come yet
    (to check the order the lowering read from a sample)."""

    def read() -> bool:
        a = next(actions, None)
        if a is None:
            return False
        kind, s, m = a.kind, a.stage, a.index
        if kind in COMMUNICATION:
            raise ScheduleError(f"rank {rank}'s schedule already has communication ({a})")
        if kind is U or s > last:
            where.check(a, rank)  # raises unless an update of a stage the rank holds
        else:
            held = ranks[s]
            if held[m % len(held)] != rank:
                where.check(a, rank)  # raises
        ahead.append(a)
        if kind is F:
            q = upcoming.get(s)
            if q is None:
                q = upcoming[s] = deque()
            q.append(m)
        return True

    while ahead or read():
        a = ahead.popleft()
        kind, s, m = a.kind, a.stage, a.index
        if kind is F:
            q = upcoming[s]
            q.popleft()  # this forward
            if s > 0:
                prev = ranks[s - 1]
                if s not in started:
                    started.add(s)
                    if prev[m % len(prev)] != rank:
                        yield made(s, RECV_F, m)
                while not q and read():
                    pass
                if q and prev[q[0] % len(prev)] != rank:
                    yield made(s, RECV_F, q[0])  # the next forward's input, on its way while this one runs
            else:
                started.add(s)
            yield a
            if s in open_:
                open_[s].append(m)
            if s < last:
                held = ranks[s + 1]
                if held[m % len(held)] != rank:
                    yield made(s, SEND_F, m)
                    if s in after_send:
                        yield made(s, RECV_B, m)
        elif kind is B or kind is I:
            if s < last:
                held = ranks[s + 1]
                needs = held[m % len(held)] != rank
                if not checked:
                    _check_order(rank, s, m, open_, started, needs)
                if needs and s not in after_send:
                    yield made(s, RECV_B, m)
            yield a
            if s > 0:
                prev = ranks[s - 1]
                if prev[m % len(prev)] != rank:
                    yield made(s, SEND_B, m)
        else:
            yield a
    if not checked and any(open_.values()):
        left = {s: list(q) for s, q in open_.items() if q}
        raise ScheduleError(f"rank {rank}: forwards without their backward {left}: the run's list is not the "
                            "schedule it was lowered as")


def _check_order(rank: int, s: int, m: int, open_: dict[int, deque[int]], started: set[int], needs: bool) -> None:
    """A backward of minibatch ``m`` on stage ``s`` as the lowering read the schedule's order (see
    :func:`iter_lower_rank`)."""
    q = open_.get(s)
    if q is not None:
        if not q or q.popleft() != m:
            raise ScheduleError(f"rank {rank}: stage {s}'s backward of minibatch {m} leaves its forwards' order, "
                                "which the lowering read from a sample of the schedule")
    elif needs and s in started:
        raise ScheduleError(f"rank {rank}: stage {s} receives the gradient of minibatch {m}, which the lowering "
                            "read from a sample of the schedule as never happening")
