"""Check a plan on one process before launching it: every stage in turn, handing over only what crosses.

:func:`check_plan` builds every stage of a plan exactly as the ranks will (:func:`build_stage`), runs them one
after another on an example minibatch, and between two stages keeps only what the runtime sends: the tensor
leaves of the crossing values, rebuilt on the other side from their structure (see
:mod:`pipedream_ft.pipeline.crossing`). The result, and the gradients of every parameter for a backward from
the output, must equal the undivided model's. It is the runtime's pre-flight, without processes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from partitioner.plan import Plan

from ..errors import PipelineSetupError
from .crossing import outgoing
from .stage import build_stage, model_layers

__all__ = ["check_plan"]


def _detach(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    return t.requires_grad_() if t.is_floating_point() else t


def check_plan(model: nn.Module, plan: Plan, inputs: Sequence[Any], *, atol: float = 1e-6, rtol: float = 1e-5
               ) -> None:
    """Run ``plan`` stage by stage on ``inputs`` (the model's positional inputs) and compare the output and
    the parameter gradients with the undivided ``model``, to ``atol`` plus ``rtol`` of the model's values: a stage
    receives its inputs as leaves that need gradients, and autograd may then pick kernels that round otherwise.
    Raises :class:`PipelineSetupError` naming the stage."""
    ml = model_layers(model)
    stages = [build_stage(ml, plan, s) for s in range(plan.num_stages)]
    for p in model.parameters():
        p.grad = None
    want = model(*inputs)
    want_leaves = [t for t in tree_leaves(want) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    roots = [t for t in want_leaves if t.requires_grad]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    want_grads = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    values: list[Any] = list(inputs)
    graphs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (received leaves, sent leaves) per stage
    out: Any = None
    received: list[torch.Tensor] = []  # stage 0 receives the model's inputs from the data, not from a stage
    for s, stage in enumerate(stages):
        try:
            out = stage(*values)
        except Exception as exc:
            raise PipelineSetupError(f"stage {s} of the plan cannot run on what stage {s - 1} sends: "
                                     f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        if s == plan.num_stages - 1:
            graphs.append((received, []))
            break
        crossing = outgoing(list(out), stage.output_names)
        if isinstance(crossing, list):
            raise PipelineSetupError(f"stage {s} would send values holding no tensor: {crossing}")
        structure, tensors = crossing
        graphs.append((received, tensors))
        received = [_detach(t) for t in tensors]
        values = structure.join(received)
    got_leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if len(got_leaves) != len(want_leaves) or any(g.shape != w.shape or not torch.allclose(g, w, rtol=rtol, atol=atol)
                                                  for g, w in zip(got_leaves, want_leaves)):
        raise PipelineSetupError("the plan's stages, run in turn, do not compute the model's output")
    # backward, stage by stage, the way the runtime does it: each stage differentiates its outputs with the
    # gradients the next stage computed for what it received
    pairs = [(t, torch.ones_like(t)) for t in got_leaves if t.requires_grad]
    for s in range(plan.num_stages - 1, -1, -1):
        received, _ = graphs[s]
        wrt = [t for t in received if t.requires_grad]
        params = list(stages[s].parameters())
        got: Sequence[Any] = (torch.autograd.grad([r for r, _ in pairs], wrt + params, [g for _, g in pairs],
                                                  allow_unused=True) if pairs else (None,) * (len(wrt) + len(params)))
        for p, g in zip(params, got[len(wrt):]):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        if s > 0:
            by_id = {id(t): g for t, g in zip(wrt, got[: len(wrt)])}
            sent = graphs[s - 1][1]
            pairs = [(t, by_id[id(r)]) for t, r in zip(sent, received)
                     if t.requires_grad and by_id.get(id(r)) is not None]
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        name = names[id(p)]
        w, g = want_grads[name], p.grad
        if (w is None) != (g is None) or (w is not None and not torch.allclose(g, w, rtol=rtol, atol=atol)):
            raise PipelineSetupError(f"parameter {name}: the staged backward's gradient differs from the model's")
    for p in model.parameters():
        p.grad = None
