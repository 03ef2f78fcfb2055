"""Which pipeline schedule runs a plan fastest: every schedule the runtime runs, simulated with the profile's costs.

For a plan of ``S`` stages and ``m`` minibatches per optimizer step (``flush_every``), each schedule is run on
paper (:func:`pipedream_ft.schedules.simulate`) with each stage's costs summed from the profile's layers: ``F``
the forward times, and the backward times split into ``I`` (input gradient) and ``W`` (weight gradient) as the
profiler measured them (``weight_backward_ms``). A layer without that measurement (a profile from before it, or
imported from PipeDream's ``graph.txt``) is split by ``weight_fraction`` (a matrix product's two gradients cost
about the same, hence 0.5); a ``weight_fraction`` given explicitly splits every layer. The predicted time per
minibatch is the simulated step divided by ``m``; PipeDream's asynchronous
1F1B (modes ``stash``/``vertical``, which never flush) is its steady state, the slowest stage's ``F + B``.
Given the machine ``pipedream-probe`` measured (``pipedream-partition --machine``), the simulation also holds
the runtime's own costs (:func:`schedule_costs`): its fixed cost per minibatch per stage, half on each compute
action — so a split backward, one action more per minibatch, pays for it — and the links' latency and bandwidth
between stages.

**Memory per worker** is counted as each schedule really holds it: the weights (``P``) plus the activations of
the most minibatches a stage holds at once (:func:`pipedream_ft.schedules.peak_in_flight`: from ``F`` to the
end of its backward — ``W`` for a split one, so ZB-H1 holds what 1F1B holds, GPipe all ``m``) times the stage's
activation bytes per minibatch (``A``); PipeDream's asynchronous 1F1B also stashes a weight version per
minibatch in flight: ``(S - s) (P + A)``, the partitioner's own model. A schedule that does not fit
``memory_bytes`` on some stage is ranked but not chosen.

A schedule given as a table (:class:`pipedream_ft.schedules.WindowSchedule`) is ranked the same way, under its
file's name. Only straight plans (one worker per stage) run GPipe, ZB-H1 and tables; a replicated plan runs 1F1B
(synchronous) or PipeDream's asynchronous 1F1B, and only those are ranked for it.

**Virtual stages** (:func:`rank_virtual`): the schedules that give each worker ``v`` stages — interleaved 1F1B,
interleaved zero-bubble and looped BFS (stage ``s`` on worker ``s % W``), ZBV and DualPipeV (``v = 2``, in a V)
— are planned on ``W * v`` straight stages split by PipeDream's dynamic program and balanced across the processes
(:func:`virtual_plan`: a process runs its stages one after another), simulated the same way on that plan and on
the program's own, ranked with the faster, and their memory counted per worker, as its own actions hold it: the
weights of all its stages plus, at its worst moment, the activations of every minibatch one of its stages has run
forward and not yet finished backward. They rank beside the others and may be chosen: the plan to train them with
is the one they were ranked with (:attr:`Ranked.plan`), its ``W v`` stages on ``W`` processes (see
:mod:`pipedream_ft.virtual`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from profiler.profile import Profile

from .machine import MachineProfile
from .plan import Plan, PlanError

__all__ = ["Ranked", "schedule_costs", "rank_schedules", "rank_virtual", "virtual_plan", "choose", "format_ranking",
           "RUNNABLE", "VIRTUAL", "DEFAULT_WEIGHT_FRACTION"]

RUNNABLE = ("1f1b", "gpipe", "zb_h1", "pipedream")
"""The schedules of one stage per rank: ``flush`` mode's three and the asynchronous modes'."""

VIRTUAL = ("interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs", "zbv", "dualpipev")
"""The schedules of several stages per worker (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Ranked:
    """One schedule's prediction for a plan."""

    name: str
    time_per_minibatch_s: float
    bubble: float
    """Fraction of the ranks' time idle in a step (0 for the asynchronous steady state)."""
    memory_bytes: tuple[float, ...]
    """Per stage (per worker, for a schedule of virtual stages): bytes one worker needs."""
    fits: bool
    stages_per_worker: int = 1
    plan: Plan | None = field(default=None, compare=False, repr=False)
    """For a schedule of virtual stages: the plan of ``W v`` stages it was simulated on (the one to train)."""

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.memory_bytes)


DEFAULT_WEIGHT_FRACTION = 0.5
"""The share of a backward taken as its weight gradient where the profile did not measure it."""


@dataclass(frozen=True, slots=True)
class _StageCosts:
    """Per stage, in seconds and bytes."""

    forward: list[float]
    backward: list[float]
    weight_backward: list[float]
    parameters: list[float]
    activations: list[float]
    """Per minibatch."""


def _weight_ms(layer: Any, weight_fraction: float | None) -> float:
    if weight_fraction is not None:
        return layer.backward_ms * weight_fraction
    if layer.weight_backward_ms is not None:
        return layer.weight_backward_ms
    return layer.backward_ms * DEFAULT_WEIGHT_FRACTION


def _stage_costs(plan: Plan, profile: Profile, weight_fraction: float | None) -> _StageCosts:
    if len(profile.layers) != plan.num_layers:
        raise PlanError(f"the profile has {len(profile.layers)} layers, the plan {plan.num_layers}: not its profile")
    out = _StageCosts([], [], [], [], [])
    for st in plan.stages:
        layers = [profile.layers[i] for i in st.layers]
        out.forward.append(sum(x.forward_ms for x in layers) / 1e3)
        out.backward.append(sum(x.backward_ms for x in layers) / 1e3)
        out.weight_backward.append(sum(_weight_ms(x, weight_fraction) for x in layers) / 1e3)
        out.parameters.append(sum(x.parameter_bytes for x in layers))
        out.activations.append(sum(x.activation_bytes for x in layers))
    return out


def schedule_costs(plan: Plan, profile: Profile, weight_fraction: float | None = None,
                   machine: MachineProfile | None = None, workers: Sequence[int] | None = None) -> Any:
    """The :class:`pipedream_ft.schedules.Costs` (seconds) the ranking simulates ``plan``'s stages with: ``F``
    summed from the profile's layers, the backward split into ``I`` and ``W`` as measured (or by
    ``weight_fraction``, see the module docstring). With ``machine`` (``pipedream-probe``'s measurement) also
    the runtime's own costs: half its fixed cost per minibatch per stage on every compute action, and between
    two stages the link's latency plus the boundary's bytes (the sending stage's last layer's output) over its
    bandwidth, averaged over the plan's boundaries that cross workers. ``workers``: the worker (process) of each
    stage, for virtual stages (default: each stage's first rank)."""
    if weight_fraction is not None and not 0.0 <= weight_fraction <= 1.0:
        raise PlanError(f"weight_fraction must be in [0, 1], got {weight_fraction}")
    return _costs(_stage_costs(plan, profile, weight_fraction), plan, profile, machine, workers)


def _common_level(workers: Sequence[int], a: int, b: int) -> int:
    """The innermost level of a machine whose one group holds ranks ``a`` and ``b`` (ranks laid out innermost
    level first)."""
    size = 1
    for level, n in enumerate(workers):
        size *= n
        if a // size == b // size:
            return level
    return len(workers) - 1


def _costs(sc: _StageCosts, plan: Plan, profile: Profile, machine: MachineProfile | None,
           workers: Sequence[int] | None = None) -> Any:
    """``sc`` as :class:`~pipedream_ft.schedules.Costs`, with ``machine``'s costs if given; ``workers``: the
    worker of each stage (default: each stage's first rank in the plan)."""
    from pipedream_ft.schedules import Costs

    latency = overhead = 0.0
    if machine is not None:
        overhead = machine.overhead_s / 2  # the probe's pipeline runs one forward and one backward per minibatch
        where = list(workers) if workers is not None else [st.ranks[0] for st in plan.stages]
        links = []
        for s, (here, there) in enumerate(zip(where, where[1:])):
            if here == there:  # two stages of one worker: no transfer
                continue
            level = machine.levels[_common_level(machine.workers, here, there)]
            size = profile.layers[plan.stages[s].layers[-1]].activation_bytes
            links.append(level.latency_s + size / level.bandwidth)
        latency = sum(links) / len(links) if links else 0.0
    return Costs(forward=sc.forward, input_backward=[max(0.0, x - w) for x, w in zip(sc.backward, sc.weight_backward)],
                 weight_backward=sc.weight_backward, latency=latency, overhead=overhead)


def rank_schedules(plan: Plan, profile: Profile, microbatches: int, *, weight_fraction: float | None = None,
                   memory_bytes: float | None = None, names: Sequence[str] | None = None,
                   tables: Sequence[Any] = (), machine: MachineProfile | None = None) -> list[Ranked]:
    """The schedules the plan can run (or ``names``), fastest first (see the module docstring). ``tables``: schedules
    given as data (:class:`pipedream_ft.schedules.WindowSchedule`, one window of ``microbatches``), ranked beside
    them under their source's name. ``machine``: simulate the runtime's own costs too (see :func:`schedule_costs`)."""
    from pipedream_ft.schedules import build, peak_in_flight, simulate

    if microbatches < 1:
        raise PlanError(f"microbatches must be >= 1, got {microbatches}")
    if weight_fraction is not None and not 0.0 <= weight_fraction <= 1.0:
        raise PlanError(f"weight_fraction must be in [0, 1], got {weight_fraction}")
    straight = all(s.replicas == 1 for s in plan.stages)
    runnable = RUNNABLE if straight else ("1f1b", "pipedream")
    names = tuple(names) if names is not None else runnable
    for name in names:
        if name not in runnable:
            why = "" if name in RUNNABLE else f" (the runtime runs {', '.join(RUNNABLE)})"
            raise PlanError(f"schedule {name!r} cannot run this plan{why}" +
                            ("; a plan with replicated stages runs 1f1b or pipedream" if name in RUNNABLE else ""))
    sc = _stage_costs(plan, profile, weight_fraction)
    f, b, p, a = sc.forward, sc.backward, sc.parameters, sc.activations
    stages = plan.num_stages
    costs = _costs(sc, plan, profile, machine)
    out = []
    for table in tables:
        why = table.check_plan([st.replicas for st in plan.stages])
        if why is not None:
            raise PlanError(why)
        if table.microbatches != microbatches:
            raise PlanError(f"the schedule {table} runs windows of {table.microbatches} minibatches, not "
                            f"{microbatches}")
        schedule = {rank: list(order) for rank, order in enumerate(table.orders)}
        timeline = simulate(schedule, costs)
        peak = peak_in_flight(schedule)
        memory = tuple(p[s] + peak.get(s, 0) * a[s] for s in range(stages))
        out.append(Ranked(str(table), timeline.step_time / microbatches, timeline.bubble_fraction, memory,
                          memory_bytes is None or max(memory) <= memory_bytes))
    for name in names:
        if name == "pipedream":  # asynchronous: no flush, the slowest stage sets the pace
            per = max((fs + bs + 2 * costs.overhead) / s.replicas for fs, bs, s in zip(f, b, plan.stages))
            memory = tuple((stages - s) * (p[s] + a[s]) for s in range(stages))
            out.append(Ranked(name, per, 0.0, memory, memory_bytes is None or max(memory) <= memory_bytes))
            continue
        schedule = build(name, stages, microbatches).schedule
        timeline = simulate(schedule, costs)
        peak = peak_in_flight(schedule)
        memory = tuple(p[s] + peak.get(s, 0) * a[s] for s in range(stages))
        out.append(Ranked(name, timeline.step_time / microbatches, timeline.bubble_fraction, memory,
                          memory_bytes is None or max(memory) <= memory_bytes))
    return sorted(out, key=lambda r: (not r.fits, r.time_per_minibatch_s))


def rank_virtual(profile: Profile, workers: int, microbatches: int, bandwidth: float, *, stages_per_worker: int = 2,
                 weight_fraction: float | None = None, memory_bytes: float | None = None,
                 names: Sequence[str] | None = None, machine: MachineProfile | None = None,
                 plan: Plan | None = None) -> list[Ranked]:
    """The schedules of ``stages_per_worker`` stages per worker for ``workers`` workers, planned and simulated
    (see the module docstring), fastest first. ZBV and DualPipeV need 2 stages per worker and are left out
    otherwise, DualPipeV also when ``microbatches`` is under its stage count; ``names`` picks among
    :data:`VIRTUAL`. ``machine``: simulate its costs too (see :func:`schedule_costs`), each stage on the worker
    the schedule places it on — a worker's stages pay the fixed cost per action each, and interleaving multiplies
    the actions. Each schedule is simulated on :func:`virtual_plan`'s plan for its placement and on the dynamic
    program's own (the slowest stage's), and ranked with the faster (:attr:`Ranked.plan`: the one to train).
    ``plan``: simulate every schedule on this straight plan of ``workers * stages_per_worker`` stages instead.
    Raises :class:`PlanError` for bad settings or a
    model with too few cut points."""
    from pipedream_ft.schedules import build, simulate

    if workers < 1 or stages_per_worker < 1 or microbatches < 1:
        raise PlanError(f"workers, stages_per_worker and microbatches must be >= 1, got {workers}, "
                        f"{stages_per_worker}, {microbatches}")
    if weight_fraction is not None and not 0.0 <= weight_fraction <= 1.0:
        raise PlanError(f"weight_fraction must be in [0, 1], got {weight_fraction}")
    chosen = tuple(names) if names is not None else VIRTUAL
    unknown = [n for n in chosen if n not in VIRTUAL]
    if unknown:
        raise PlanError(f"unknown schedules of virtual stages {unknown}: expected some of {', '.join(VIRTUAL)}")
    stages = workers * stages_per_worker
    if plan is not None and (plan.num_stages != stages or any(s.replicas != 1 for s in plan.stages)):
        raise PlanError(f"the plan given has {plan.num_stages} stages (replicas {[s.replicas for s in plan.stages]});"
                        f" {workers} workers x {stages_per_worker} stages need {stages} straight ones")
    given = plan
    program: list[Plan] = []  # the dynamic program's plan, made once
    plans: dict[tuple[int, ...], list[Plan]] = {}  # candidates per placement: the looped schedules share theirs
    out = []
    for name in chosen:
        if name in ("zbv", "dualpipev") and (stages_per_worker != 2 or (name == "dualpipev" and microbatches < stages)):
            continue
        built = build(name, workers, microbatches, stages_per_worker if name not in ("zbv", "dualpipev") else None)
        where = tuple(built.placement[s] for s in range(stages))
        if where not in plans:
            if given is not None:
                plans[where] = [given]
            else:  # balanced, and the program's own in case the schedule's bubbles or transfers favour it
                plans[where] = [virtual_plan(profile, workers, stages_per_worker, bandwidth, schedule=name)]
                if not program:
                    program.append(_program_plan(profile, stages, bandwidth, workers, stages_per_worker))
                if [s.layers for s in program[0].stages] != [s.layers for s in plans[where][0].stages]:
                    plans[where].append(program[0])
        candidates = []
        for plan in plans[where]:
            sc = _stage_costs(plan, profile, weight_fraction)
            costs = _costs(sc, plan, profile, machine, [built.placement[s] for s in range(stages)])
            timeline = simulate(built.schedule, costs, built.placement)
            memory = _worker_memory(built.schedule, built.placement, sc.parameters, sc.activations)
            candidates.append(Ranked(name, timeline.step_time / microbatches, timeline.bubble_fraction, memory,
                                     memory_bytes is None or max(memory) <= memory_bytes,
                                     stages_per_worker=stages_per_worker, plan=plan))
        out.append(min(candidates, key=lambda r: (not r.fits, r.time_per_minibatch_s)))  # the balanced on a tie
    return sorted(out, key=lambda r: (not r.fits, r.time_per_minibatch_s))


def _program_plan(profile: Profile, stages: int, bandwidth: float, workers: int, stages_per_worker: int) -> Plan:
    from .optimizer import partition

    try:
        return partition(profile, stages, bandwidth, straight=True)
    except PlanError as exc:
        raise PlanError(f"{workers} workers x {stages_per_worker} stages: {exc}") from None


def virtual_plan(profile: Profile, workers: int, stages_per_worker: int, bandwidth: float, *,
                 schedule: str = "interleaved_1f1b") -> Plan:
    """The plan of ``workers * stages_per_worker`` straight stages that ``schedule`` (one of :data:`VIRTUAL`)
    runs on ``workers`` processes and :func:`rank_virtual` simulates: PipeDream's plan, balanced so that the
    busiest process, the sum of its stages where the schedule places them, holds the least compute it can
    (:mod:`partitioner.balance`; the looped schedules share one placement, the V schedules another). Raises
    :class:`PlanError` for a model with too few cut points."""
    from .balance import virtual_placement
    from .optimizer import partition

    processes = virtual_placement(schedule, workers, stages_per_worker)
    try:
        return partition(profile, workers * stages_per_worker, bandwidth, straight=True, processes=processes)
    except PlanError as exc:
        raise PlanError(f"{workers} workers x {stages_per_worker} stages: {exc}") from None


def _worker_memory(schedule: Any, placement: dict[int, int], parameters: list[float], activations: list[float]
                   ) -> tuple[float, ...]:
    """Per worker: the weights of its stages plus the most activation bytes its actions hold at once (an ``F``
    takes its stage's, the ``B`` or ``W`` that finishes the minibatch there gives them back)."""
    from pipedream_ft.schedules import Kind

    out = []
    for rank in sorted(schedule):
        held = peak = 0.0
        for a in schedule[rank]:
            if a is None:
                continue
            if a.kind == Kind.F:
                held += activations[a.stage]
                peak = max(peak, held)
            elif a.kind in (Kind.B, Kind.W):  # a split backward's I keeps them for its W
                held -= activations[a.stage]
        out.append(sum(parameters[s] for s, r in placement.items() if r == rank) + peak)
    return tuple(out)


def choose(ranking: Sequence[Ranked], *, synchronous: bool = True) -> Ranked:
    """The fastest schedule that fits; PlanError naming the least memory needed if none does. ``synchronous``:
    among the synchronous schedules only (``flush`` mode: minibatch SGD, whatever the schedule), leaving out
    PipeDream's asynchronous 1F1B, which trains with stale weights and so learns otherwise."""
    ranking = [r for r in ranking if not (synchronous and r.name == "pipedream")]
    if not ranking:
        raise PlanError("no schedule to choose from")
    fitting = [r for r in ranking if r.fits]
    if not fitting:
        least = min(ranking, key=lambda r: r.peak_memory_bytes)
        raise PlanError(f"no schedule fits the memory limit: the least needs {least.peak_memory_bytes:.4g} bytes "
                        f"per worker ({least.name})")
    return min(fitting, key=lambda r: r.time_per_minibatch_s)


def format_ranking(ranking: Sequence[Ranked], chosen: str | None = None, *, microbatches: int | None = None) -> str:
    """A table of the ranking, the chosen schedule marked; with ``microbatches`` (per step) also each one's time
    per step (none for the asynchronous schedule, which steps every minibatch)."""
    rows = [("schedule", "ms/minibatch") + (("ms/step",) if microbatches else ()) +
            ("bubble", "peak memory/process", "")]
    for r in ranking:
        mark = "chosen" if r.name == chosen else ("" if r.fits else "does not fit")
        name = r.name + (" (async)" if r.name == "pipedream" else "") + \
            (f" ({r.stages_per_worker} stages/process)" if r.stages_per_worker > 1 else "")
        step = (("-" if r.name == "pipedream" else f"{r.time_per_minibatch_s * microbatches * 1e3:.3f}",)
                if microbatches else ())
        rows.append((name, f"{r.time_per_minibatch_s * 1e3:.3f}") + step +
                    (f"{r.bubble:.1%}", f"{r.peak_memory_bytes:.4g}", mark))
    last = len(rows[0]) - 1
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) if c in (0, last) else v.rjust(w)
                               for c, (v, w) in enumerate(zip(row, widths))).rstrip() for row in rows)
