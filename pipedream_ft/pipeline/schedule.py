"""The 1F1B schedule as pure data.

An action is :class:`pipedream_ft.schedules.Action`: a stage, a kind — ``F`` (forward), ``B`` (backward), ``I`` /
``W`` (the backward split) or ``U`` (weight update: gradient all-reduce among a stage's replicas, then the
optimizer step) — and a minibatch (for ``U``: an update round), printed ``2F5``. A schedule is the list of
actions one rank computes; :meth:`~pipedream_ft.pipeline.modes.Mode.lowered` adds the sends and receives that
connect it to its neighbours (``F b`` on stage ``s > 0`` receives from the replica of stage ``s - 1`` that ran
``F b``; ``B b`` receives the gradient from stage ``s + 1``), and the executor runs that lowered list.

Minibatches are dealt round-robin to a stage's replicas: replica ``r`` of a stage with ``R`` replicas runs the
minibatches ``b`` with ``b % R == r``. A replica of stage ``s`` keeps ``ceil(sum(R[s:]) / R[s])`` minibatches in
flight — ``S - s`` in a straight pipeline of ``S`` stages — enough to keep every later stage busy: it runs that
many forwards, then alternates one backward and one forward (1F1B) and never flushes.

The flushing variant runs windows of ``K`` minibatches with 1F1B inside each window, then one update for the
window: synchronous minibatch SGD. The double-buffered variant (PipeDream-2BW) is PipeDream's 1F1B without a
flush whose update ``U k`` follows the last backward of window ``k`` (``K`` minibatches).

:func:`simulate` executes a set of schedules on a unit-time clock, honouring every data dependency and the
collective ``U`` steps, and raises :class:`ScheduleError` on a deadlock; :func:`render` draws the grid.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..schedules.actions import Action, Kind

__all__ = [
    "Action",
    "ScheduleError",
    "in_flight",
    "replica_minibatches",
    "one_f_one_b",
    "flushing",
    "SYNCHRONOUS",
    "synchronous",
    "double_buffered",
    "simulate",
    "render",
]


class ScheduleError(RuntimeError):
    """A set of schedules cannot run to completion."""


def in_flight(stage: int, replicas: Sequence[int]) -> int:
    """How many minibatches one replica of ``stage`` keeps in flight in steady state."""
    if not 0 <= stage < len(replicas):
        raise ValueError(f"stage must be in [0, {len(replicas)}), got {stage}")
    return math.ceil(sum(replicas[stage:]) / replicas[stage])


def replica_minibatches(replica: int, num_replicas: int, start: int, stop: int) -> list[int]:
    """The minibatches in ``[start, stop)`` that ``replica`` of a stage with ``num_replicas`` replicas runs."""
    if not 0 <= replica < num_replicas:
        raise ValueError(f"replica must be in [0, {num_replicas}), got {replica}")
    first = start + (replica - start) % num_replicas
    return list(range(first, stop, num_replicas))


def one_f_one_b(stage: int, replica: int, replicas: Sequence[int], start: int, stop: int) -> list[Action]:
    """PipeDream's asynchronous 1F1B for minibatches ``[start, stop)``, an update after every backward.

    ``start`` must be a multiple of every stage's replica count, so that every replica starts a round.
    """
    _check_window(start, stop, replicas)
    mine = replica_minibatches(replica, replicas[stage], start, stop)
    k = min(in_flight(stage, replicas), len(mine))
    first_round = start // replicas[stage]
    actions = [Action(stage, Kind.F, b) for b in mine[:k]]
    for i, b in enumerate(mine):
        actions.append(Action(stage, Kind.B, b))
        actions.append(Action(stage, Kind.U, first_round + i))
        if i + k < len(mine):
            actions.append(Action(stage, Kind.F, mine[i + k]))
    return actions


def flushing(stage: int, replica: int, replicas: Sequence[int], start: int, stop: int, window: int) -> list[Action]:
    """1F1B inside windows of ``window`` minibatches, one update per window (the pipeline flushes)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    _check_window(start, stop, replicas)
    if (stop - start) % window or start % window:
        raise ValueError(f"minibatches [{start}, {stop}) are not whole windows of {window}")
    lcm = math.lcm(*replicas)
    if window % lcm:
        raise ValueError(f"window {window} must be a multiple of every stage's replica count (lcm {lcm})")
    actions: list[Action] = []
    for w in range(start // window, stop // window):
        mine = replica_minibatches(replica, replicas[stage], w * window, (w + 1) * window)
        k = min(in_flight(stage, replicas), len(mine))
        actions += [Action(stage, Kind.F, b) for b in mine[:k]]
        for i, b in enumerate(mine):
            actions.append(Action(stage, Kind.B, b))
            if i + k < len(mine):
                actions.append(Action(stage, Kind.F, mine[i + k]))
        actions.append(Action(stage, Kind.U, w))
    return actions


SYNCHRONOUS = ("1f1b", "gpipe", "zb_h1")
"""The schedules ``flush`` mode runs (one stage per rank): 1F1B (:func:`flushing`, replicated stages too),
GPipe's fill and drain, and ZB-H1 (zero bubble with 1F1B's memory: the backward split into ``I`` and ``W``, a
rank's first weight gradients deferred into the drain)."""


def synchronous(name: str, stage: int, replica: int, replicas: Sequence[int], start: int, stop: int,
                window: int) -> list[Action]:
    """Schedule ``name`` (one of :data:`SYNCHRONOUS`) over windows of ``window`` minibatches, one update per window:
    the orders of :mod:`pipedream_ft.schedules`, whose minibatch ``m`` of a window is minibatch ``w + m`` here.
    GPipe and ZB-H1 run straight pipelines (no replicated stage)."""
    if name == "1f1b":
        return flushing(stage, replica, replicas, start, stop, window)
    if name not in SYNCHRONOUS:
        raise ValueError(f"schedule must be one of {SYNCHRONOUS}, got {name!r}")
    if any(r != 1 for r in replicas):
        raise ValueError(f"schedule {name!r} runs a straight pipeline; the plan replicates stages "
                         f"{[s for s, r in enumerate(replicas) if r != 1]} (use '1f1b')")
    _check_window(start, stop, replicas)
    if window < 1 or start % window or stop % window:
        raise ValueError(f"minibatches [{start}, {stop}) are not whole windows of {window}")
    from ..schedules import catalog

    order = catalog.build(name, len(replicas), window).schedule[stage]
    actions: list[Action] = []
    for w in range(start // window, stop // window):
        actions += [Action(stage, a.kind, w * window + a.index) for a in order]
        actions.append(Action(stage, Kind.U, w))
    return actions


def double_buffered(stage: int, replica: int, replicas: Sequence[int], start: int, stop: int,
                    window: int) -> list[Action]:
    """PipeDream-2BW: asynchronous 1F1B (no flush) with one update per window of ``window`` minibatches, right
    after this replica's last backward of the window."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    _check_window(start, stop, replicas)
    if (stop - start) % window or start % window:
        raise ValueError(f"minibatches [{start}, {stop}) are not whole windows of {window}")
    lcm = math.lcm(*replicas)
    if window % lcm:
        raise ValueError(f"window {window} must be a multiple of every stage's replica count (lcm {lcm})")
    mine = replica_minibatches(replica, replicas[stage], start, stop)
    k = min(in_flight(stage, replicas), len(mine))
    actions = [Action(stage, Kind.F, b) for b in mine[:k]]
    for i, b in enumerate(mine):
        actions.append(Action(stage, Kind.B, b))
        if (b + replicas[stage]) // window != b // window:  # this replica's last of the window
            actions.append(Action(stage, Kind.U, b // window))
        if i + k < len(mine):
            actions.append(Action(stage, Kind.F, mine[i + k]))
    return actions


def _check_window(start: int, stop: int, replicas: Sequence[int]) -> None:
    if not replicas or any(r < 1 for r in replicas):
        raise ValueError(f"replicas must be positive, got {list(replicas)}")
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got start={start} stop={stop}")
    lcm = math.lcm(*replicas)
    if start % lcm or stop % lcm:
        raise ValueError(
            f"minibatch range [{start}, {stop}) must start and end on a multiple of {lcm} "
            f"(the least common multiple of the stages' replica counts {list(replicas)})"
        )


def simulate(schedules: Sequence[Sequence[Sequence[Action]]], replicas: Sequence[int]) -> list[list[Action | None]]:
    """Run ``schedules[stage][replica]`` on a unit-time clock; return ``grid[t][rank]``.

    Ranks are numbered stage by stage. An action runs once its inputs exist: ``F b`` needs ``F b`` of the
    previous stage, ``B b`` (or ``I b``) needs ``F b`` here and ``B b`` (or ``I b``) of the next stage, ``W b``
    needs ``I b`` here, and the ``U j`` of a stage's
    replicas run together. Raises :class:`ScheduleError` naming the stuck actions on a deadlock.
    """
    num_stages = len(replicas)
    ranks = [(s, r) for s in range(num_stages) for r in range(replicas[s])]
    pos = {sr: 0 for sr in ranks}
    done_f: set[tuple[int, int]] = set()
    done_b: set[tuple[int, int]] = set()
    grid: list[list[Action | None]] = []

    def ready(s: int, r: int) -> bool:
        a = schedules[s][r][pos[(s, r)]]
        if a.kind == "F":
            return s == 0 or (s - 1, a.index) in done_f
        if a.kind in ("B", "I"):
            return (s, a.index) in done_f and (s == num_stages - 1 or (s + 1, a.index) in done_b)
        if a.kind == "W":
            return (s, a.index) in done_b
        for r2 in range(replicas[s]):
            i = pos[(s, r2)]
            if i >= len(schedules[s][r2]) or schedules[s][r2][i] != a:
                return False
        return True

    while any(pos[sr] < len(schedules[sr[0]][sr[1]]) for sr in ranks):
        runnable = [sr for sr in ranks if pos[sr] < len(schedules[sr[0]][sr[1]]) and ready(*sr)]
        if not runnable:
            stuck = ", ".join(f"stage {s} replica {r} at {schedules[s][r][pos[(s, r)]]}"
                              for s, r in ranks if pos[(s, r)] < len(schedules[s][r]))
            raise ScheduleError(f"deadlock after {len(grid)} steps: {stuck}")
        row: list[Action | None] = [None] * len(ranks)
        for s, r in runnable:
            a = schedules[s][r][pos[(s, r)]]
            row[ranks.index((s, r))] = a
            pos[(s, r)] += 1
            if a.kind == "F":
                done_f.add((s, a.index))
            elif a.kind in ("B", "I"):
                done_b.add((s, a.index))
        grid.append(row)
    return grid


def render(grid: Sequence[Sequence[Action | None]]) -> str:
    """Draw a simulated grid: one row per rank, one column per clock tick."""
    if not grid:
        return ""
    width = max(len(str(a)) for row in grid for a in row if a is not None)
    lines = []
    for rank in range(len(grid[0])):
        cells = [(str(row[rank]) if row[rank] is not None else ".").rjust(width) for row in grid]
        lines.append(f"rank {rank}: " + " ".join(cells))
    return "\n".join(lines)

