"""The learning-rate scheduler of a stage: built on its optimizer, stepped after each update, checkpointed.

``PipelineTrainer(..., scheduler_factory=lambda optimizer: torch.optim.lr_scheduler.X(optimizer, ...))``:
each stage with parameters builds one scheduler on its own optimizer (a stage without parameters has no
optimizer and no scheduler) and steps it, without arguments, after every update of that stage — also after an
update skipped for a float16 overflow, as in the usual ``scaler.step(); scaler.update(); scheduler.step()``
loop. A stage updates once per update *round*: per minibatch on an unreplicated stage in the asynchronous
modes, per ``R`` minibatches on a stage with ``R`` replicas, per window in ``"flush"`` mode; so with equal
replica counts all stages follow the same schedule.

The scheduler's ``state_dict()`` is in the stage's checkpoint part (:class:`SchedulerComponent`) and
restored with it. On an elastic reshard a new stage takes the scheduler state of the first old stage that
held any of its layers and had one (stages with equal replica counts have stepped equally often, so their
states agree).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import torch

from ..errors import PipelineSetupError
from .state import OptimizerFactory, StageState

__all__ = ["SchedulerComponent", "SchedulerFactory", "attach_scheduler", "build_scheduler"]

log = logging.getLogger(__name__)

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def build_scheduler(factory: SchedulerFactory, optimizer: torch.optim.Optimizer) -> Any:
    """``factory(optimizer)``, checked: it must checkpoint (``state_dict``/``load_state_dict``) and step without
    a metric. Raises :class:`PipelineSetupError` naming it otherwise."""
    scheduler = factory(optimizer)
    name = type(scheduler).__name__
    if not (callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))):
        raise PipelineSetupError(f"scheduler_factory made a {name}, which has no state_dict() and load_state_dict(); "
                                 "it cannot be checkpointed")
    if not callable(getattr(scheduler, "step", None)):
        raise PipelineSetupError(f"scheduler_factory made a {name}, which has no step()")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise PipelineSetupError(f"scheduler_factory made a {name}, whose step() needs a metric; the pipeline steps "
                                 "its scheduler after every update, without arguments")
    return scheduler


class SchedulerComponent:
    """The scheduler's state in the checkpoint part (see the module docstring)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self) -> None:
        self.scheduler.step()

    def capture(self, cut: int) -> Any:
        return copy.deepcopy(self.scheduler.state_dict())

    def restore(self, value: Any) -> None:
        if value is None:
            log.warning("the checkpoint has no LR scheduler state (it was written without scheduler_factory); "
                        "the scheduler starts from its beginning")
            return
        self.scheduler.load_state_dict(value)

    def reshard(self, values: list[Any]) -> None:
        self.restore(next((v for v in values if v is not None), None))


def attach_scheduler(state: StageState, factory: SchedulerFactory | None, optimizer_factory: OptimizerFactory
                     ) -> SchedulerComponent | None:
    """Build ``state``'s scheduler and register it as the ``"scheduler"`` component; ``None`` without a factory or
    an optimizer. A stage without parameters still checks the factory, on a stand-in optimizer, so that a bad
    factory stops every rank alike."""
    if factory is None:
        return None
    optimizer = state.optimizer or optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    scheduler = build_scheduler(factory, optimizer)
    if state.optimizer is None:
        return None
    component = SchedulerComponent(scheduler)
    state.components["scheduler"] = component
    return component
