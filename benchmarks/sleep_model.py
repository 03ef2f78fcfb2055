"""A "sleep model" for runtime benchmarks: layers whose forward and backward take a fixed wall time.

Sleeping stands in for accelerator kernels: it takes time without taking a CPU core, so a pipeline of such
layers on one small machine behaves like one with a device per stage, and its ideal throughput is known
exactly (one minibatch per ``forward_ms + backward_ms`` of the slowest stage when nothing bubbles). Each layer
multiplies its input by a one-element learnable weight, so there are gradients and optimizer steps.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

__all__ = ["SleepFunction", "SleepLayer", "sleep_model"]


class SleepFunction(torch.autograd.Function):
    """``x * w``; the forward sleeps ``forward_ms``, the backward ``backward_ms``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, forward_ms: float, backward_ms: float) -> torch.Tensor:
        time.sleep(forward_ms / 1000.0)
        ctx.save_for_backward(x, w)
        ctx.backward_ms = backward_ms
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        time.sleep(ctx.backward_ms / 1000.0)
        x, w = ctx.saved_tensors
        grad_x = grad * w if ctx.needs_input_grad[0] else None
        grad_w = (grad * x).sum().reshape(1) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


class SleepLayer(nn.Module):
    """One layer of the sleep model: ``x * weight`` taking ``forward_ms`` forward and ``backward_ms`` backward."""

    def __init__(self, forward_ms: float, backward_ms: float) -> None:
        super().__init__()
        if forward_ms < 0 or backward_ms < 0:
            raise ValueError(f"sleep times must be >= 0, got {forward_ms}, {backward_ms}")
        self.forward_ms = float(forward_ms)
        self.backward_ms = float(backward_ms)
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SleepFunction.apply(x, self.weight, self.forward_ms, self.backward_ms)

    def extra_repr(self) -> str:
        return f"forward_ms={self.forward_ms:g}, backward_ms={self.backward_ms:g}"


def sleep_model(layers: int = 4, forward_ms: float = 20.0, backward_ms: float = 40.0) -> nn.Sequential:
    """``layers`` :class:`SleepLayer` in a row (one per pipeline stage in the benchmark)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    return nn.Sequential(*(SleepLayer(forward_ms, backward_ms) for _ in range(layers)))
