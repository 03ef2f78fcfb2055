"""An optimizer's step and ``zero_grad`` without torch's per-call wrapper when nothing listens to it.

``torch.optim.Optimizer`` wraps every ``step`` in a profiler range, its pre- and post-hooks and a profiler entry
point, and every ``zero_grad`` in another range: on a small stage that costs more than the step itself (measured
on the CPU: 150 µs for an SGD step and ``zero_grad`` through the wrappers, 60 µs without), and PipeDream's
asynchronous modes step once per minibatch. When no hook is registered (on the optimizer or globally), the
optimizer's ``step`` is not replaced on the instance (an LR scheduler counts steps that way), ``zero_grad`` is
torch's own and no profiler is running, :func:`step` calls the wrapped function itself and :func:`zero_grad`
drops the gradients; otherwise both call the optimizer as usual, so what a user registered or profiles sees
every step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim import Optimizer

try:  # torch's registries of global step hooks (private; without them every step takes the wrapper)
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
except ImportError:  # pragma: no cover - other torch versions
    _global_optimizer_pre_hooks = _global_optimizer_post_hooks = None  # type: ignore[assignment]

__all__ = ["step", "zero_grad"]


def _listened(optimizer: Optimizer) -> bool:
    """Whether something observes this optimizer's steps: hooks, a profiler, or a ``step`` set on the instance."""
    if _global_optimizer_pre_hooks is None or _global_optimizer_pre_hooks or _global_optimizer_post_hooks:
        return True
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None):
        return True
    return "step" in vars(optimizer) or torch.autograd._profiler_enabled()


def step(optimizer: Optimizer) -> None:
    """``optimizer.step()``: straight to the optimizer's own step when nothing listens (see the module docstring)."""
    wrapper: Any = getattr(type(optimizer), "step", None)
    raw: Callable[[Optimizer], Any] | None = getattr(wrapper, "__wrapped__", None) \
        if getattr(wrapper, "hooked", False) else None
    if raw is None or _listened(optimizer):
        optimizer.step()
    else:
        raw(optimizer)


def zero_grad(optimizer: Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``: the gradients dropped directly when the optimizer keeps torch's
    own ``zero_grad`` and no profiler is running."""
    if type(optimizer).zero_grad is not Optimizer.zero_grad or "zero_grad" in vars(optimizer) \
            or torch.autograd._profiler_enabled():
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
