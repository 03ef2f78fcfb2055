"""Single-process references for the pipeline runtime's semantics.

``weight_stashing_reference``: PipeDream's asynchronous semantics for an S-stage straight pipeline — the
forward and backward of minibatch b on stage s use that stage's weights after
``version(b, s)`` updates (``max(0, b - (S - 1 - s))`` for weight stashing, ``max(0, b - (S - 1))`` on every
stage for vertical sync), and stage s's update b applies that gradient to its latest weights.

``minibatch_sgd_reference``: plain synchronous SGD of the whole model over windows of K minibatches.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call

from partitioner.plan import Plan
from pipedream_ft.pipeline.executor import mix_seed as _mix
from pipedream_ft.pipeline.stage import build_stage, model_layers


def weight_stashing_reference(
    model: nn.Module,
    plan: Plan,
    data: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    steps: int,
    *,
    vertical: bool = False,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Final weights (original keys) and per-minibatch losses of PipeDream's semantics."""
    S = plan.num_stages
    stages = [build_stage(model_layers(model), plan, s) for s in range(S)]
    opts = [optimizer_factory(list(st.parameters())) for st in stages]

    def version(b: int, s: int) -> int:
        return max(0, b - (S - 1)) if vertical else max(0, b - (S - 1 - s))

    losses = _train_segment(stages, opts, 0, steps, version, data, loss_fn, seed)
    state: dict[str, torch.Tensor] = {}
    for st in stages:
        state.update({k: v.detach().clone() for k, v in st.state_dict().items()})
    return state, losses


def _train_segment(
    stages: list[nn.Module],
    opts: list[torch.optim.Optimizer],
    start: int,
    stop: int,
    version: Callable[[int, int], int],
    data: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    seed: int,
) -> list[float]:
    """Minibatches ``start .. stop-1`` one at a time through ``stages``: stage s's forward and backward of b use
    its weights after ``version(b, s)`` updates, then every stage applies update b. Returns the losses."""
    S = len(stages)
    names = [[n for n, _ in st.named_parameters()] for st in stages]
    live = [list(st.parameters()) for st in stages]
    versions: list[dict[int, list[torch.Tensor]]] = [{start: [p.detach().clone() for p in lv]} for lv in live]
    losses = []
    for b in range(start, stop):
        x: Any = data(b)[0]
        xs = list(x) if isinstance(x, (list, tuple)) else [x]
        used = []
        for s, st in enumerate(stages):
            params = [t.clone().requires_grad_(True) for t in versions[s][version(b, s)]]
            used.append(params)
            saved = torch.default_generator.get_state()
            torch.default_generator.manual_seed(_mix(seed, s, b))
            out = functional_call(st, dict(zip(names[s], params)), tuple(xs))
            torch.default_generator.set_state(saved)
            xs = list(out) if s < S - 1 else [out]
        loss = loss_fn(xs[0], data(b)[1])
        losses.append(float(loss.detach()))
        grads = torch.autograd.grad(loss, [t for ps in used for t in ps], allow_unused=True)
        k = 0
        for s in range(S):
            for p in live[s]:
                p.grad = None if grads[k] is None else grads[k].detach()
                k += 1
            opts[s].step()
            opts[s].zero_grad(set_to_none=True)
            versions[s][b + 1] = [p.detach().clone() for p in live[s]]
    return losses


def minibatch_sgd_reference(
    model: nn.Module,
    data: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    steps: int,
    window: int,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain training: one step per ``window`` minibatches, on the mean of their losses."""
    opt = optimizer_factory(list(model.parameters()))
    losses = []
    for w in range(steps // window):
        total = None
        for b in range(w * window, (w + 1) * window):
            x, y = data(b)
            loss = loss_fn(model(x), y)
            losses.append(float(loss.detach()))
            total = loss / window if total is None else total + loss / window
        assert total is not None
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def elastic_reference(
    model_fn: Callable[[], nn.Module],
    segments: list[tuple[Plan, int, int]],
    data: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    *,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Straight-pipeline weight stashing over a sequence of plans: ``segments[i] = (plan, start, stop)``.

    Each segment starts from the previous one's weights and per-parameter optimizer state; within it, stage s
    of its S stages uses the weights after max(start, b - (S - 1 - s)) updates for minibatch b (a re-planned
    pipeline has no older versions to stash from).
    """
    model = model_fn()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_state: dict[str, Any] = {}
    for plan, start, stop in segments:
        S = plan.num_stages
        m = model_fn()
        m.load_state_dict(weights)
        ml = model_layers(m)
        stages = [build_stage(ml, plan, s) for s in range(S)]
        names = [[n for n, _ in st.named_parameters()] for st in stages]
        live = [list(st.parameters()) for st in stages]
        opts = [optimizer_factory(p) for p in live]
        for s, opt in enumerate(opts):
            sd = opt.state_dict()
            sd["state"] = {i: opt_state[n] for i, n in enumerate(names[s]) if n in opt_state}
            opt.load_state_dict(sd)
        _train_segment(stages, opts, start, stop, lambda b, s: max(start, b - (S - 1 - s)), data, loss_fn, seed)
        for s, st in enumerate(stages):
            weights.update({k: v.detach().clone() for k, v in st.state_dict().items()})
            for i, entry in opts[s].state_dict()["state"].items():
                opt_state[names[s][i]] = entry
    return weights
