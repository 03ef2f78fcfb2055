"""Models, data and per-rank scenarios shared by the runtime tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from partitioner.plan import Plan
from profiler.layers import structure_profile


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
        nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5),
    )


class SkipNet(nn.Module):
    """Not a Sequential: a skip connection that spans stages."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        g = torch.tanh(self.b(h))
        g = torch.tanh(self.c(g))
        return self.d(g + h)


def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + b)
    return torch.randn(6, 12, generator=g), torch.randint(0, 5, (6,), generator=g)


def plan_for(model: nn.Module, stage_layers: list[list[int]], replicas: list[int] | None = None,
             settings: dict | None = None) -> Plan:
    prof = structure_profile(model)
    return Plan.from_stages(stage_layers, replicas or [1] * len(stage_layers), profile_hash=prof.structure_hash(),
                            layer_names=[l.name for l in prof.layers], settings=settings)


def timed_profile(model: nn.Module):
    """The model's structure with made-up, deterministic costs (the same on every rank)."""
    from dataclasses import replace

    from profiler.profile import Profile

    prof = structure_profile(model)
    layers = tuple(replace(l, forward_ms=1.0 + (i % 3), backward_ms=2.0 + (i % 2), activation_bytes=4096.0)
                   for i, l in enumerate(prof.layers))
    return Profile(layers, prof.edges, dict(prof.meta))


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {"sgd": sgd, "adam": adam}
MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "skip": SkipNet}


def train_case(model_name: str, stage_layers: list[list[int]], replicas: list[int] | None, opt: str,
               steps: int, mode: str = "stash", flush_every: int = 4) -> dict[str, Any]:
    """Per-rank body: train and return the gathered weights, losses and stats."""
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = MODELS[model_name]()
    plan = plan_for(model, stage_layers, replicas)
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=OPTIMIZERS[opt],
                              config=PipelineConfig(mode=mode, flush_every=flush_every, timeout_s=60))
    result = trainer.train(data, steps)
    return {"state": trainer.full_state_dict(), "losses": result.losses, "stats": result.stats,
            "stage": trainer.stage_index}


def plain_training(steps: int) -> dict[str, Any]:
    """Reference for a one-stage pipeline: ordinary PyTorch training of the same model."""
    model = mlp()
    opt = sgd(list(model.parameters()))
    losses = []
    for b in range(steps):
        x, y = data(b)
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


def repeating_data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return data(b % 4)


def replicated_case(steps: int) -> list[float]:
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = mlp()
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6], [7, 8]], [2, 1, 1])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=adam,
                              config=PipelineConfig(timeout_s=60))
    return trainer.train(repeating_data, steps).losses


def bad_input_case(kind: str) -> None:
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model: nn.Module = mlp()
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6], [7, 8]])
    if kind == "world":
        plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]])
    elif kind == "model":
        model = nn.Sequential(*list(mlp())[:-1], nn.Linear(24, 7))
    elif kind == "shapes":
        model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(30, 5))
        plan = plan_for(model, [[0, 1], [2, 3], [4]])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=sgd,
                              config=PipelineConfig(timeout_s=30))
    trainer.train(data, 6)


def stuck_peer_case(stuck_rank: int) -> None:
    import os
    import time

    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = mlp()
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6], [7, 8]])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=sgd,
                              config=PipelineConfig(timeout_s=4))
    trainer.preflight(data)
    if int(os.environ["RANK"]) == stuck_rank:
        time.sleep(15)
        raise SystemExit(0)
    trainer.train(data, 12)
