"""Virtual stages: the layouts that give one process several stages of the plan (interleaved 1F1B, ZBV, DualPipeV).

``PipelineTrainer(model, plan, config=PipelineConfig(mode="flush", schedule="interleaved_1f1b"))`` on ``W``
processes, with a plan of ``S = v W`` stages, gives each process ``v`` stages (where the schedule places them:
stage ``s`` on rank ``s % W`` for the looped schedules; ``r`` and ``2W - 1 - r`` for the V schedules).

A process is still one rank of ``W`` (one set of process groups, one store connection, one thread that trains)
and holds one executor per stage (:class:`~pipedream_ft.trainer.PipelineTrainer`). It runs the *process's*
lowered action list (:func:`process_actions`): the schedule's ``rank_actions`` with the sends and receives that
:func:`~pipedream_ft.schedules.add_communication` adds between processes, receives moved early; each action goes
to its stage's executor, in that order and no other. Two neighbouring stages of one process exchange nothing: the
activation and its gradient are handed over in memory (:mod:`~pipedream_ft.pipeline.colocated`), so nothing asks
NCCL for two ranks on one GPU and the V schedules run under NCCL too. A window's updates run together: the
all-reduce of gradient norms and overflow flags (clipping, float16 loss scaling) is one for the process, and tied
weights whose holders share the process (the V schedules put the first and the last stage together) apply their
update once every holder has given its gradient. Every fault-tolerance path is the process's: one checkpoint
part per stage, in-place recovery bringing back every stage of a replaced process.

This module holds the layouts (pure, no process groups): which stages a process runs, the stage-numbered plan
its stages' topologies read, the process's lowered list, and the message streams between processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

from partitioner.plan import Plan, PlanError

from .pipeline.executor import RankStats
from .schedules.actions import Action
from .schedules.comms import add_communication, iter_lower_rank, lower_rank, post_receives_early
from .schedules.window import VIRTUAL, WindowSchedule, virtual_schedule

__all__ = ["iter_process_actions", "merged_stats", "process_actions", "runs_virtual", "stage_links", "stage_plan",
           "stages_per_process", "virtual_layout"]

_V_SHAPED = ("zbv", "dualpipev")


def runs_virtual(schedule: Any) -> bool:
    """Whether ``schedule`` (a config's, ``"plan"`` resolved) gives a process several stages."""
    return (isinstance(schedule, str) and schedule in VIRTUAL) or (isinstance(schedule, WindowSchedule)
                                                                   and schedule.virtual)


def stages_per_process(schedule: str | WindowSchedule, plan: Plan, world_size: int) -> int:
    """How many stages each of ``world_size`` processes runs under ``schedule``: 2 for the V schedules, a table's
    own; for the looped ones the plan's share when it divides evenly, else what ``pipedream-partition`` planned it
    for (``settings["schedule"]["stages_per_worker"]``), else 2."""
    if isinstance(schedule, WindowSchedule):
        return schedule.num_stages // schedule.num_ranks
    if schedule in _V_SHAPED:
        return 2
    if plan.num_stages % world_size == 0 and plan.num_stages >= 2 * world_size:
        return plan.num_stages // world_size
    record = plan.settings.get("schedule")
    planned = record.get("stages_per_worker") if isinstance(record, dict) else None
    return planned if isinstance(planned, int) and planned >= 2 else 2


def virtual_layout(schedule: Any, plan: Plan, world_size: int, flush_every: int) -> WindowSchedule | None:
    """The schedule of several stages per process that ``schedule`` (a config's, ``"plan"`` resolved) gives
    ``plan`` on ``world_size`` processes; ``None`` for a schedule of one stage per process. Raises
    :class:`PlanError` when the plan's stages cannot be laid out that way."""
    if isinstance(schedule, str) and schedule in VIRTUAL:
        stages = plan.num_stages
        if schedule in _V_SHAPED:
            if stages != 2 * world_size:
                raise PlanError(f"schedule {schedule!r} runs 2 stages per process in a V: the plan has {stages} "
                                f"stages for {world_size} processes (plan {2 * world_size})")
            per_rank = None
        else:
            if stages % world_size or stages // world_size < 2:
                raise PlanError(f"schedule {schedule!r} runs v >= 2 stages per process: the plan has {stages} "
                                f"stages for {world_size} processes (plan a multiple of {world_size}, at least "
                                f"{2 * world_size})")
            per_rank = stages // world_size
        try:
            return virtual_schedule(schedule, world_size, flush_every, per_rank)
        except ValueError as exc:
            raise PlanError(f"schedule {schedule!r} on {world_size} processes: {exc}") from None
    if isinstance(schedule, WindowSchedule) and schedule.virtual:
        if schedule.num_ranks != world_size or schedule.num_stages != plan.num_stages:
            raise PlanError(f"the schedule {schedule} runs {schedule.num_stages} stages on {schedule.num_ranks} "
                            f"ranks; the plan has {plan.num_stages} stages and the job {world_size} processes")
        return schedule
    return None


def stage_plan(plan: Plan) -> Plan:
    """``plan`` with stage ``s`` on "rank" ``s``: the stages' own numbering, which a stage's messenger maps to the
    processes that hold them (:class:`~pipedream_ft.pipeline.colocated.StageRoute`). Refuses replicated stages."""
    replicated = [s.index for s in plan.stages if s.replicas != 1]
    if replicated:
        raise PlanError(f"virtual stages run a straight pipeline; the plan replicates stages {replicated}")
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, ranks=(s.index,)) for s in plan.stages))


def process_actions(layout: WindowSchedule, rank: int, start: int, stop: int) -> list[Action]:
    """What process ``rank`` runs for minibatches ``[start, stop)``: its stages' actions in the schedule's order,
    with the sends and receives between processes (none between its own stages), receives posted early."""
    placement = dict(enumerate(layout.placement))
    mine = lower_rank(rank, layout.rank_actions(rank, start, stop), placement)  # from this process's list alone
    if mine is not None:
        return mine
    every = {r: layout.rank_actions(r, start, stop) for r in range(layout.num_ranks)}
    lowered = add_communication(every, placement)
    return post_receives_early({rank: lowered[rank]})[rank]


def iter_process_actions(layout: WindowSchedule, rank: int, start: int, stop: int) -> Iterator[Action]:
    """:func:`process_actions`, made as they are run (see :meth:`~pipedream_ft.pipeline.modes.Mode.iter_lowered`):
    whether each stage runs its backwards in its forwards' order is read from two windows."""
    placement = dict(enumerate(layout.placement))
    sample = layout.rank_actions(rank, start, min(stop, start + 2 * layout.microbatches))
    mine = iter_lower_rank(rank, layout.iter_rank_actions(rank, start, stop), placement, sample)
    return mine if mine is not None else iter(process_actions(layout, rank, start, stop))


def stage_links(placement: Sequence[int], mine: Sequence[int], tied: Sequence[Sequence[int]] = ()
                ) -> list[tuple[int, str]]:
    """``(peer rank, link)`` of every message stream between stages ``mine`` (of the process that holds them) and
    the stages of other processes, stage ``s`` running on rank ``placement[s]``: activations and gradients
    between neighbours, targets from the first stage to the last, tied gradients between the holders of each
    group of ``tied`` stages. A link is named by its channel and the stage that sends on it (``"act:2"``,
    ``"grad:3"``, see :class:`~pipedream_ft.pipeline.comm.Messenger`); under NCCL each gets a communicator of its
    own. Both ends of a stream list it."""
    last = len(placement) - 1
    here = set(mine)
    out: set[tuple[int, str]] = set()
    for s in here:
        for n, act, grad in ((s + 1, s, s + 1), (s - 1, s - 1, s)):
            if 0 <= n <= last and n not in here:
                out |= {(placement[n], f"act:{act}"), (placement[n], f"grad:{grad}")}
    if (0 in here) != (last in here):
        out.add((placement[last] if 0 in here else placement[0], "tgt:0"))
    for holders in tied:
        for s in set(holders) & here:
            for p in set(holders) - here:
                out |= {(placement[p], f"tied:{s}"), (placement[p], f"tied:{p}")}
    return sorted(out)


def merged_stats(parts: Sequence[RankStats]) -> RankStats:
    """A process's time over its stages: the times add up, the stash peaks too (each stage holds its own)."""
    out = RankStats()
    for p in parts:
        out.forward_s += p.forward_s
        out.backward_s += p.backward_s
        out.update_s += p.update_s
        out.wait_s += p.wait_s
        out.peak_stash_versions += p.peak_stash_versions
        out.peak_stash_bytes += p.peak_stash_bytes
    out.minibatches = parts[0].minibatches if parts else 0
    return out
