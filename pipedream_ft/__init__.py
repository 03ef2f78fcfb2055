"""pipedream-ft: PipeDream's asynchronous 1F1B pipeline with weight stashing, with pluggable fault tolerance.

Typical use, in a script launched by ``torchrun``::

    from pipedream_ft import PipelineTrainer, PipelineConfig, CheckpointConfig, EveryNSteps, load_plan

    trainer = PipelineTrainer(model, load_plan("plan.json"), loss_fn=F.cross_entropy,
                              optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1),
                              checkpoint=CheckpointConfig(url="s3://bucket/run", policy=EveryNSteps(100)))
    trainer.fit(data, total=10_000)          # data(b) -> (inputs, targets) of minibatch b, or a DataLoader

The public names are resolved on first use (PEP 562), so that importing a torch-free part of the package
(``pipedream_ft.pool``, ``pipedream_ft.schedules``, ``pipedream_ft.errors``) does not import torch and the runtime.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partitioner.plan import Plan, PlanError, load_plan

    from .config import PipelineConfig, TrainResult
    from .env import DistEnv, read_env
    from .errors import JobError, PipelineError, PipelineSetupError
    from .ft.checkpointer import CheckpointConfig, Preempted
    from .ft.coordination import init_distributed, shutdown
    from .ft.replan import RePlanPolicy
    from .launch import launch
    from .pipeline.comm import PeerTimeoutError, ShapeMismatchError
    from .pipeline.compensation import Compensation
    from .pipeline.evaluate import EvalResult
    from .pipeline.hooks import Hooks
    from .pipeline.materialize import FromFile, SeededInit, materialize
    from .pipeline.precision import LossScale
    from .pipeline.sources import Epochs
    from .policies import (AllOf, AnyOf, CheckpointPolicy, EveryNSteps, EveryTSeconds, Never, OverheadBudget,
                           PreemptionHandler, YoungDaly)
    from .reporting import exit_on_error
    from .trainer import PipelineTrainer, RankStats

_WHERE = {
    "partitioner.plan": ("Plan", "PlanError", "load_plan"),
    ".env": ("DistEnv", "read_env"),
    ".errors": ("JobError", "PipelineError", "PipelineSetupError"),
    ".reporting": ("exit_on_error",),
    ".ft.checkpointer": ("CheckpointConfig", "Preempted"),
    ".ft.coordination": ("init_distributed", "shutdown"),
    ".ft.replan": ("RePlanPolicy",),
    ".launch": ("launch",),
    ".pipeline.comm": ("PeerTimeoutError", "ShapeMismatchError"),
    ".pipeline.evaluate": ("EvalResult",),
    ".pipeline.hooks": ("Hooks",),
    ".pipeline.materialize": ("FromFile", "SeededInit", "materialize"),
    ".pipeline.precision": ("LossScale",),
    ".pipeline.compensation": ("Compensation",),
    ".pipeline.sources": ("Epochs",),
    ".policies": ("AllOf", "AnyOf", "CheckpointPolicy", "EveryNSteps", "EveryTSeconds", "Never", "OverheadBudget",
                  "PreemptionHandler", "YoungDaly"),
    ".config": ("PipelineConfig", "TrainResult"),
    ".trainer": ("PipelineTrainer", "RankStats"),
}
"""The module each public name comes from (relative to this package, or absolute)."""

_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = [
    "AllOf",
    "AnyOf",
    "CheckpointConfig",
    "CheckpointPolicy",
    "Compensation",
    "DistEnv",
    "Epochs",
    "EvalResult",
    "EveryNSteps",
    "EveryTSeconds",
    "FromFile",
    "Hooks",
    "LossScale",
    "Never",
    "OverheadBudget",
    "PeerTimeoutError",
    "PipelineConfig",
    "PipelineError",
    "PipelineSetupError",
    "JobError",
    "PipelineTrainer",
    "Plan",
    "PlanError",
    "Preempted",
    "RePlanPolicy",
    "PreemptionHandler",
    "RankStats",
    "SeededInit",
    "ShapeMismatchError",
    "TrainResult",
    "YoungDaly",
    "exit_on_error",
    "init_distributed",
    "launch",
    "load_plan",
    "materialize",
    "read_env",
    "shutdown",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept here afterwards."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package, whose public names are not hidden by its submodules: importing the submodule
    ``pipedream_ft.launch`` sets the package's attribute ``launch`` to that module, which would hide the function
    ``pipedream_ft.launch`` (bound eagerly, it came after the submodule and won)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MODULE_OF and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
