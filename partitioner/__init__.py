"""PipeDream's partitioner: split a profiled model into (replicated) pipeline stages."""

from .antichain import AntichainStates, linearize
from .optimizer import partition
from .plan import PLAN_FORMAT, PLAN_VERSION, Plan, PlanError, PlanStage, load_plan

__all__ = [
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "Plan",
    "PlanError",
    "PlanStage",
    "load_plan",
    "partition",
    "linearize",
    "AntichainStates",
]
