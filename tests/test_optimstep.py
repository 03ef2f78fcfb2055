"""The optimizer's step without torch's wrapper: the same update, and the wrapper whenever something listens."""

from __future__ import annotations

import pytest
import torch

from torch.optim.optimizer import register_optimizer_step_post_hook

from pipedream_ft.pipeline import optimstep

pytestmark = pytest.mark.timeout(60)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def _grads(params: list[torch.nn.Parameter], k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)])
def test_the_same_updates_as_the_optimizer_called_as_usual(make):
    ours, theirs = _params(), _params()
    a, b = make(ours), make(theirs)
    for k in range(4):
        _grads(ours, k)
        _grads(theirs, k)
        optimstep.step(a)
        optimstep.zero_grad(a)
        b.step()
        b.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in ours)
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q)
    assert a.state_dict()["state"][0].keys() == b.state_dict()["state"][0].keys()


def test_hooks_a_scheduler_and_the_profiler_still_see_every_step():
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1)
    seen: list[str] = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    post = register_optimizer_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    try:
        _grads(params, 0)
        optimstep.step(opt)
        assert seen == ["pre", "post"]
    finally:
        pre.remove()
        post.remove()
    wrapped: list[int] = []
    opt._optimizer_step_code = lambda: wrapped.append(1)  # the wrapper's profiler entry point, after every step
    _grads(params, 1)
    before = params[0].detach().clone()
    optimstep.step(opt)  # nothing listens any more: the wrapper is skipped, the update still made
    assert seen == ["pre", "post"] and not wrapped and not torch.equal(before, params[0])
    opt.step()
    assert wrapped == [1]

    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # counts the optimizer's steps
    _grads(params, 2)
    optimstep.step(opt)
    assert getattr(opt, "_opt_called", False)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _grads(params, 3)
        optimstep.step(opt)
        optimstep.zero_grad(opt)
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#SGD.step" in names and "Optimizer.zero_grad#SGD.zero_grad" in names
