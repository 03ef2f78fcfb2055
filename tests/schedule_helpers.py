"""Running the runtime modes' per-replica schedules through the one simulator (``pipedream_ft.schedules``)."""

from __future__ import annotations

from typing import Sequence

from pipedream_ft.schedules import Action, Costs, Timeline, simulate
from pipedream_ft.schedules.placement import Replicated


def replicated_placement(replicas: Sequence[int]) -> Replicated:
    """Ranks numbered stage by stage, as a plan numbers them: stage ``s``'s replicas are consecutive ranks."""
    ranks, first = [], 0
    for n in replicas:
        ranks.append(tuple(range(first, first + n)))
        first += n
    return Replicated(tuple(ranks))


def run_replicated(schedules: Sequence[Sequence[Sequence[Action]]], replicas: Sequence[int]) -> Timeline:
    """Simulate ``schedules[stage][replica]`` on a unit-time clock (every compute action and update takes one unit);
    raises ScheduleError on a deadlock."""
    placement = replicated_placement(replicas)
    by_rank = {placement.ranks[s][r]: list(acts) for s, per in enumerate(schedules) for r, acts in enumerate(per)}
    unit = Costs.uniform(len(replicas), forward=1.0, input_backward=0.5, weight_backward=0.5, update=1.0)
    split = any(a.kind.value in ("I", "W") for per in schedules for acts in per for a in acts)
    if split:
        unit = Costs.uniform(len(replicas), forward=1.0, input_backward=1.0, weight_backward=1.0, update=1.0)
    return simulate(by_rank, costs=unit, placement=placement)


def grid(timeline: Timeline) -> list[list[Action | None]]:
    """``grid[t][rank]``: the action rank ``rank`` runs in unit ``t`` of a :func:`run_replicated` timeline."""
    ranks = sorted(timeline.spans)
    rows: list[list[Action | None]] = [[None] * len(ranks) for _ in range(round(timeline.step_time))]
    for i, r in enumerate(ranks):
        for span in timeline.spans[r]:
            for t in range(round(span.start), round(span.end)):
                rows[t][i] = span.action
    return rows


def ran(timeline: Timeline) -> dict[int, list[Action]]:
    """Each rank's actions in the order it ran them (communication left out)."""
    return {r: [s.action for s in spans if not s.action.kind.value.startswith(("SEND", "RECV"))]
            for r, spans in timeline.spans.items()}
