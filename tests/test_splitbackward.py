"""The split backward (``I`` then ``W``) against one backward over inputs and weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedream_ft.pipeline.splitbackward import input_backward


class Block(nn.Module):
    """Residual, a norm, a weight used twice and a weight-only branch (``x @ W.t()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.gate = nn.Parameter(torch.randn(8, 8) / 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.down(torch.tanh(self.up(self.norm(x))))
        h = h @ self.gate.t() + torch.relu(h @ self.gate)  # the same weight twice
        return h * y.sum(), (h * self.gate.sum()).mean(dim=-1)  # two outputs; y reaches one only through a sum


@pytest.mark.parametrize("with_inputs", [True, False])
def test_input_then_weight_gradients_equal_one_backward(with_inputs):
    torch.manual_seed(0)
    block = Block()
    x, y = torch.randn(4, 8), torch.randn(3)
    inputs = [x.clone().requires_grad_(), y.clone().requires_grad_()] if with_inputs else []
    args = inputs if with_inputs else [x, y]
    seeds = [torch.randn(4, 8), torch.randn(4)]
    full = _full_args(block, args, inputs, seeds)
    got = _split_args(block, args, inputs, seeds)
    assert len(full) == len(got)
    for a, b in zip(full, got):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def _full_args(module, args, inputs, seeds):
    outs = module(*args)
    return torch.autograd.grad(list(outs), inputs + list(module.parameters()), seeds, allow_unused=True)


def _split_args(module, args, inputs, seeds):
    outs = module(*args)
    in_grads, w = input_backward(list(outs), seeds, inputs, list(module.parameters()))
    return tuple(in_grads) + tuple(w.run())


def test_the_input_half_leaves_the_weights_to_the_weight_half_and_a_scalar_loss_needs_no_seed():
    torch.manual_seed(1)
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    computed: list[str] = []
    lin.weight.register_hook(lambda g: computed.append("weight"))
    loss = lin(x).square().sum()
    in_grads, w = input_backward([loss], [None], [x], list(lin.parameters()))
    assert computed == [] and lin.weight.grad is None  # the input half left the weight's gradient alone
    got = w.run()
    assert computed == ["weight"]
    loss2 = lin(x).square().sum()
    want = torch.autograd.grad(loss2, [x, lin.weight, lin.bias])
    torch.testing.assert_close(in_grads[0], want[0], rtol=0, atol=1e-6)
    for a, b in zip(got, want[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="runs once"):
        w.run()


def test_a_weight_the_outputs_do_not_use_gets_none():
    lin, unused = nn.Linear(4, 4), nn.Parameter(torch.ones(3))
    x = torch.randn(2, 4, requires_grad=True)
    _, w = input_backward([lin(x).sum()], [None], [x], [lin.weight, unused])
    got = w.run()
    assert got[0] is not None and got[1] is None


def test_an_output_that_is_an_input_or_a_weight_itself_passes_its_gradient_straight_through():
    """A stage may send on one of its inputs unchanged (a residual stream crossing it) or a weight as it is: those
    outputs have no graph; their gradients are the input's and the weight's, added to what the graph gives."""
    torch.manual_seed(2)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    seeds = [torch.randn(3, 4), torch.randn(3, 4), torch.randn(4, 4)]
    weights = [lin.weight, lin.bias]
    want = torch.autograd.grad([lin(x), x, lin.weight], [x] + weights, seeds)
    in_grads, w = input_backward([lin(x), x, lin.weight], seeds, [x], weights)
    got = tuple(in_grads) + tuple(w.run())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"neither an input nor a weight \(shape \[2\]\)"):
        input_backward([torch.ones(2, requires_grad=True)], [None], [x], weights)


def test_two_weights_each_used_at_two_depths_share_the_path_between_them():
    """ALBERT-style sharing: Wa and Wb are both used in the first and the second layer, so the weight half's call
    for each one runs through the first layer's nodes: the graph must outlive the first call."""
    torch.manual_seed(3)
    wa, wb = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)

    def layers(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ wa + x @ wb)
        return h @ wa + torch.sigmoid(h @ wb)

    seed = torch.randn(3, 4)
    want = torch.autograd.grad([layers(x)], [x, wa, wb], [seed])
    in_grads, w = input_backward([layers(x)], [seed], [x], [wa, wb])
    for a, b in zip(tuple(in_grads) + tuple(w.run()), want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
