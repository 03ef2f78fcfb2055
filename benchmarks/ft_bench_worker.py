"""The model the fault-tolerance benchmarks share (:mod:`bench_checkpoint`, :mod:`bench_recovery`).

An MLP of ``blocks`` ``Linear(width, width) + ReLU`` blocks and a small head, seeded so that every rank builds the
same one, a straight plan giving each stage an equal share of the blocks, cheap fixed data, and the optimizers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["mlp", "mlp_plan", "make_data", "make_optimizer"]


def mlp(width: int = 1024, blocks: int = 10, classes: int = 16) -> nn.Sequential:
    """``blocks`` x (Linear(width, width), ReLU), then Linear(width, classes); seeded, so every rank agrees."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def mlp_plan(model: nn.Sequential, stages: int) -> Any:
    """A straight plan that gives each stage an equal share of the blocks (the head goes to the last)."""
    from partitioner.plan import Plan
    from profiler.layers import structure_profile

    n_blocks = (len(model) - 1) // 2
    if stages < 1 or stages > n_blocks:
        raise ValueError(f"cannot split {n_blocks} blocks into {stages} stages")
    bounds = [round(i * n_blocks / stages) for i in range(stages + 1)]
    stage_layers = [list(range(2 * bounds[i], 2 * bounds[i + 1])) for i in range(stages)]
    stage_layers[-1].append(len(model) - 1)
    prof = structure_profile(model)
    return Plan.from_stages(stage_layers, [1] * stages, profile_hash=prof.structure_hash(),
                            layer_names=[layer.name for layer in prof.layers])


def make_data(batch: int, width: int, classes: int = 16, distinct: int = 8) -> Callable[[int], tuple[Any, Any]]:
    """``data(b)``: ``distinct`` fixed random minibatches, cycled (so producing one costs nothing)."""
    g = torch.Generator().manual_seed(1234)
    xs = [torch.randn(batch, width, generator=g) for _ in range(distinct)]
    ys = [torch.randint(0, classes, (batch,), generator=g) for _ in range(distinct)]

    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return xs[b % distinct], ys[b % distinct]

    return data


def make_optimizer(name: str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``"sgd"`` (momentum 0.9: one state tensor per weight) or ``"adam"`` (two)."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=1e-4)
    raise ValueError(f"unknown optimizer {name!r}")

