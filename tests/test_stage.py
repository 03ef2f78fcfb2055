import pytest
import torch
from torch import nn

from partitioner.plan import PlanError
from partitioner.plan import Plan
from pipedream_ft.pipeline.stage import boundaries, build_stage, executed_layers, model_layers
from pipedream_ft.pipeline.tied import find_tied
from runtime_cases import SkipNet, mlp, plan_for
from pipedream_ft_examples.models import digits_resnet

pytestmark = pytest.mark.timeout(60)


def run_stages(model, plan, x):
    vals = [x]
    for s in range(plan.num_stages):
        out = build_stage(model, plan, s)(*vals)
        vals = list(out) if s < plan.num_stages - 1 else out
    return vals


def test_sequential_stages_compose_to_the_model():
    m = mlp()
    plan = plan_for(m, [[0, 1, 2], [3, 4], [5, 6, 7, 8]])
    x = torch.randn(4, 12)
    assert torch.equal(run_stages(m, plan, x), m(x))
    st = build_stage(m, plan, 1)
    assert sorted(st.state_dict()) == ["4.bias", "4.weight"]  # original keys, only its own layers


def test_skip_connection_crosses_the_middle_stage():
    m = SkipNet()
    ml = model_layers(m)
    names = ml.names
    # stage 0: a, tanh; stage 1: b, tanh, c, tanh; stage 2: add, d
    cut = [0 if i < 2 else 1 if i < 6 else 2 for i in range(len(names))]
    plan = plan_for(m, [[i for i, c in enumerate(cut) if c == s] for s in range(3)])
    crossing = boundaries(ml, plan.layer_to_stage, 3)
    assert crossing[0] == ["x"]
    assert len(crossing[1]) == 1 and len(crossing[2]) == 2  # h passes through stage 1
    x = torch.randn(3, 12)
    assert torch.equal(run_stages(m, plan, x), m(x))


def test_fx_resnet_any_cut_composes():
    m = digits_resnet()
    n = len(model_layers(m).names)
    x = torch.randn(2, 1, 8, 8)
    for cuts in ([n // 3, 2 * n // 3], [1, n - 1], [n // 2]):
        bounds = [0, *cuts, n]
        plan = plan_for(m, [list(range(a, b)) for a, b in zip(bounds, bounds[1:])])
        torch.testing.assert_close(run_stages(m, plan, x), m(x), rtol=0, atol=0)


def test_plan_for_another_model_is_refused():
    plan = plan_for(mlp(), [[0, 1, 2, 3], [4, 5, 6, 7, 8]])
    other = nn.Sequential(nn.Linear(12, 5))
    with pytest.raises(PlanError, match="another model"):
        build_stage(other, plan, 0)


def test_a_parameter_used_by_two_stages_is_held_by_both():
    lin = nn.Linear(4, 4)
    m = nn.Sequential(lin, nn.Tanh(), lin)
    plan = plan_for(m, [[0, 1], [2]])
    first, last = build_stage(m, plan, 0), build_stage(m, plan, 1)
    assert first.get_parameter("0.weight") is last.get_parameter("2.weight") is lin.weight
    ml = model_layers(m)
    specs = find_tied(ml, executed_layers(ml, plan.layer_to_stage, 2))
    assert sorted((t.name, t.stages, t.shape) for t in specs) == [("0.bias", (0, 1), (4,)),
                                                                  ("0.weight", (0, 1), (4, 4))]


def test_value_layers_are_recomputed_where_needed_and_never_cross():
    class ShapeNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.size(0)
            h = torch.tanh(self.a(x))
            return self.b(h).view(n, 2, 3).sum(-1)

    m = ShapeNet()
    ml = model_layers(m)
    names = ml.names
    values = [names.index("size")]
    to_stage = [0 if i <= names.index("tanh") else 1 for i in range(len(names))]
    plan = plan_for(m, [[i for i, s in enumerate(to_stage) if s == k] for k in (0, 1)])
    plan = Plan.from_json({**plan.to_json(), "recompute": values})
    run = executed_layers(ml, plan.layer_to_stage, 2, plan.recompute)
    assert names.index("size") in run[1]  # the stage that views by it recomputes the shape
    crossing = boundaries(ml, plan.layer_to_stage, 2, plan.recompute)
    assert crossing[1] == ["x", "tanh"]  # its tensor root (the input) crosses; the int does not
    x = torch.randn(4, 6)
    torch.testing.assert_close(run_stages(m, plan, x), m(x), rtol=0, atol=0)


class _InPlaceBlock(nn.Module):
    """torchvision's habits: ``ReLU(inplace=True)`` and ``out += identity``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.relu = nn.ReLU(inplace=True)
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        identity = x
        out = self.a(x)
        out = self.relu(out)
        out = self.b(out)
        out += identity
        return torch.relu_(out)


def test_a_stage_may_modify_a_received_activation_in_place():
    """A received activation is a leaf that requires grad (its gradient goes upstream); a stage that starts with
    an in-place layer on it works on a copy, and the gradients are the plain model's."""
    torch.manual_seed(0)
    m = _InPlaceBlock()
    names = model_layers(m).names
    x = torch.randn(3, 6)
    xr = x.clone().requires_grad_()
    want_out = m(xr)
    want_out.sum().backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    for cut in range(1, len(names)):  # every cut: the relu, the add and relu_ each start a stage once
        plan = plan_for(m, [list(range(cut)), list(range(cut, len(names)))])
        s0, s1 = build_stage(m, plan, 0), build_stage(m, plan, 1)
        x0 = x.clone().requires_grad_()
        mid = s0(x0)
        leaves = [t.detach().requires_grad_() for t in mid]  # as the executor receives them
        out = s1(*leaves)
        assert torch.equal(out, want_out.detach()), names[cut]
        params = dict(s0.named_parameters()) | dict(s1.named_parameters())
        for p in params.values():
            p.grad = None
        grads = torch.autograd.grad(out.sum(), leaves, retain_graph=True)
        out.sum().backward()
        torch.autograd.backward(list(mid), list(grads))
        assert torch.allclose(x0.grad, xr.grad), names[cut]
        assert sorted(params) == sorted(want)
        for n, p in params.items():
            assert torch.allclose(p.grad, want[n]), (names[cut], n)
