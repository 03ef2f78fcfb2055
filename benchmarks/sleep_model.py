"""A "sleep model" for runtime benchmarks: layers whose forward and backward take a fixed wall time.

Sleeping stands in for accelerator kernels: it takes time without taking a CPU core, so a pipeline of such
layers on one small machine behaves like one with a device per stage, and its ideal throughput is known
exactly (one minibatch per ``forward_ms + backward_ms`` of the slowest stage when nothing bubbles). Each layer
multiplies its input by a one-element learnable weight, so there are gradients and optimizer steps.

:class:`SplitSleepLayer` makes the two halves of a backward separately visible, for zero-bubble schedules that
split it: ``SleepInput(x) * SleepWeight(w)``, where only the input path's backward sleeps the input-gradient time
``I`` and only the weight path's the weight-gradient time ``W``. A backward that computes the input gradient only
sleeps ``I``; one that computes the weight gradient only sleeps ``W``; a whole backward sleeps both. Every sleep of
the split layers is counted in :data:`LEDGER` (per process).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

__all__ = ["SleepFunction", "SleepLayer", "sleep_model", "SleepInput", "SleepWeight", "SplitSleepLayer",
           "split_sleep_model", "LEDGER", "reset_ledger"]


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


# -- split backward: input gradient and weight gradient sleep apart ---------------------------------------------

LEDGER: dict[str, list[float]] = {"F": [0, 0.0], "I": [0, 0.0], "W": [0, 0.0]}
"""Sleeps of the split layers in this process: kind -> [count, seconds actually slept]."""


def reset_ledger() -> None:
    """Zero :data:`LEDGER`."""
    for v in LEDGER.values():
        v[0], v[1] = 0, 0.0


def _sleep(kind: str, ms: float) -> None:
    t0 = time.perf_counter()
    if ms > 0:
        time.sleep(ms / 1000.0)
    entry = LEDGER[kind]
    entry[0] += 1
    entry[1] += time.perf_counter() - t0


class SleepInput(torch.autograd.Function):
    """The input path: identity; the forward sleeps ``forward_ms`` (``F``), the backward ``input_ms`` (``I``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_ms: float, input_ms: float) -> torch.Tensor:
        _sleep("F", forward_ms)
        ctx.input_ms = input_ms
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        _sleep("I", ctx.input_ms)
        return grad, None, None


class SleepWeight(torch.autograd.Function):
    """The weight path: identity; the backward sleeps ``weight_ms`` (``W``)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, weight_ms: float) -> torch.Tensor:
        ctx.weight_ms = weight_ms
        return w.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        _sleep("W", ctx.weight_ms)
        return grad, None


class SplitSleepLayer(nn.Module):
    """``SleepInput(x) * SleepWeight(weight)``: forward ``F`` ms, input gradient ``I`` ms, weight gradient ``W`` ms.

    On a stage whose input needs no gradient (the first), nothing runs ``I``: only the weight's backward runs.
    """

    def __init__(self, forward_ms: float, input_ms: float, weight_ms: float) -> None:
        super().__init__()
        if min(forward_ms, input_ms, weight_ms) < 0:
            raise ValueError(f"sleep times must be >= 0, got {forward_ms}, {input_ms}, {weight_ms}")
        self.forward_ms, self.input_ms, self.weight_ms = float(forward_ms), float(input_ms), float(weight_ms)
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SleepInput.apply(x, self.forward_ms, self.input_ms) * SleepWeight.apply(self.weight, self.weight_ms)

    def extra_repr(self) -> str:
        return f"forward_ms={self.forward_ms:g}, input_ms={self.input_ms:g}, weight_ms={self.weight_ms:g}"


def split_sleep_model(layers: int = 4, forward_ms: float = 10.0, input_ms: float = 10.0,
                      weight_ms: float = 10.0) -> nn.Sequential:
    """``layers`` :class:`SplitSleepLayer` in a row (one per pipeline stage)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    return nn.Sequential(*(SplitSleepLayer(forward_ms, input_ms, weight_ms) for _ in range(layers)))
