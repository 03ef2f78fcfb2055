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


def plan_for(model: nn.Module, stage_layers: list[list[int]], replicas: list[int] | None = None) -> Plan:
    prof = structure_profile(model)
    return Plan.from_stages(stage_layers, replicas or [1] * len(stage_layers), profile_hash=prof.structure_hash(),
                            layer_names=[l.name for l in prof.layers])


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {"sgd": sgd, "adam": adam}
MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "skip": SkipNet}


def train_case(model_name: str, stage_layers: list[list[int]], replicas: list[int] | None, opt: str,
               steps: int, mode: str = "stash", flush_every: int = 4) -> dict[str, Any]:
    """Per-rank body: train and return the gathered weights, losses and stats."""
    from pipedream_ft.runtime import PipelineConfig, PipelineTrainer

    model = MODELS[model_name]()
    plan = plan_for(model, stage_layers, replicas)
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=OPTIMIZERS[opt],
                              config=PipelineConfig(mode=mode, flush_every=flush_every, timeout_s=60))
    result = trainer.train(data, steps)
    return {"state": trainer.full_state_dict(), "losses": result.losses, "stats": result.stats,
            "stage": trainer.stage_index}
