"""Balancing the processes of a plan that gives each process several stages.

The schedules of virtual stages (interleaved 1F1B, interleaved zero bubble, looped BFS: stage ``s`` on process
``s % W``; ZBV and DualPipeV: stages ``r`` and ``2W - 1 - r`` on process ``r``) run a straight plan of ``W v``
stages on ``W`` processes. A process runs its stages one after another on one thread, so in the steady state it
needs the sum of their compute per minibatch, and the busiest process sets the pace. PipeDream's dynamic
program minimises the slowest *stage*; with several stages per process that leaves the sums as they fall (for
GNMT on 4 processes of 2 looped stages the busiest holds 1.8x the mean).

:func:`balance_bounds` takes the program's plan and looks for cuts under which the plan's predicted time — the
busiest process's compute or the slowest stage's time (compute or transfers), whichever is longer — is least:

1. a local search: one cut at a time moves to where the processes' loads are least, compared as the predicted
   time, then the loads from the busiest down, then the slowest stage, until no single move improves them;
2. a branch and bound over every plan, stage by stage, pruned by the best predicted time found so far (a
   process over it, a stage over it, or more compute left than the processes' room under it): exact when it
   ends within its budget of work, the best found otherwise;
3. the local search again from the best plan, to even out the processes below the busiest.

Every step only accepts improvements, so the result is never worse than the program's plan; a cut only takes a
position that is a valid cut between its neighbours (a downset between theirs, for a DAG).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .plan import PlanError

__all__ = ["balance_bounds", "layers_compute", "process_loads", "virtual_placement"]

_LOOPED = ("interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs")
_V_SHAPED = ("zbv", "dualpipev")


def virtual_placement(schedule: str, workers: int, stages_per_worker: int) -> list[int]:
    """The process of each of the ``workers * stages_per_worker`` stages under ``schedule`` (one of the
    schedules of virtual stages). Raises :class:`PlanError` for another schedule or a V with ``v != 2``."""
    if workers < 1 or stages_per_worker < 1:
        raise PlanError(f"workers and stages_per_worker must be >= 1, got {workers}, {stages_per_worker}")
    from pipedream_ft.schedules import loop_placement, v_placement

    if schedule in _LOOPED:
        where = loop_placement(workers, stages_per_worker)
    elif schedule in _V_SHAPED:
        if stages_per_worker != 2:
            raise PlanError(f"schedule {schedule!r} places 2 stages per process, not {stages_per_worker}")
        where = v_placement(workers)
    else:
        raise PlanError(f"schedule {schedule!r} does not place several stages per process: expected one of "
                        f"{', '.join(_LOOPED + _V_SHAPED)}")
    return [where[s] for s in range(len(where))]


def layers_compute(profile: Any, layers: Sequence[int]) -> float:
    """The compute (forward and backward, seconds) of ``profile``'s ``layers``: the inputs the search takes out of
    its states, which always join the first stage."""
    return sum((profile.layers[i].forward_ms + profile.layers[i].backward_ms) / 1000.0 for i in layers)


def process_loads(compute: np.ndarray, bounds: Sequence[int], processes: Sequence[int]) -> np.ndarray:
    """Each process's compute per minibatch: the sum over its stages ``(bounds[s], bounds[s+1]]``, with
    ``compute`` the prefix sums over the cut positions (``compute[b]``: everything before cut ``b``)."""
    loads = np.zeros(max(processes) + 1)
    for s, p in enumerate(processes):
        loads[p] += compute[bounds[s + 1]] - compute[bounds[s]]
    return loads


def _key(loads: np.ndarray, slowest: np.ndarray, scale: float) -> np.ndarray:
    """Rows of comparison keys: the predicted time (the busiest process or the slowest stage, whichever is
    longer), the loads from the busiest down, then the slowest stage; quantised so that sums taken in another
    order compare equal."""
    ordered = -np.sort(-loads, axis=-1)
    slowest = np.asarray(slowest)[..., None]
    keys = np.concatenate([np.maximum(ordered[..., :1], slowest), ordered, slowest], axis=-1)
    return np.round(keys / scale, 9)


def _less(a: np.ndarray, b: np.ndarray) -> bool:
    diff = np.flatnonzero(a != b)
    return bool(diff.size) and bool(a[diff[0]] < b[diff[0]])


def balance_bounds(compute: np.ndarray, bounds: Sequence[int], processes: Sequence[int],
                   between: Callable[[int, int], np.ndarray],
                   stage_time: Callable[[Any, Any], np.ndarray] | None = None, *,
                   lower_bound: float = 0.0, budget: int = 20_000) -> list[int]:
    """Better cuts for a straight plan whose stage ``s`` runs on process ``processes[s]`` (see the module
    docstring).

    ``compute``: prefix sums of the compute over cut positions, ``compute[0] = 0`` at the start; ``bounds``:
    the plan's cut positions ``bounds[0] = start < ... < bounds[-1] = end``, stage ``s`` being
    ``(bounds[s], bounds[s+1]]``; ``between(lo, hi)``: the positions a cut may take between cuts ``lo`` and
    ``hi`` (sorted, neither included); ``stage_time(lo, hi)``: the planner's time of the stages ``(lo, hi]``
    (compute or transfers, whichever is longer; element-wise over arrays; default: their compute).
    ``lower_bound``: a time no plan beats (the program's slowest stage: it is the least over every plan); the
    search ends when it reaches it or the mean process's compute. ``budget``: the candidate positions the exact
    search may look at. The first and last cuts stay. Returns the new cut positions."""
    compute = np.asarray(compute, dtype=np.float64)
    if stage_time is None:
        def stage_time(lo: Any, hi: Any) -> np.ndarray:
            return compute[hi] - compute[lo]
    b = [int(x) for x in bounds]
    procs = [int(p) for p in processes]
    if len(procs) != len(b) - 1:
        raise PlanError(f"{len(procs)} processes for {len(b) - 1} stages")
    if len(b) < 3:
        return b
    total = float(compute[b[-1]] - compute[b[0]])
    scale = total if total > 0 else 1.0
    lower = max(float(lower_bound), total / len(set(procs)))
    b = _polish(compute, b, procs, between, stage_time, scale)
    b = _branch_and_bound(compute, b, procs, between, stage_time, scale, budget, lower)
    return _polish(compute, b, procs, between, stage_time, scale)


def _predicted(compute: np.ndarray, b: list[int], procs: list[int], stage_time: Callable[[Any, Any], np.ndarray]
               ) -> tuple[np.ndarray, np.ndarray]:
    times = np.array([float(stage_time(b[s], b[s + 1])) for s in range(len(procs))])
    return times, process_loads(compute, b, procs)


def _polish(compute: np.ndarray, bounds: list[int], procs: list[int], between: Callable[[int, int], np.ndarray],
            stage_time: Callable[[Any, Any], np.ndarray], scale: float, max_sweeps: int = 1000) -> list[int]:
    """The local search: each cut in turn to its best position while one improves the key (:func:`_key`)."""
    b = list(bounds)
    times, loads = _predicted(compute, b, procs, stage_time)
    current = _key(loads, times.max(), scale)
    for _ in range(max_sweeps):
        moved = False
        for i in range(1, len(b) - 1):  # cut i ends stage i-1 and starts stage i
            q = np.asarray(between(b[i - 1], b[i + 1]), dtype=np.int64)
            if q.size == 0:
                continue
            left, right = procs[i - 1], procs[i]
            rows = np.repeat(loads[None, :], q.size, axis=0)
            rows[:, left] += (compute[q] - compute[b[i - 1]]) - (compute[b[i]] - compute[b[i - 1]])
            rows[:, right] += (compute[b[i + 1]] - compute[q]) - (compute[b[i + 1]] - compute[b[i]])
            others = np.delete(times, [i - 1, i])
            slowest = np.maximum(np.maximum(np.asarray(stage_time(b[i - 1], q), dtype=np.float64),
                                            np.asarray(stage_time(q, b[i + 1]), dtype=np.float64)),
                                 others.max() if others.size else 0.0)
            keys = _key(rows, slowest, scale)
            best = int(np.lexsort(keys.T[::-1])[0])
            if int(q[best]) != b[i] and _less(keys[best], current):
                b[i] = int(q[best])
                times, loads = _predicted(compute, b, procs, stage_time)  # afresh: no drift from the sums above
                current = _key(loads, times.max(), scale)
                moved = True
        if not moved:
            break
    return b


class _OutOfBudget(Exception):
    """Ends the search: its budget is spent, or it reached the lower bound."""


def _branch_and_bound(compute: np.ndarray, bounds: list[int], procs: list[int],
                      between: Callable[[int, int], np.ndarray], stage_time: Callable[[Any, Any], np.ndarray],
                      scale: float, budget: int, lower: float) -> list[int]:
    """The plan of least predicted time (the busiest process or the slowest stage), searched stage by stage
    from the start; ``bounds`` is the best known. Stops with the best found after ``budget`` candidates, or on
    reaching ``lower``."""
    start, end = bounds[0], bounds[-1]
    n = len(procs)
    times, loads = _predicted(compute, bounds, procs, stage_time)
    best = [float(max(loads.max(), times.max())), list(bounds)]
    slack = 1e-9 * scale  # an improvement must beat rounding
    later = [sorted(set(procs[s + 1:])) for s in range(n)]  # processes with a stage after stage s
    spent = [0]

    def dfs(s: int, lo: int, cuts: list[int], loads: np.ndarray, worst: float) -> None:
        limit = best[0] - slack
        p = procs[s]
        if s == n - 1:  # the last stage ends at the end
            load = loads[p] + compute[end] - compute[lo]
            t = max(worst, float(loads.max()), load, float(stage_time(lo, end)))
            if t < limit:
                best[0], best[1] = t, [*cuts, end]
                if t <= lower + slack:
                    raise _OutOfBudget  # nothing is faster
            return
        q = np.asarray(between(lo, end), dtype=np.int64)
        spent[0] += q.size + 1
        if spent[0] > budget:
            raise _OutOfBudget
        if q.size == 0:
            return
        load = loads[p] + compute[q] - compute[lo]
        ok = load < limit
        room = np.zeros(q.size)  # what the processes of the later stages can still take under the limit
        for r in later[s]:
            room += (limit - load) if r == p else (limit - loads[r])
        ok &= compute[end] - compute[q] <= room
        if not ok.any():
            return
        q, load = q[ok], load[ok]
        t = np.asarray(stage_time(lo, q), dtype=np.float64) * np.ones(q.size)
        keep = t < limit
        q, load, t = q[keep], load[keep], t[keep]
        if s == n - 2 and q.size:  # the last stage follows from q: every candidate at once
            last = procs[n - 1]
            rest = np.delete(loads, [p, last])
            final = (load if last == p else loads[last]) + compute[end] - compute[q]
            total = np.maximum(np.maximum(final, np.asarray(stage_time(q, end), dtype=np.float64)),
                               np.maximum(t, max(worst, float(rest.max()) if rest.size else 0.0)))
            if last != p:
                total = np.maximum(total, load)
            k = int(np.argmin(total))
            if total[k] < limit:
                best[0], best[1] = float(total[k]), [*cuts, int(q[k]), end]
                if total[k] <= lower + slack:
                    raise _OutOfBudget  # nothing is faster
            return
        # the stage nearest an even share of what is left first: good plans early, tighter pruning
        share = (compute[end] - compute[lo]) / (n - s)
        for k in np.argsort(np.abs(compute[q] - compute[lo] - share), kind="stable"):
            if load[k] >= best[0] - slack:
                continue
            nxt = loads.copy()
            nxt[p] = load[k]
            dfs(s + 1, int(q[k]), [*cuts, int(q[k])], nxt, max(worst, float(t[k])))

    if best[0] <= lower + slack:
        return best[1]
    try:
        dfs(0, start, [start], np.zeros(len(loads)), 0.0)
    except _OutOfBudget:
        pass
    return best[1]
