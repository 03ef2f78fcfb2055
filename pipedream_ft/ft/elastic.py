"""Elastic training: re-plan when the number of workers changes, and reshard a checkpoint into the new stages.

When torchrun restarts the group with another world size (``--nnodes=MIN:MAX``), the plan the job started with
no longer fits. The runtime then re-runs PipeDream's partitioner on the profile — the one given to the trainer,
or the copy stored with the checkpoints — for the new worker count, with the plan's own settings (bandwidth,
straight, memory limit). A hierarchical plan is re-planned as one level at its slowest bandwidth, since the new
workers' placement is unknown.

Checkpoint parts are addressable by layer: each part names its parameters (original model keys) and keeps its
optimizer state per parameter, so any partition can gather its layers' weights and optimizer state from
whichever old stages held them. At a re-plan the new pipeline starts from the checkpoint's weights: its warm-up
forwards use those weights (there is no stash of the old partition to reuse), and from then on PipeDream's
semantics hold for the new stage count.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Sequence

from partitioner.plan import Plan, PlanError
from profiler.profile import Profile, ProfileError

from ..checkpoint import CheckpointError, Storage
from ..errors import PipelineSetupError, say

__all__ = ["PROFILE_FILE", "replan", "replan_for_world", "store_profile", "load_stored_profile", "describe_plan"]

log = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
"""Where, under the checkpoint URL, the model's profile is kept for re-planning."""


def describe_plan(plan: Plan) -> str:
    """``"3 stages: [0-3]x1 [4-6]x2 [7-8]x1"``."""
    def ranges(idx: Sequence[int]) -> str:
        return f"{min(idx)}-{max(idx)}" if list(idx) == list(range(min(idx), max(idx) + 1)) else ",".join(map(str, idx))
    return f"{plan.num_stages} stages: " + " ".join(f"[{ranges(s.layers)}]x{s.replicas}" for s in plan.stages)


def replan(profile: Profile, world_size: int, settings: dict[str, Any],
           processes: Sequence[int] | None = None) -> Plan:
    """PipeDream's plan for ``world_size`` workers, with the original plan's ``settings``; ``processes``: the
    process of each of the ``world_size`` stages of a straight plan of several stages per process, balanced
    across them (see :func:`partitioner.optimizer.partition`)."""
    from partitioner.optimizer import partition

    if world_size < 1:
        raise PlanError(f"cannot plan for {world_size} workers")
    bandwidths = [float(b) for b in settings.get("bandwidth") or [1e9]]
    levels = [int(n) for n in settings.get("workers") or []]
    product = 1
    for n in levels:
        product *= n
    if levels and product == world_size:
        workers, bandwidth = levels, bandwidths
    else:
        workers, bandwidth = [world_size], [min(bandwidths)]
    memory = settings.get("memory_bytes")
    machine = None
    if settings.get("machine"):  # planned with measured costs: plan with them again where the levels still fit
        from partitioner.machine import MachineProfile

        machine = MachineProfile.from_json(settings["machine"], source="the plan's machine profile")
        if len(workers) != len(machine.levels):
            log.info("re-planning %d workers without the %d-level machine profile (one level now)", world_size,
                     len(machine.levels))
            machine = None
        else:
            bandwidth = machine.bandwidth
    if processes is not None and len(workers) != 1:  # several stages per process plan one level
        workers, bandwidth = [world_size], [min(bandwidth)]
        if machine is not None and len(machine.levels) != 1:
            machine = None
    straight = bool(settings.get("straight", False)) or processes is not None  # several per process: straight
    return partition(profile, workers, bandwidth, straight=straight,
                     memory_bytes=float(memory) if memory is not None else None, machine=machine,
                     processes=processes)


def replan_for_world(plan: Plan, profile: Profile | None, world_size: int, *, rank: int,
                     storage: Storage | None, processes: Sequence[int] | None = None) -> Plan:
    """``plan`` was made for another world size: plan again for ``world_size`` from ``profile``, or from the
    profile stored beside the checkpoints in ``storage``; rank 0 says what changed. Raises :class:`PlanError`
    with neither, :class:`PipelineSetupError` if the stored profile is another model's."""
    if profile is None:
        if storage is None:
            raise PlanError(f"plan needs {plan.world_size} workers, but the world size is {world_size} "
                            "(pass profile= to re-plan for the new size)")
        profile = load_stored_profile(storage)
        if profile.structure_hash() != plan.profile_hash:
            raise PipelineSetupError("the profile stored with the checkpoints is not this plan's model")
    new = replan(profile, world_size, plan.settings, processes)
    if rank == 0:
        msg = (f"world size {world_size} differs from the plan's {plan.world_size}: re-planned from "
               f"{describe_plan(plan)} to {describe_plan(new)}")
        log.warning(msg)
        say(f"pipedream-ft: {msg}", sys.stdout)
    return new


def store_profile(storage: Storage, profile: Profile) -> None:
    """Keep the profile beside the checkpoints (rank 0, at start), so a resized job can re-plan."""
    storage.write_bytes(PROFILE_FILE, json.dumps(profile.to_json()).encode())


def load_stored_profile(storage: Storage) -> Profile:
    """The profile stored beside the checkpoints; :class:`PipelineSetupError` if there is none or it is bad."""
    try:
        data = storage.read_bytes(PROFILE_FILE)
    except FileNotFoundError:
        raise PipelineSetupError(
            f"the world size changed, but {storage.url} stores no profile ({PROFILE_FILE}) to re-plan from; "
            "pass profile= to PipelineTrainer"
        ) from None
    except CheckpointError as exc:
        raise PipelineSetupError(f"cannot read the stored profile: {exc}") from None
    try:
        return Profile.from_json(json.loads(data), source=f"{storage.url}/{PROFILE_FILE}")
    except (ValueError, ProfileError) as exc:
        raise PipelineSetupError(f"the stored profile is unusable: {exc}") from None

