"""Run a schedule on paper: check it, and predict each rank's busy and idle time and the step time.

Every rank runs its actions in order, each as soon as its inputs exist: ``F`` of stage ``s`` needs ``F`` of
stage ``s - 1``; ``B``/``I`` needs the same stage's ``F`` and the gradient from stage ``s + 1`` (its ``B`` or
``I``); ``W`` needs the same stage's ``I``. In a schedule with communication an input from another rank
arrives through the receive (``RECV_F``/``RECV_B``): the consumer waits for the receive to be posted and for
its send to have run, plus ``costs.latency``; posting a receive waits for nothing (a receive may be posted long
before its send), and a send waits for the action that produces its tensor. In a compute-only schedule the inputs pass directly (plus the latency across
ranks). Sends, receives and idle slots take no time.

Before running, the schedule is checked whole: each action once, each backward with its forward, ``W``
with its ``I``, ``B`` and ``I`` never both, every stage's forward fed by the previous stage, every send met
by exactly one receive on the right rank and every receive by a send. A schedule that passes the checks and
still stops raises :class:`ScheduleError` naming the action each blocked rank waits at and what it waits for.

A plan with replicated stages places minibatches rather than stages
(:class:`~pipedream_ft.schedules.placement.Replicated`): minibatch ``m`` of stage ``s`` runs on one of the stage's
ranks, every replica runs the stage's updates, and an update ``U`` is a collective of the stage's replicas (their
gradient all-reduce): it starts when every replica has reached it, on all of them at once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from .actions import BACKWARD, COMMUNICATION, Action, Kind, Schedule
from .costs import Costs
from .errors import ScheduleError
from .placement import PlacementLike, Replicated, as_replicated, stage_to_rank

__all__ = ["Span", "Timeline", "simulate"]


class Span(NamedTuple):
    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Timeline:
    """When every action ran, per rank in its order."""

    spans: dict[int, list[Span]]
    step_time: float
    """From the first start to the last end: the time of one step."""
    busy: dict[int, float] = field(default_factory=dict)
    """Per rank: time spent computing (and updating)."""

    @property
    def idle(self) -> dict[int, float]:
        """Per rank: the step time not spent busy (the bubble)."""
        return {r: self.step_time - b for r, b in self.busy.items()}

    @property
    def bubble_fraction(self) -> float:
        """Idle time over all ranks' time."""
        total = self.step_time * len(self.busy)
        return sum(self.idle.values()) / total if total else 0.0


def simulate(schedule: Schedule, costs: Costs | None = None, placement: PlacementLike | None = None
             ) -> Timeline:
    """Check ``schedule`` and time it with ``costs`` (default: 1 per F, I and W on every stage).

    ``placement`` (stage -> rank, or a :class:`~pipedream_ft.schedules.placement.Replicated` placement of
    replicated stages) defaults to where the schedule runs each stage.
    """
    acts = {r: [a for a in lst if a is not None] for r, lst in sorted(schedule.items())}
    where = as_replicated(placement if placement is not None else stage_to_rank(acts))
    for r, lst in acts.items():
        for a in lst:
            where.check(a, r)
    if costs is None:
        costs = Costs.uniform(max(where.num_stages, 1))
    lowered = any(a.kind in COMMUNICATION for lst in acts.values() for a in lst)
    _check(acts, where, lowered)
    last = where.num_stages - 1
    present = {a for lst in acts.values() for a in lst}

    def gradient_of(s: int, m: int) -> Action:
        i = Action(s, Kind.I, m)
        return i if i in present else Action(s, Kind.B, m)

    def deps(a: Action) -> list[tuple[Action, float]]:
        """What ``a`` waits for, each with the delay after its end."""
        s, m = a.stage, a.index
        if a.kind == Kind.F and s > 0:
            return _across(Action(s - 1, Kind.F, m), Action(s, Kind.RECV_F, m), where, lowered, costs)
        if a.kind in BACKWARD:
            out = [(Action(s, Kind.F, m), 0.0)]
            if s < last:
                out += _across(gradient_of(s + 1, m), Action(s, Kind.RECV_B, m), where, lowered, costs)
            return out
        if a.kind == Kind.W:
            return [(Action(s, Kind.I, m), 0.0)]
        if a.kind == Kind.SEND_F:
            return [(Action(s, Kind.F, m), 0.0)]
        if a.kind == Kind.SEND_B:
            return [(gradient_of(s, m), 0.0)]
        return []  # a receive is only posted: it waits for nothing (its consumer waits for the data)

    end: dict[Action, float] = {}
    clock = {r: 0.0 for r in acts}
    pos = {r: 0 for r in acts}
    spans: dict[int, list[Span]] = {r: [] for r in acts}
    holders = {s: [r for r in where.ranks[s] if r in acts] for s in range(where.num_stages)}

    def collective(a: Action) -> list[int] | None:
        """The replicas that run update ``a`` together, when every one of them has reached it; else None."""
        ranks = holders[a.stage]
        if all(pos[h] < len(acts[h]) and acts[h][pos[h]] == a for h in ranks):
            return ranks
        return None

    while any(pos[r] < len(acts[r]) for r in acts):
        progress = False
        for r, lst in acts.items():
            while pos[r] < len(lst):
                a = lst[pos[r]]
                if a.kind is Kind.U and len(holders[a.stage]) > 1:
                    together = collective(a)
                    if together is None:
                        break
                    start = max(clock[h] for h in together)
                    end[a] = start + costs.of(a)
                    for h in together:
                        clock[h] = end[a]
                        spans[h].append(Span(a, start, end[a]))
                        pos[h] += 1
                    progress = True
                    continue
                waits = deps(a)
                if any(d not in end for d, _ in waits):
                    break
                arrive = max((end[d] + delay for d, delay in waits), default=0.0)
                start = max(clock[r], arrive)
                end[a] = start + costs.of(a)
                clock[r] = end[a]
                spans[r].append(Span(a, start, end[a]))
                pos[r] += 1
                progress = True
        if not progress:
            stuck = []
            for r, lst in acts.items():
                if pos[r] < len(lst):
                    a = lst[pos[r]]
                    if a.kind is Kind.U and len(holders[a.stage]) > 1:
                        missing = [f"rank {h}" for h in holders[a.stage]
                                   if not (pos[h] < len(acts[h]) and acts[h][pos[h]] == a)]
                    else:
                        missing = [str(d) for d, _ in deps(a) if d not in end]
                    stuck.append(f"rank {r} at {a} waits for {' and '.join(missing)}")
            raise ScheduleError("deadlock: " + "; ".join(stuck))
    step = max((s.end for lst in spans.values() for s in lst), default=0.0)
    busy = {r: sum(s.end - s.start for s in lst if s.action.kind not in COMMUNICATION) for r, lst in spans.items()}
    return Timeline(spans=spans, step_time=step, busy=busy)


def _across(producer: Action, receive: Action, where: Replicated, lowered: bool, costs: Costs
            ) -> list[tuple[Action, float]]:
    """What the input ``producer`` gives waits for: the producer on the same rank; across ranks, in a schedule with
    communication, the posted ``receive`` and the matching send (plus the latency), else the producer plus the
    latency."""
    m = producer.index
    if where.rank(producer.stage, m) == where.rank(receive.stage, m):
        return [(producer, 0.0)]
    if not lowered:
        return [(producer, costs.latency)]
    send = Action(producer.stage, Kind.SEND_F if receive.kind is Kind.RECV_F else Kind.SEND_B, m)
    return [(receive, 0.0), (send, costs.latency)]


def _check(acts: dict[int, list[Action]], placement: Replicated, lowered: bool) -> None:
    counts = Counter((a, r) if a.kind is Kind.U else a for r, lst in acts.items() for a in lst)
    twice = [a for a, c in counts.items() if c > 1]
    if twice:
        shown = twice[0] if isinstance(twice[0], Action) else f"{twice[0][0]} on rank {twice[0][1]}"
        raise ScheduleError(f"{shown} appears {counts[twice[0]]} times")
    where = {a: r for r, lst in acts.items() for a in lst}
    has_backward = any(a.kind in (Kind.B, Kind.I) for a in where)
    last = placement.num_stages - 1
    for a, r in where.items():
        s, m = a.stage, a.index
        if a.kind in (Kind.B, Kind.I) and Action(s, Kind.F, m) not in where:
            raise ScheduleError(f"{a} on rank {r} has no forward {Action(s, Kind.F, m)}")
        if a.kind == Kind.B and Action(s, Kind.I, m) in where:
            raise ScheduleError(f"{a} on rank {r} and {Action(s, Kind.I, m)} both run the backward of "
                                f"minibatch {m} on stage {s}")
        if a.kind == Kind.W and Action(s, Kind.I, m) not in where:
            raise ScheduleError(f"{a} on rank {r} has no input-gradient backward {Action(s, Kind.I, m)}")
        if a.kind == Kind.I and Action(s, Kind.W, m) not in where:
            raise ScheduleError(f"{a} on rank {r} has no weight-gradient backward {Action(s, Kind.W, m)}")
        if a.kind == Kind.F:
            if s > 0 and Action(s - 1, Kind.F, m) not in where:
                raise ScheduleError(f"{a} on rank {r} needs {Action(s - 1, Kind.F, m)}, which no rank runs")
            if has_backward and Action(s, Kind.B, m) not in where and Action(s, Kind.I, m) not in where:
                raise ScheduleError(f"{a} on rank {r} has no backward ({Action(s, Kind.B, m)} or "
                                    f"{Action(s, Kind.I, m)})")
        if a.kind in (Kind.B, Kind.I) and s < last and Action(s + 1, Kind.B, m) not in where \
                and Action(s + 1, Kind.I, m) not in where:
            raise ScheduleError(f"{a} on rank {r} needs the gradient of stage {s + 1} for minibatch {m}, "
                                f"which no rank computes")
        if a.kind in COMMUNICATION:
            _check_message(a, r, where, placement)
    if lowered:  # every input from another rank comes through a receive
        for a, r in where.items():
            s, m = a.stage, a.index
            recv = None
            if a.kind == Kind.F and s > 0 and placement.rank(s - 1, m) != r:
                recv = Action(s, Kind.RECV_F, m)
            elif a.kind in (Kind.B, Kind.I) and s < last and placement.rank(s + 1, m) != r:
                recv = Action(s, Kind.RECV_B, m)
            if recv is not None and where.get(recv) != r:
                raise ScheduleError(f"{a} on rank {r} needs {recv} (its input from rank "
                                    f"{placement.rank(s - 1 if a.kind == Kind.F else s + 1, m)}), which rank {r} "
                                    "never runs")


def _check_message(a: Action, r: int, where: dict[Action, int], placement: Replicated) -> None:
    s, m = a.stage, a.index
    peer_stage = {Kind.SEND_F: s + 1, Kind.RECV_F: s - 1, Kind.SEND_B: s - 1, Kind.RECV_B: s + 1}[a.kind]
    if not 0 <= peer_stage < placement.num_stages:
        raise ScheduleError(f"{a} on rank {r}: stage {peer_stage} does not exist")
    peer_kind = {Kind.SEND_F: Kind.RECV_F, Kind.RECV_F: Kind.SEND_F, Kind.SEND_B: Kind.RECV_B,
                 Kind.RECV_B: Kind.SEND_B}[a.kind]
    peer = Action(peer_stage, peer_kind, m)
    there = placement.rank(peer_stage, m)
    if there == r:
        raise ScheduleError(f"{a} on rank {r}: stages {s} and {peer_stage} are both on rank {r}, nothing to send")
    if where.get(peer) != there:
        raise ScheduleError(f"{a} on rank {r} is never met: rank {there} never runs {peer}")
