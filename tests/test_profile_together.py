"""A model's ``pipeline_keep_together`` groups: resolved to layers, recorded in the profile, read back."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from profiler.layers import layer_graph, structure_profile
from profiler.measure import profile_model
from profiler.profile import KeepTogether, Layer, Profile, ProfileError
from profiler.together import OUTPUT, closure, with_keep_together


class _RMSNorm(nn.Module):
    """A norm fx traces through: its weight becomes a get_attr layer, its arithmetic call_function layers."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _LM(nn.Module):
    def __init__(self, keep=None) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = _RMSNorm(8)
        self.lm_head = nn.Linear(8, 8)
        if keep is not None:
            self.pipeline_keep_together = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lm_head(self.norm(self.body(x)))) * 2.0


def _names(graph, group: KeepTogether) -> list[str]:
    return [graph.names[i] for i in group.layers]


def test_module_paths_cover_traced_through_modules_and_output() -> None:
    graph = layer_graph(_LM((("norm", "lm_head", OUTPUT),)))
    (group,) = graph.keep_together
    assert group.name == "norm + lm_head + <output>"
    # the norm's weight read and arithmetic (traced through), the head, and everything up to the output
    assert _names(graph, group) == [n for n in graph.names if n != "body"]
    graph = layer_graph(_LM((("norm.weight", "lm_head"),)))
    (group,) = graph.keep_together  # the weight read, the head and the multiply between them
    assert _names(graph, group) == ["norm_weight", "mul_1", "lm_head"]


def test_no_attribute_no_groups_and_the_same_hash() -> None:
    plain = structure_profile(_LM())
    kept = structure_profile(_LM((("norm", "lm_head"),)))
    assert plain.keep_together == () and len(kept.keep_together) == 1
    assert kept.structure_hash() == plain.structure_hash()  # planning advice, not structure
    assert "keep_together" not in plain.to_json()  # profiles without groups are written as before


def test_sequential_children_and_one_layer_groups() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh())
    model.pipeline_keep_together = (("1", OUTPUT), ("0.weight",))  # the second group is one layer: dropped
    (group,) = layer_graph(model).keep_together
    assert group.layers == (1, 2, 3)


@pytest.mark.parametrize("bad, match", [
    ("norm", "tuple of groups"),
    ((("norm", 3),), "non-empty tuple of module paths"),
    (((),), "non-empty tuple of module paths"),
    ((("norm", "nohead"),), "'nohead' .* names no layer"),
])
def test_malformed_attribute_names_the_offending_value(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        layer_graph(_LM(bad))


def test_profile_model_then_with_keep_together() -> None:
    model = _LM((("norm", OUTPUT),))
    profile = profile_model(model, torch.randn(2, 8), warmup=0, repeats=1)
    assert profile.keep_together == structure_profile(model).keep_together != ()  # measured with the groups
    kept = with_keep_together(profile, model)
    assert kept.keep_together == structure_profile(model).keep_together
    assert kept.structure_hash() == profile.structure_hash()
    with pytest.raises(ValueError, match="not .*'s: 3 layers against"):
        with_keep_together(structure_profile(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Tanh())), model)


def _chain(n: int) -> tuple[tuple[Layer, ...], tuple[tuple[int, int], ...]]:
    layers = tuple(Layer(f"l{i}", "Linear", 1.0, 2.0, 4.0, 4.0) for i in range(n))
    return layers, tuple((i, i + 1) for i in range(n - 1))


def test_json_round_trip_and_renumbering(tmp_path) -> None:
    layers, edges = _chain(4)
    p = Profile(layers, edges, {}, keep_together=(KeepTogether("tail", (2, 3)),))
    path = tmp_path / "p.json"
    p.save(path)
    doc = json.loads(path.read_text())
    assert doc["keep_together"] == [{"name": "tail", "layers": [2, 3]}]
    from profiler.profile import load_profile

    assert load_profile(path) == p
    # given out of order, layers are sorted and the group renumbered with them
    q = Profile.from_unordered(layers[::-1], [(layers[a].name, layers[b].name) for a, b in edges],
                               keep_together=[KeepTogether("tail", (0, 1))])
    assert q.keep_together == (KeepTogether("tail", (2, 3)),)


@pytest.mark.parametrize("raw, match", [
    ([{"name": "g", "layers": [1]}], "two or more distinct indices"),
    ([{"name": "g", "layers": [2, 1]}], "ascending"),
    ([{"name": "g", "layers": [1, 9]}], r"names layer 9, but the profile has 4"),
    ([{"name": "g"}], "missing field 'layers'"),
])
def test_bad_groups_in_json(raw, match) -> None:
    layers, edges = _chain(4)
    doc = Profile(layers, edges).to_json()
    doc["keep_together"] = raw
    with pytest.raises(ProfileError, match=match):
        Profile.from_json(doc, "p.json")


def test_closure_adds_the_layers_between() -> None:
    # 0 -> 1 -> 3, 0 -> 2 -> 3, 3 -> 4: {0, 3} closes to 0..3; {1, 2} is already closed
    edges = [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)]
    assert closure({0, 3}, edges, 5) == (0, 1, 2, 3)
    assert closure({1, 2}, edges, 5) == (1, 2)
