"""Online re-planning: when the costs measured while training say another plan would be faster, move to it.

Each rank measures its stage's compute time per minibatch (forward and backward, from the executor's
statistics) and publishes it to the job's store every ``every`` minibatches. Rank 0 (stage 0) then corrects
the profile with the measurements — the layers of each stage scaled so that their sum is the stage's measured
time (:func:`corrected_profile`) — plans again with the plan's own settings, and compares, under the corrected
costs, the current plan's predicted time per minibatch (:func:`plan_time`) with the new plan's: the slowest
stage's with one stage per process; with several stages per process (interleaved 1F1B, ZBV, DualPipeV: see
:mod:`pipedream_ft.virtual`) the busiest process's, the sum of its stages' compute, since a process runs its
stages one after another. When the new
one is at least ``min_gain`` faster (10 % by default), it logs both plans and the gain, stores the new plan
beside the checkpoints, and marks a checkpoint cut that stops the job; every process starts again on the new
plan and reshards the cut's checkpoint into it — the path an elastic resize takes, losing no update. Under
:func:`pipedream_ft.launch` the supervisors start the new processes (no torchrun restart is used).

Off by default: ``PipelineConfig(replan=RePlanPolicy())``. It needs the model's profile (``profile=``, or the
one stored with the checkpoints) and a durable checkpoint tier.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from partitioner.plan import Plan, PlanError
from profiler.profile import Profile

from ..checkpoint import Storage
from ..errors import EXIT_REPLAN, PipelineError
from .elastic import describe_plan, replan

__all__ = ["RePlanPolicy", "RePlanned", "corrected_profile", "plan_time", "processes_of", "load_replanned",
           "store_replanned", "Measurement", "consider"]

log = logging.getLogger(__name__)

REPLANS = "replans"
"""Directory, under the checkpoint URL, of stored re-plans: ``replans/<hash of the plan replaced>.json``."""


class RePlanned(PipelineError):
    """The job stops at a checkpoint cut to continue on a better plan."""

    exit_code = EXIT_REPLAN


@dataclass(frozen=True, slots=True)
class RePlanPolicy:
    """When to re-plan from measured costs."""

    min_gain: float = 0.10
    """Re-plan only if the new plan is predicted at least this much faster (0.10: 10 %)."""
    every: int = 20
    """Minibatches between measurements (and between decisions)."""
    after: int = 10
    """Minibatches to skip before measuring (the pipeline fills, caches warm up)."""
    max_replans: int = 3
    """Re-plans at most this many times in a job."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_gain) and self.min_gain >= 0):
            raise ValueError(f"min_gain must be a finite number >= 0, got {self.min_gain!r}")
        if self.every < 1 or self.after < 0 or self.max_replans < 0:
            raise ValueError(f"every must be >= 1, after and max_replans >= 0; got {self.every}, {self.after}, "
                             f"{self.max_replans}")


@dataclass(frozen=True, slots=True)
class Measurement:
    """One rank's stage compute time per minibatch, measured over ``minibatches`` minibatches."""

    stage: int
    compute_s: float
    minibatches: int

    def to_json(self) -> str:
        return json.dumps({"stage": self.stage, "compute_s": self.compute_s, "minibatches": self.minibatches})

    @staticmethod
    def from_json(text: str | bytes) -> Measurement:
        d = json.loads(text)
        return Measurement(int(d["stage"]), float(d["compute_s"]), int(d["minibatches"]))


def _stage_compute(profile: Profile, layers: tuple[int, ...]) -> float:
    return sum((profile.layers[i].forward_ms + profile.layers[i].backward_ms) / 1000.0 for i in layers)


def corrected_profile(profile: Profile, plan: Plan, measured: dict[int, float]) -> Profile:
    """``profile`` with the layers of each measured stage ``s`` scaled so that their compute adds up to
    ``measured[s]``, the seconds one of its replicas takes per minibatch it runs. A stage whose profile says it
    computes nothing keeps its layers as they are.
    Raises :class:`PlanError` on a measured time that is not a finite number >= 0."""
    layers = list(profile.layers)
    for s, seconds in measured.items():
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise PlanError(f"the measured compute time of stage {s} is {seconds!r}, not a finite number >= 0")
        stage = plan.stages[s]
        predicted = _stage_compute(profile, stage.layers)
        if predicted <= 0:
            continue
        factor = seconds / predicted
        for i in stage.layers:
            layer = layers[i]
            weight = layer.weight_backward_ms * factor if layer.weight_backward_ms is not None else None
            layers[i] = replace(layer, forward_ms=layer.forward_ms * factor, backward_ms=layer.backward_ms * factor,
                                weight_backward_ms=weight)
    return Profile(tuple(layers), profile.edges, dict(profile.meta), tied=profile.tied, inputs=profile.inputs,
                   keep_together=profile.keep_together)


def processes_of(plan: Plan, placement: Sequence[int] | None = None) -> list[int] | None:
    """The process of each stage of ``plan`` (``placement[s]``: the process that runs stage ``s``, a layout's
    :attr:`~pipedream_ft.schedules.WindowSchedule.placement`), or where the schedule of several stages per process
    the plan records places them (:func:`partitioner.report.placement_of`); ``None`` for one stage per process.
    Raises :class:`PlanError` for a placement that is not one process per stage."""
    if placement is None:
        from partitioner.report import placement_of

        where = placement_of(plan)
        return None if where is None else [where[s] for s in range(plan.num_stages)]
    where = [int(p) for p in placement]
    if len(where) != plan.num_stages:
        raise PlanError(f"the placement {where} places {len(where)} stages; the plan has {plan.num_stages}")
    return where


def plan_time(profile: Profile, plan: Plan, placement: Sequence[int] | None = None) -> float:
    """The predicted time per minibatch of ``plan`` under ``profile``'s costs, at the plan's outermost bandwidth;
    transfers as the plan predicted them (they do not depend on compute). One stage per process: the slowest
    stage's compute (and weight all-reduce, for a replicated stage). Several stages per process (``placement``,
    or the plan's recorded schedule, see :func:`processes_of`): the busiest process's, the sum of the compute of
    the stages it holds, which it runs one after another on one thread."""
    from partitioner import cost

    bandwidth = float(min(plan.settings.get("bandwidth") or [1e9]))
    times = []
    for stage in plan.stages:
        compute = _stage_compute(profile, stage.layers)
        params = sum(profile.layers[i].parameter_bytes for i in stage.layers)
        times.append(float(cost.stage_compute_time(compute, params, stage.replicas, bandwidth)))
    where = processes_of(plan, placement)
    if where is None:
        return max(times, default=0.0)
    busy: dict[int, float] = {}
    for s, t in enumerate(times):
        busy[where[s]] = busy.get(where[s], 0.0) + t
    return max(busy.values(), default=0.0)


def consider(profile: Profile, plan: Plan, measured: dict[int, float], world_size: int, min_gain: float,
             placement: Sequence[int] | None = None) -> tuple[Plan, float] | None:
    """The better plan and its predicted gain (``t_current / t_new - 1``, :func:`plan_time`) if the measured costs
    make one at least ``min_gain`` faster, else ``None``. A plan that cannot be made (memory) keeps the current one.
    ``placement``: the process of each stage, for several stages per process (see :func:`processes_of`); the new
    plan is then a straight one of as many stages (``world_size``), laid out the same way, and both are predicted
    per process, the new one balanced across the processes (:mod:`partitioner.balance`)."""
    corrected = corrected_profile(profile, plan, measured)
    where = processes_of(plan, placement)
    settings = plan.settings if where is None else {**plan.settings, "straight": True}
    if where is not None and len(where) != world_size:
        log.warning("re-planning: the layout places %d stages, not %d; keeping the current plan", len(where),
                    world_size)
        return None
    try:
        new = replan(corrected, world_size, settings, where)
    except PlanError as exc:
        log.warning("re-planning from the measured costs failed, keeping the current plan: %s", exc)
        return None
    current = plan_time(corrected, plan, where)
    candidate = plan_time(corrected, new, where)
    if candidate <= 0 or [s.layers for s in new.stages] == [s.layers for s in plan.stages] \
            and [s.replicas for s in new.stages] == [s.replicas for s in plan.stages]:
        return None
    gain = current / candidate - 1.0
    return (new, gain) if gain >= min_gain else None


def store_replanned(storage: Storage, old: Plan, new: Plan, old_hash: str) -> None:
    """Keep ``new`` beside the checkpoints as the plan that replaces the plan whose hash is ``old_hash``."""
    doc = {"replaces": old_hash, "from": describe_plan(old), "plan": new.to_json()}
    storage.write_bytes(f"{REPLANS}/{old_hash}.json", json.dumps(doc).encode())


def load_replanned(storage: Storage, plan: Plan, hash_of: Any) -> Plan:
    """The plan the job re-planned ``plan`` into (following re-plans of re-plans), or ``plan`` itself.
    ``hash_of(plan)`` identifies a plan as :func:`store_replanned` was given it."""
    seen = set()
    while True:
        key = hash_of(plan)
        if key in seen:
            return plan
        seen.add(key)
        try:
            doc = json.loads(storage.read_bytes(f"{REPLANS}/{key}.json"))
        except FileNotFoundError:
            return plan
        except Exception as exc:  # a damaged record: stay on the plan given
            log.warning("stored re-plan %s is unreadable (%s); keeping the plan given", key[:12], exc)
            return plan
        new = Plan.from_json(doc["plan"], source=f"{storage.url}/{REPLANS}/{key}.json")
        if new.profile_hash != plan.profile_hash or new.world_size != plan.world_size:
            return plan
        plan = new
