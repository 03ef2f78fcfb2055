"""A stage's backward, handed to autograd's engine the way ``torch.autograd.grad`` and ``backward`` hand it.

Those two functions first normalise their arguments in Python (a tensor or a sequence, implicit gradients, each
gradient's shape against its output's) before they call the engine: 0.05–0.08 ms a call on a 2-core machine, on
every backward of every stage. A stage's backward has its arguments in final form already (tuples of tensors),
so it calls torch's own ``_engine_run_backward`` directly, which keeps what torch does around the engine (its
debug logging hooks, the context it stashes for compiled autograd). The engine still checks each gradient's shape
against its output's. On a torch without that function, the public functions run.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

try:
    from torch.autograd.graph import _engine_run_backward as _run
except ImportError:  # pragma: no cover - another torch: the public functions
    _run = None

__all__ = ["grad", "backward"]


def _implicit(roots: Sequence[Any], grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """``grads`` with each ``None`` (a loss) replaced by ones, as torch makes it (a one-element output only)."""
    out = []
    for r, g in zip(roots, grads):
        if g is None:
            if r.numel() != 1:
                raise RuntimeError(f"grad can be implicitly created only for scalar outputs, got shape "
                                   f"{list(r.shape)}")
            g = torch.ones_like(r, memory_format=torch.preserve_format)
        out.append(g)
    return tuple(out)


def grad(roots: Sequence[Any], inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], *,
         retain_graph: bool = False) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(roots, inputs, grads, retain_graph=retain_graph, allow_unused=True)``; ``roots`` may
    be tensors or ``GradientEdge``s (whose gradients are given)."""
    if _run is None:  # pragma: no cover
        return torch.autograd.grad(list(roots), list(inputs), list(grads), retain_graph=retain_graph,
                                   allow_unused=True)
    return _run(tuple(roots), _implicit(roots, grads), retain_graph, False, tuple(inputs), True, False)


def backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
             inputs: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.backward(roots, grads, inputs=inputs)``: each input's gradient added into its ``grad``."""
    if _run is None:  # pragma: no cover
        torch.autograd.backward(list(roots), list(grads), inputs=list(inputs))
        return
    _run(tuple(roots), _implicit(roots, grads), False, False, tuple(inputs), True, True)
