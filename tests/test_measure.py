"""Layer-by-layer measurement with ``profile_model``."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

from pipedream_ft_examples.models import digits_cnn, digits_resnet, mlp
from profiler import Profile, load_profile
from profiler.layers import layer_graph, tensor_bytes
from profiler.measure import profile_model, resolve_device

pytestmark = pytest.mark.timeout(120)

FAST = {"warmup": 1, "repeats": 2}


def _outputs_fx(model: nn.Module, *inputs: torch.Tensor) -> dict[str, Any]:
    """Each node's output, recorded by torch.fx's own interpreter."""
    gm = layer_graph(model).graph_module
    seen: dict[str, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            seen[n.name] = out
            return out

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return seen


def _check_times(p: Profile) -> None:
    for l in p.layers:
        assert math.isfinite(l.forward_ms) and l.forward_ms >= 0
        assert math.isfinite(l.backward_ms) and l.backward_ms >= 0


def test_sequential_profile() -> None:
    torch.manual_seed(0)
    model = digits_cnn()
    x = torch.randn(8, 1, 8, 8)
    p = profile_model(model, x, **FAST)
    assert len(p) == len(model)
    assert p.is_chain()
    _check_times(p)
    assert sum(l.forward_ms for l in p.layers) > 0
    assert p.layers[0].backward_ms > 0  # a convolution with weights
    h = x
    with torch.no_grad():
        for layer, child in zip(p.layers, model):
            h = child(h)
            assert layer.activation_bytes == h.numel() * h.element_size()
    assert p.layers[-1].activation_bytes == 8 * 10 * 4
    assert sum(l.parameter_bytes for l in p.layers) == sum(q.numel() * 4 for q in model.parameters())
    assert p.meta["batch_size"] == 8
    assert p.meta["input_shapes"] == [[8, 1, 8, 8]]
    assert p.meta["device"] == "cpu" and p.meta["dtype"] == "float32"
    assert p.meta["torch"] == torch.__version__
    assert p.meta["warmup"] == 1 and p.meta["repeats"] == 2
    assert Profile.from_json(json.loads(json.dumps(p.to_json()))) == p


def test_fx_profile_times_residual_add() -> None:
    torch.manual_seed(0)
    model = digits_resnet()
    x = torch.randn(8, 1, 8, 8)
    p = profile_model(model, x, meta={"model": "pipedream_ft_examples.models:digits_resnet"}, **FAST)
    g = layer_graph(model)
    assert [l.name for l in p.layers] == g.names
    assert list(p.edges) == g.edges
    _check_times(p)
    add = p.layers[p.index("add")]
    assert add.backward_ms > 0 and add.activation_bytes == 8 * 16 * 8 * 8 * 4
    assert len(p.predecessors()[p.index("add")]) == 2
    seen = _outputs_fx(model, x)
    for layer in p.layers:
        assert layer.activation_bytes == tensor_bytes(seen[layer.name]), layer.name
    assert sum(l.parameter_bytes for l in p.layers) == sum(q.numel() * 4 for q in model.parameters())
    assert p.meta["model"] == "pipedream_ft_examples.models:digits_resnet"
    assert p.meta["batch_size"] == 8


def test_restores_mode_grads_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 3))
    model.eval()
    model[2].train()  # mixed modes must come back exactly
    model[3].weight.grad = torch.full_like(model[3].weight, 7.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile_model(model, torch.randn(4, 5), **FAST)
    assert [m.training for m in model.modules()] == [False, False, False, True, False]
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert torch.equal(model[3].weight.grad, torch.full_like(model[3].weight, 7.0))
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k  # running stats and num_batches_tracked included


def test_no_grads_left_on_fx_model() -> None:
    model = digits_resnet()
    model.train()
    profile_model(model, torch.randn(2, 1, 8, 8), **FAST)
    assert model.training
    assert all(q.grad is None for q in model.parameters())


def test_inplace_layers() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2), nn.ReLU(inplace=True))
    p = profile_model(model, torch.randn(3, 4), **FAST)
    _check_times(p)
    assert [l.activation_bytes for l in p.layers] == [96, 96, 24, 24]


def test_integer_input_embedding() -> None:
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 6, 4))
    tokens = torch.randint(0, 50, (5, 6))
    p = profile_model(model, tokens, **FAST)
    _check_times(p)
    assert p.layers[0].activation_bytes == 5 * 6 * 8 * 4
    assert p.meta["input_shapes"] == [[5, 6]] and p.meta["dtype"] == "float32"


class _Multi(nn.Module):
    """Two inputs, a tuple-valued layer, an int-valued layer and a layer needing no grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b = torch.chunk(self.lin(x), 2, dim=1)
        n = x.size(0)
        mask = x.new_zeros(n, 4)
        return (a * b + mask).reshape(n, -1) + y


def test_tuple_and_non_tensor_outputs() -> None:
    model = _Multi()
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    p = profile_model(model, (x, y), **FAST)
    _check_times(p)
    chunk = p.layers[p.index("chunk")]
    assert chunk.activation_bytes == 3 * 8 * 4
    size = p.layers[p.index("size")]
    assert size.activation_bytes == 0 and size.backward_ms == 0
    zeros = p.layers[p.index("new_zeros")]
    assert zeros.backward_ms == 0 and zeros.activation_bytes == 3 * 4 * 4
    seen = _outputs_fx(model, x, y)
    for layer in p.layers:
        assert layer.activation_bytes == tensor_bytes(seen[layer.name]), layer.name
    assert p.meta["input_shapes"] == [[3, 8], [3, 4]]


def test_float64_dtype_recorded() -> None:
    model = mlp((4, 3)).double()
    p = profile_model(model, torch.randn(2, 4, dtype=torch.float64), warmup=0, repeats=1)
    assert p.meta["dtype"] == "float64"
    assert p.layers[0].activation_bytes == 2 * 3 * 8


def test_no_progress_output_when_not_a_tty(capsys: pytest.CaptureFixture[str]) -> None:
    profile_model(mlp(), torch.randn(2, 64), progress=True, warmup=0, repeats=1)
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="repeats"):
        profile_model(mlp(), torch.randn(2, 64), repeats=0)
    with pytest.raises(ValueError, match="one input"):
        profile_model(mlp(), (torch.randn(2, 64), torch.randn(2, 64)))
    with pytest.raises(TypeError):
        profile_model(mlp(), [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("warp-drive")
    with pytest.raises(RuntimeError, match="layer 0"):
        profile_model(mlp(), torch.randn(2, 5), warmup=0, repeats=1)


def test_cuda_profile_or_a_clear_refusal() -> None:
    """On a machine with CUDA: the profile runs there and the model stays where it was; without: one clear error."""
    model = digits_resnet()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            profile_model(model, torch.randn(2, 1, 8, 8), device="cuda")
        return
    p = profile_model(model, torch.randn(8, 1, 8, 8), device="cuda", **FAST)
    _check_times(p)
    assert p.meta["device"].startswith("cuda")
    assert next(model.parameters()).device.type == "cpu"
    assert all(q.grad is None for q in model.parameters())


def test_saved_profile_loads(tmp_path) -> None:
    p = profile_model(digits_cnn(), torch.randn(2, 1, 8, 8), warmup=0, repeats=1)
    p.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == p


def test_layer_kinds_come_from_real_outputs() -> None:
    model = _Multi()
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    p = profile_model(model, (x, y), warmup=0, repeats=1)
    kinds = {l.name: l.kind for l in p.layers}
    assert kinds["size"] == "value"  # an int
    assert kinds["chunk"] == "tensor" and kinds["getitem"] == "tensor"  # a tuple of tensors, and one of them
    assert kinds["new_zeros"] == "tensor" and kinds["lin"] == "tensor"
    seen = _outputs_fx(model, x, y)
    for layer in p.layers:
        has = any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_flatten(seen[layer.name])[0])
        assert (layer.kind == "tensor") == has, layer.name
    assert [(i.name, i.bytes, i.readers) for i in p.inputs] == [
        ("x", 3 * 8 * 4, (p.index("lin"), p.index("size"), p.index("new_zeros"))),
        ("y", 3 * 4 * 4, (p.index("add_1"),)),
    ]


class _ShapeOnly(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return x.shape


class _ReturnsShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.shape = _ShapeOnly()
        self.pipeline_leaf_modules = (_ShapeOnly,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(self.shape(x))


@pytest.mark.parametrize("model", [_ReturnsShape(), nn.Sequential(nn.Linear(4, 4), _ShapeOnly())],
                         ids=["fx", "sequential"])
def test_module_returning_no_tensor_is_refused(model: nn.Module) -> None:
    from profiler.profile import ProfileError

    with pytest.raises(ProfileError, match=r"layer (shape|1) \(.*\) is a module call that returned no tensor \(Size\)"):
        profile_model(model, torch.randn(2, 4), warmup=0, repeats=1)


def test_tied_groups_and_inputs_of_a_measured_gpt() -> None:
    from pipedream_ft_examples.gpt import gpt
    from profiler.layers import structure_profile

    torch.manual_seed(0)
    model = gpt(n_layer=1, n_embd=32, n_head=2, block_size=16)
    p = profile_model(model, torch.randint(0, 256, (2, 8)), warmup=0, repeats=1)
    assert [(g.name, g.bytes, [p.layers[i].name for i in g.layers]) for g in p.tied] == [
        ("wte.weight", 256 * 32 * 4, ["wte", "lm_head"])]
    assert p.layers[p.index("lm_head")].parameter_bytes == 0  # counted on wte, its first user
    assert {p.layers[i].name for i, l in enumerate(p.layers) if l.kind == "value"} >= {"size", "getitem", "floordiv"}
    s = structure_profile(model)
    assert s.tied == p.tied and s.structure_hash() == p.structure_hash()
    assert [(i.name, i.readers) for i in s.inputs] == [(i.name, i.readers) for i in p.inputs]
    assert p.inputs[0].bytes == 2 * 8 * 8 and s.inputs[0].bytes == 0


def test_the_backward_is_split_into_its_weight_and_input_gradients() -> None:
    """``weight_backward_ms``: all of the backward of a layer whose input needs no gradient (token ids), none of
    one without weights (or with frozen ones), a part of one with both."""
    frozen = nn.Linear(16, 16)
    frozen.requires_grad_(False)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), frozen)
    p = profile_model(model, torch.randint(0, 50, (32, 8)), **FAST)
    for layer in p.layers:
        assert layer.weight_backward_ms is not None and 0 <= layer.weight_backward_ms <= layer.backward_ms
    embedding, first, relu, second, still = p.layers
    assert embedding.weight_backward_ms == embedding.backward_ms > 0
    assert relu.weight_backward_ms == 0 and relu.backward_ms > 0
    assert still.weight_backward_ms == 0 and still.backward_ms > 0
    for linear in (first, second):
        assert 0 < linear.weight_backward_ms < linear.backward_ms
    assert Profile.from_json(json.loads(json.dumps(p.to_json()))) == p


class _TwoInputs(nn.Module):
    """An fx-traced model whose second input (a float mask, data) is read by a later layer too."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * mask) * mask


def test_the_models_own_float_inputs_are_measured_without_a_gradient() -> None:
    """Training never computes the gradient of the data, so neither does the profile: a first layer's backward
    is its weight gradient alone (a float input as much as token ids), and a first layer without weights has
    none; in a traced model every input is data."""
    x = torch.randn(64, 32)
    p = profile_model(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), x, **FAST)
    first, second = p.layers
    assert first.weight_backward_ms == first.backward_ms > 0
    assert 0 < second.weight_backward_ms < second.backward_ms

    relu_first = profile_model(nn.Sequential(nn.ReLU(), nn.Linear(32, 32)), x, **FAST)
    assert relu_first.layers[0].backward_ms == 0 and relu_first.layers[1].weight_backward_ms > 0

    graph = profile_model(_TwoInputs(), (x, torch.rand(64, 32)), **FAST)
    by_name = {layer.name: layer for layer in graph.layers}
    assert by_name["a"].weight_backward_ms == by_name["a"].backward_ms > 0
    assert 0 < by_name["b"].weight_backward_ms < by_name["b"].backward_ms

def test_the_timers_own_cost_is_measured_on_a_gpu_and_taken_off_each_layer(monkeypatch) -> None:
    """On a GPU each timed call pays a synchronisation and autograd's device-thread hand-off that a training step
    pays once: the profile takes the measured cost off every layer's times and records it; on the CPU it is 0."""
    import profiler.measure as measure

    assert measure.call_overhead_ms("cpu") == (0.0, 0.0)
    if torch.cuda.is_available():
        f, b = measure.call_overhead_ms("cuda")
        assert 0.0 < f < 5.0 and 0.0 < b < 5.0
    model = digits_resnet()
    plain = profile_model(model, torch.randn(4, 1, 8, 8), **FAST)
    assert plain.meta["call_overhead_ms"] == [0.0, 0.0]
    monkeypatch.setattr(measure, "call_overhead_ms", lambda device: (1e6, 1e6))
    taken = profile_model(model, torch.randn(4, 1, 8, 8), **FAST)
    assert taken.meta["call_overhead_ms"] == [1e6, 1e6]
    assert all(layer.forward_ms == 0.0 and layer.backward_ms == 0.0 for layer in taken.layers)
    assert [layer.name for layer in taken.layers] == [layer.name for layer in plain.layers]
