"""Per-rank bodies for the fault-tolerance tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

from torch import nn

from runtime_cases import MODELS, OPTIMIZERS, data, plan_for, timed_profile


class Counter:
    """User state saved through ``extra_state``."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def checkpointed_case(url: str, stages: list[list[int]], replicas: list[int] | None, total: int,
                      stop_at: int | None, every: int, mode: str = "stash", opt: str = "adam",
                      elastic: bool = False, schedule: str = "1f1b") -> dict[str, Any]:
    """Train to ``total`` minibatches (or only to ``stop_at``, as if the job died there), checkpointing
    every ``every`` minibatches, resuming from ``url`` if it holds a checkpoint; ``schedule``: flush mode's."""
    from pipedream_ft import CheckpointConfig
    from pipedream_ft.policies import EveryNSteps
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = MODELS["mlp"]()
    settings = {"workers": [len(stages)], "bandwidth": [1e9], "straight": True} if elastic else None
    plan = plan_for(model, stages, replicas, settings)
    counter = Counter()
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=OPTIMIZERS[opt],
                              config=PipelineConfig(mode=mode, flush_every=4, timeout_s=60, schedule=schedule),
                              checkpoint=CheckpointConfig(url=url, policy=EveryNSteps(every), defer_when_behind=False),
                              extra_state={"counter": counter}, profile=timed_profile(model) if elastic else None)
    resumed = trainer.resumed_from
    target = stop_at if stop_at is not None else total
    result = trainer.train(data, target - trainer.position)
    counter.value += 1
    if trainer.ckpt is not None:
        trainer.ckpt.flush_durable(timeout=60)
    state = trainer.full_state_dict()
    trainer.close()
    return {"state": state, "losses": result.losses, "resumed": resumed, "counter": counter.value,
            "stages": [list(s.layers) for s in trainer.plan.stages], "position": trainer.position}


def elastic_bad_case(url: str, kind: str) -> None:
    """A resized start that cannot go on: no profile anywhere, or no plan fits the memory limit."""
    from pipedream_ft import CheckpointConfig
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = MODELS["mlp"]()
    settings = {"workers": [4], "bandwidth": [1e9], "straight": True}
    if kind == "memory":
        settings["memory_bytes"] = 1000.0
    plan = plan_for(model, [[0, 1], [2, 3], [4, 5], [6, 7, 8]], None, settings)
    PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=OPTIMIZERS["adam"],
                    config=PipelineConfig(timeout_s=30), checkpoint=CheckpointConfig(url=url),
                    profile=timed_profile(model) if kind == "memory" else None)


def start_case(url: str, model_name: str, storage_options: dict | None = None) -> None:
    """Start a 2-stage trainer with checkpointing at ``url`` (for bad-input tests: it should refuse)."""
    from pipedream_ft import CheckpointConfig
    from pipedream_ft import PipelineConfig, PipelineTrainer

    from pipedream_ft.policies import EveryNSteps
    from pipedream_ft.pipeline.stage import model_layers

    model = MODELS[model_name]()

    layers = list(range(len(model_layers(model).names)))
    plan = plan_for(model, [layers[: len(layers) // 2], layers[len(layers) // 2:]])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=OPTIMIZERS["sgd"],
                              config=PipelineConfig(timeout_s=30, summary=False),
                              checkpoint=CheckpointConfig(url=url, storage_options=storage_options,
                                                          policy=EveryNSteps(2)))
    trainer.fit(data, 4)
    trainer.close()
