"""Layer graphs of Sequential and fx-traced models."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from pipedream_ft_examples.models import digits_cnn, digits_resnet, mlp
from profiler.layers import LayerGraph, layer_graph, structure_profile
from profiler.measure import profile_model

pytestmark = pytest.mark.timeout(120)


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_sequential_graph() -> None:
    model = digits_cnn()
    g = layer_graph(model)
    assert isinstance(g, LayerGraph) and g.kind == "sequential" and g.graph_module is None
    assert len(g) == len(model) >= 10
    assert g.names == [str(i) for i in range(len(model))]
    assert g.edges == [(i, i + 1) for i in range(len(model) - 1)]
    assert g.input_consumers == [0]
    assert g.descriptions[0] == "Conv2d(1, 16, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))"
    assert g.descriptions[1] == "ReLU()"
    assert sum(g.parameter_bytes) == _param_bytes(model)
    assert g.parameter_bytes[0] == (16 * 9 + 16) * 4
    assert g.parameter_bytes[1] == 0


def test_sequential_names_and_one_line_descriptions() -> None:
    model = nn.Sequential(
        OrderedDict(
            [
                ("embed", nn.Linear(4, 8)),
                ("body", nn.Sequential(nn.Linear(8, 8), nn.Tanh())),
                ("out", nn.Linear(8, 2)),
            ]
        )
    )
    g = layer_graph(model)
    assert g.names == ["embed", "body", "out"]
    assert "\n" not in g.descriptions[1] and "  " not in g.descriptions[1]
    assert g.descriptions[1].startswith("Sequential( (0): Linear(in_features=8")
    assert sum(g.parameter_bytes) == _param_bytes(model)


def test_sequential_shared_module_counted_once() -> None:
    shared = nn.Linear(6, 6)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    g = layer_graph(model)
    assert g.names == ["0", "1", "2"]
    assert g.parameter_bytes == [_param_bytes(shared), 0, 0]


def test_fx_graph_of_residual_model() -> None:
    model = digits_resnet()
    assert not isinstance(model, nn.Sequential)
    g = layer_graph(model)
    assert g.kind == "fx" and isinstance(g.graph_module, torch.fx.GraphModule)
    assert g.names[0] == "stem" and g.names[-1] == "head"
    assert "add" in g.names and "flatten" in g.names
    assert len(set(g.names)) == len(g.names)
    add = g.names.index("add")
    producers = [a for a, b in g.edges if b == add]
    assert len(producers) == 2
    assert {g.names[p] for p in producers} == {"relu", "block1_conv2"}
    assert g.descriptions[add] == "add"
    assert g.descriptions[g.names.index("flatten")] == "flatten"
    assert g.descriptions[g.names.index("relu")] == "relu"
    assert g.descriptions[0].startswith("Conv2d(1, 16")
    assert all(a < b for a, b in g.edges)
    assert g.edges == sorted(set(g.edges))
    assert g.input_consumers == [0]
    assert sum(g.parameter_bytes) == _param_bytes(model)
    # a skip connection makes it a DAG, not a chain
    assert g.edges != [(i, i + 1) for i in range(len(g) - 1)]
    # the traced module shares the model's parameters
    assert g.graph_module.get_submodule("stem").weight is model.stem.weight
    assert [n.name for n in g.nodes()] == g.names


def test_fx_graph_is_deterministic() -> None:
    torch.manual_seed(0)
    a = layer_graph(digits_resnet())
    torch.manual_seed(1)
    b = layer_graph(digits_resnet())
    assert (a.names, a.descriptions, a.edges, a.parameter_bytes) == (b.names, b.descriptions, b.edges, b.parameter_bytes)


class _Mixed(nn.Module):
    """Two inputs, a method call, a bare parameter and a module used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).view(-1, 4)
        h = self.lin(h) * self.scale
        return h + y


def test_fx_ops_and_shared_parameters() -> None:
    model = _Mixed()
    g = layer_graph(model)
    assert g.descriptions == [
        "Linear(in_features=4, out_features=4, bias=True)",
        ".view",
        "Linear(in_features=4, out_features=4, bias=True)",
        "get_attr scale",
        "mul",
        "add",
    ]
    assert g.parameter_bytes == [(16 + 4) * 4, 0, 0, 16, 0, 0]
    assert sum(g.parameter_bytes) == _param_bytes(model)
    assert g.input_consumers == [0, 5]
    assert g.edges == [(0, 1), (1, 2), (2, 4), (3, 4), (4, 5)]


def test_untraceable_model_gives_clear_error() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return x
            return -x

    with pytest.raises(ValueError, match=r"Branchy.*nn\.Sequential"):
        layer_graph(Branchy())


@pytest.mark.parametrize("factory", [digits_cnn, digits_resnet, mlp])
def test_structure_profile_matches_measured_hash(factory) -> None:
    model = factory()
    x = torch.randn(4, 64) if factory is mlp else torch.randn(4, 1, 8, 8)
    s = structure_profile(model)
    m = profile_model(model, x, warmup=0, repeats=1)
    assert s.structure_hash() == m.structure_hash()
    assert [l.name for l in s.layers] == [l.name for l in m.layers]
    assert all(l.forward_ms == 0 and l.activation_bytes == 0 for l in s.layers)
    # and the batch size does not matter
    m2 = profile_model(model, torch.cat([x, x]), warmup=0, repeats=1)
    assert m2.structure_hash() == s.structure_hash()


def test_structure_profile_differs_between_models() -> None:
    assert structure_profile(mlp()).structure_hash() != structure_profile(mlp((64, 128, 10))).structure_hash()


def test_sequential_shared_module_is_a_tied_group() -> None:
    shared = nn.Linear(6, 6)
    g = layer_graph(nn.Sequential(shared, nn.ReLU(), shared))
    assert [(t.name, t.bytes, t.layers) for t in g.tied] == [("0.weight", 6 * 6 * 4, (0, 2)), ("0.bias", 6 * 4, (0, 2))]
    assert g.input_names == ["input"] and g.input_readers == [[0]]


class _TiedByAttr(nn.Module):
    """An embedding and an output projection reading the embedding's weight with get_attr."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # module tying: reached as emb.weight first

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.head(h) + torch.nn.functional.linear(h, self.emb.weight)


def test_tied_groups_across_modules_and_get_attr() -> None:
    g = layer_graph(_TiedByAttr())
    assert g.names == ["emb", "head", "emb_weight", "linear", "add"]
    assert [(t.name, t.bytes, t.layers) for t in g.tied] == [("emb.weight", 10 * 4 * 4, (0, 1, 2))]
    assert g.parameter_bytes == [160, 0, 0, 0, 0]  # the shared weight counted once, on its first user
    s = structure_profile(_TiedByAttr())
    assert s.tied == tuple(g.tied)
    assert [(i.name, i.bytes, i.readers) for i in s.inputs] == [("idx", 0.0, (0,))]


def test_tied_group_changes_the_structure_hash() -> None:
    untied = _TiedByAttr()
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    assert [t.layers for t in structure_profile(untied).tied] == [(0, 2)]  # the get_attr still shares emb's
    assert structure_profile(untied).structure_hash() != structure_profile(_TiedByAttr()).structure_hash()


class _Opaque(nn.Module):
    """A block fx cannot trace (data-dependent control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y if y.sum() > 0 else -y


class _WithLeaves(nn.Module):
    pipeline_leaf_modules = (_Opaque,)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Opaque(), _Opaque()])
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def test_pipeline_leaf_modules_are_single_layers() -> None:
    model = _WithLeaves()
    g = layer_graph(model)
    assert g.names == ["blocks_0", "blocks_1", "out"]
    assert g.descriptions[0].startswith("_Opaque(")
    assert g.parameter_bytes[0] == (16 + 4) * 4
    x = torch.randn(3, 4)
    assert torch.equal(g.graph_module(x), model(x))
    assert structure_profile(model).structure_hash() == profile_model(model, x, warmup=0, repeats=1).structure_hash()
    # without the attribute fx tries to trace into the block and fails with a hint
    plain = _WithLeaves()
    plain.pipeline_leaf_modules = ()
    with pytest.raises(ValueError, match="pipeline_leaf_modules"):
        layer_graph(plain)


@pytest.mark.parametrize("bad", [("Linear",), (int,), 3])
def test_bad_pipeline_leaf_modules(bad) -> None:
    model = _WithLeaves()
    model.pipeline_leaf_modules = bad
    with pytest.raises(ValueError, match=r"_WithLeaves\.pipeline_leaf_modules must be a tuple of nn\.Module subclasses"):
        layer_graph(model)
