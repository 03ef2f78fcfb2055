"""Running a module on a weight version: the same values and gradients as ``torch.func.functional_call``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pipedream_ft.pipeline.reparam import Reparametrized

pytestmark = pytest.mark.timeout(60)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 6, bias=False)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 4, bias=False)
        self.head.weight = nn.Parameter(torch.empty(4, 6))
        self.out = nn.Linear(6, 4, bias=False)
        self.out.weight = self.head.weight  # one parameter, two places

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.emb(x) @ torch.eye(6))
        return self.head(h) + 2 * self.out(h)


def test_values_and_gradients_equal_functional_call_shared_parameters_included() -> None:
    torch.manual_seed(0)
    m = Tied()
    nn.init.normal_(m.head.weight)
    names = [n for n, _ in m.named_parameters()]  # the shared one under its first name only
    version = {n: p.detach().clone().add_(0.1).requires_grad_() for n, p in m.named_parameters()}
    x = torch.randn(3, 4)
    want = functional_call(m, version, (x,))
    want_grads = torch.autograd.grad(want.sum(), list(version.values()))
    got = Reparametrized(m)(version, (x,))
    got_grads = torch.autograd.grad(got.sum(), list(version.values()))
    assert torch.equal(got, want)
    for n, a, b in zip(names, got_grads, want_grads):
        assert torch.equal(a, b), n
    assert all(p.grad is None for p in m.parameters())  # the live parameters were not touched
    assert m.out.weight is m.head.weight and isinstance(m.head.weight, nn.Parameter)


def test_the_parameters_come_back_after_a_forward_that_raises_and_a_wrong_name_is_named() -> None:
    m = Tied()
    before = {n: p for n, p in m.named_parameters(remove_duplicate=False)}
    version = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
    with pytest.raises(RuntimeError):
        Reparametrized(m)(version, (torch.randn(3, 5),))  # the wrong width
    assert {n: p for n, p in m.named_parameters(remove_duplicate=False)} == before
    with pytest.raises(KeyError, match="the stage's module has no parameter 'nope.weight'"):
        Reparametrized(m)({**version, "nope.weight": torch.zeros(1)}, (torch.randn(3, 4),))
    assert {n: p for n, p in m.named_parameters(remove_duplicate=False)} == before
