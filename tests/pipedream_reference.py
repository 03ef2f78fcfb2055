"""Single-process references for the pipeline runtime's semantics.

``weight_stashing_reference``: PipeDream's asynchronous semantics for an S-stage straight pipeline — the
forward and backward of minibatch b on stage s use that stage's weights after
``version(b, s)`` updates (``max(0, b - (S - 1 - s))`` for weight stashing, ``max(0, b - (S - 1))`` on every
stage for vertical sync), and stage s's update b applies that gradient to its latest weights.

``two_bw_reference``: PipeDream-2BW — minibatches in windows of m; every stage's forward and backward of a
minibatch of window k use its weights after ``max(0, k - 1)`` updates, and update k applies the window's mean
gradient to the latest weights.

Both take a delay ``compensation``: each stage's update u of delay d (``S - 1 - s`` for stashing, ``S - 1`` for
vertical sync, 1 for 2BW) runs with the learning rate times ``1 / (1 + d)`` (or ``(1 + d) ** -(1 - min(u / K, 1))``
with a warm-up of K updates), and with weight prediction the version it publishes is ``w + (w - w_before) * d``
(the weights read by forwards and backwards), the update itself applying to the real weights ``w``; with
look-ahead it is ``w + (w - w_before) * (beta + ... + beta**d)``, ``beta`` the momentum of the parameter's optimizer
group (``betas[0]`` or ``momentum``); with error feedback ``lam``, each gradient of update u, taken on the version
``w_stale`` its minibatches read, is replaced by ``g + lam * g * g * (w - w_stale)`` (``w`` the weights it is
applied to) before the step.

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
    compensation: Any = None,
    on_update: Callable[[int, list[nn.Module]], None] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Final weights (original keys) and per-minibatch losses of PipeDream's semantics. ``on_update(n, stages)``
    is called after each update with the number of minibatches trained and the stage modules (live weights).

    A parameter used by several stages (tied) is one parameter with its own optimizer; every holder reads it
    at the version its first holder's stage would read its own weights, and its update ``b`` applies the sum
    of the holders' gradients, added in stage order."""
    S = plan.num_stages
    stages = [build_stage(model_layers(model), plan, s) for s in range(S)]
    _, tied = _split_tied(stages)
    opts = [optimizer_factory(own) if own else None for own in _split_tied(stages)[0]]
    tied_opts = [optimizer_factory([p]) for p, _ in tied]

    def version(b: int, s: int) -> int:
        return max(0, b - (S - 1)) if vertical else max(0, b - (S - 1 - s))

    delays = [S - 1 if vertical else S - 1 - s for s in range(S)]
    losses = _train_segment(stages, opts, 0, steps, version, data, loss_fn, seed, tied_opts, delays=delays,
                            compensation=compensation, on_update=on_update)
    state: dict[str, torch.Tensor] = {}
    for st in stages:
        state.update({k: v.detach().clone() for k, v in st.state_dict().items()})
    return state, losses


def two_bw_reference(
    model: nn.Module,
    plan: Plan,
    data: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    steps: int,
    every: int,
    *,
    seed: int = 0,
    compensation: Any = None,
    on_update: Callable[[int, list[nn.Module]], None] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Final weights and per-minibatch losses of PipeDream-2BW with update interval ``every`` (``on_update`` as in
    :func:`weight_stashing_reference`). A tied parameter is
    read at its window's version like every weight, and its update ``k`` applies the sum of its holders' window
    gradients, added in stage order."""
    S = plan.num_stages
    stages = [build_stage(model_layers(model), plan, s) for s in range(S)]
    own, tied = _split_tied(stages)
    opts = [optimizer_factory(p) if p else None for p in own]
    tied_opts = [optimizer_factory([p]) for p, _ in tied]
    losses = _train_segment(stages, opts, 0, steps, lambda b, s: max(0, b // every - 1), data, loss_fn, seed,
                            tied_opts, every=every, delays=[1] * S, compensation=compensation, on_update=on_update)
    state: dict[str, torch.Tensor] = {}
    for st in stages:
        state.update({k: v.detach().clone() for k, v in st.state_dict().items()})
    return state, losses


def _lr_factor(compensation: Any, delay: int, update: int) -> float:
    if compensation is None or not compensation.lr_scale or delay == 0:
        return 1.0
    if compensation.lr_warmup:
        return float((1 + delay) ** -(1.0 - min(update / compensation.lr_warmup, 1.0)))
    return 1.0 / (1 + delay)


def _split_tied(stages: list[nn.Module]) -> tuple[list[list[nn.Parameter]], list[tuple[nn.Parameter, list[int]]]]:
    """Each stage's own parameters, and the tied ones with their holder stages."""
    holders: dict[int, list[int]] = {}
    objects: dict[int, nn.Parameter] = {}
    for s, st in enumerate(stages):
        for p in st.parameters():
            holders.setdefault(id(p), []).append(s)
            objects[id(p)] = p
    own = [[p for p in st.parameters() if len(holders[id(p)]) == 1] for st in stages]
    tied = [(objects[i], h) for i, h in holders.items() if len(h) > 1]
    return own, tied


def _train_segment(
    stages: list[nn.Module],
    opts: list[torch.optim.Optimizer | None],
    start: int,
    stop: int,
    version: Callable[[int, int], int],
    data: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    seed: int,
    tied_opts: list[torch.optim.Optimizer] | None = None,
    *,
    every: int = 1,
    delays: list[int] | None = None,
    compensation: Any = None,
    on_update: Callable[[int, list[nn.Module]], None] | None = None,
) -> list[float]:
    """Minibatches ``start .. stop-1`` one at a time through ``stages``: stage s's forward and backward of b use
    its weights after ``version(b, s)`` updates; after each window of ``every`` minibatches every stage applies its
    update on the window's mean gradient (``every=1``: update b on b's gradient), with ``compensation`` over the
    stage's delay ``delays[s]``. Returns the losses."""
    S = len(stages)
    delays = delays or [0] * S
    predict = compensation is not None and compensation.predict
    lookahead = compensation is not None and getattr(compensation, "lookahead", False)
    lam = float(getattr(compensation, "error_feedback", 0.0)) if compensation is not None else 0.0
    own, tied = _split_tied(stages)
    tied_ids = {id(p) for p, _ in tied}
    names = [[n for n, p in st.named_parameters() if id(p) not in tied_ids] for st in stages]
    tied_names = [{s: next(n for n, q in stages[s].named_parameters() if q is p) for s in h} for p, h in tied]
    first = start // every
    versions: list[dict[int, list[torch.Tensor]]] = [{first: [p.detach().clone() for p in lv]} for lv in own]
    acc: list[list[torch.Tensor | None]] = [[None] * len(lv) for lv in own]
    tversions: list[dict[int, torch.Tensor]] = [{first: p.detach().clone()} for p, _ in tied]
    tacc: list[dict[int, torch.Tensor]] = [{} for _ in tied]
    losses = []
    for b in range(start, stop):
        x: Any = data(b)[0]
        xs = list(x) if isinstance(x, (list, tuple)) else [x]
        used = []
        tied_used: list[dict[int, torch.Tensor]] = [{} for _ in tied]
        for s, st in enumerate(stages):
            params = [t.clone().requires_grad_(True) for t in versions[s][version(b, s)]]
            used.append(params)
            given = dict(zip(names[s], params))
            for t, (p, h) in enumerate(tied):
                if s in h:
                    leaf = tversions[t][version(b, h[0])].clone().requires_grad_(True)
                    tied_used[t][s] = leaf
                    given[tied_names[t][s]] = leaf
            saved = torch.default_generator.get_state()
            torch.default_generator.manual_seed(_mix(seed, s, b))
            out = functional_call(st, given, tuple(xs))
            torch.default_generator.set_state(saved)
            xs = list(out) if s < S - 1 else [out]
        loss = loss_fn(xs[0], data(b)[1])
        losses.append(float(loss.detach()))
        if every != 1:
            loss = loss * (1.0 / every)
        leaves = [t for ps in used for t in ps] + [leaf for d in tied_used for leaf in d.values()]
        grads = dict(zip(map(id, leaves), torch.autograd.grad(loss, leaves, allow_unused=True)))
        for s in range(S):
            for i, t in enumerate(used[s]):
                g = grads[id(t)]
                prev = acc[s][i]
                if g is not None:
                    acc[s][i] = g.detach().clone() if prev is None else prev.add_(g)
        for t, (p, h) in enumerate(tied):
            for s in h:
                g = grads[id(tied_used[t][s])]
                if g is not None:
                    tacc[t][s] = g.detach().clone() if s not in tacc[t] else tacc[t][s].add_(g)
        if (b + 1) % every:
            continue
        u = b // every  # the update applied now; versions[s][u + 1] is what it publishes
        for s in range(S):
            for i, p in enumerate(own[s]):
                p.grad, acc[s][i] = acc[s][i], None
            before = [p.detach().clone() for p in own[s]]
            if lam and delays[s]:  # error feedback: towards the weights the gradient is applied to
                stale = versions[s][version(b, s)]
                for p, w in zip(own[s], stale):
                    if p.grad is not None:
                        p.grad = p.grad + lam * p.grad * p.grad * (p.detach() - w)
            if opts[s] is not None:
                factor = _lr_factor(compensation, delays[s], u)
                if factor == 1.0:  # no delay-aware LR: any object with step() serves (a clipping wrapper, say)
                    opts[s].step()
                else:
                    base = [g["lr"] for g in opts[s].param_groups]
                    for g in opts[s].param_groups:
                        g["lr"] = g["lr"] * factor
                    opts[s].step()
                    for g, lr in zip(opts[s].param_groups, base):
                        g["lr"] = lr
                opts[s].zero_grad(set_to_none=True)
            if predict and delays[s]:
                versions[s][u + 1] = [p.detach() + (p.detach() - w) * delays[s] for p, w in zip(own[s], before)]
            elif lookahead and delays[s] and opts[s] is not None:
                reach = {}
                for g in opts[s].param_groups:
                    beta = g["betas"][0] if "betas" in g else g["momentum"]
                    for q in g["params"]:
                        reach[id(q)] = sum(beta ** k for k in range(1, delays[s] + 1))
                versions[s][u + 1] = [p.detach() + (p.detach() - w) * reach[id(p)] for p, w in zip(own[s], before)]
            else:
                versions[s][u + 1] = [p.detach().clone() for p in own[s]]
        for t, (p, h) in enumerate(tied):
            total = None
            for s in h:  # stage order, as the runtime adds them
                g = tacc[t].pop(s, None)
                g = torch.zeros_like(p) if g is None else g
                total = g.clone() if total is None else total.add_(g)
            p.grad = total
            assert tied_opts is not None
            tied_opts[t].step()
            tied_opts[t].zero_grad(set_to_none=True)
            tversions[t][u + 1] = p.detach().clone()
        if on_update is not None:
            on_update(b + 1, stages)
    return losses


def minibatch_sgd_reference(
    model: nn.Module,
    data: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    steps: int,
    window: int,
    on_update: Callable[[int, list[nn.Module]], None] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain training: one step per ``window`` minibatches, on the mean of their losses; ``on_update(n, [model])``
    after each step, ``n`` the minibatches trained."""
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
        if on_update is not None:
            on_update((w + 1) * window, [model])
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
