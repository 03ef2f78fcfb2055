"""pipedream-ft: PipeDream's asynchronous 1F1B pipeline with weight stashing, with pluggable fault tolerance.

Typical use, in a script launched by ``torchrun``::

    from pipedream_ft import PipelineTrainer, PipelineConfig, CheckpointConfig, EveryNSteps, load_plan

    trainer = PipelineTrainer(model, load_plan("plan.json"), loss_fn=F.cross_entropy,
                              optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1),
                              checkpoint=CheckpointConfig(url="s3://bucket/run", policy=EveryNSteps(100)))
    trainer.fit(data, total=10_000)          # data(b) -> (inputs, targets) of minibatch b, or a DataLoader
"""

from partitioner.plan import Plan, PlanError, load_plan

from .env import DistEnv, read_env
from .errors import JobError, PipelineError, PipelineSetupError
from .reporting import exit_on_error
from .ft.checkpointer import CheckpointConfig, Preempted
from .ft.coordination import init_distributed, shutdown
from .ft.replan import RePlanPolicy
from .launch import launch
from .pipeline.comm import PeerTimeoutError, ShapeMismatchError
from .pipeline.evaluate import EvalResult
from .pipeline.hooks import Hooks
from .pipeline.materialize import FromFile, SeededInit, materialize
from .pipeline.precision import LossScale
from .pipeline.compensation import Compensation
from .pipeline.sources import Epochs
from .policies import (AllOf, AnyOf, CheckpointPolicy, EveryNSteps, EveryTSeconds, Never, OverheadBudget,
                       PreemptionHandler, YoungDaly)
from .config import PipelineConfig, TrainResult
from .trainer import PipelineTrainer, RankStats

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
