"""The JSON profile format: round trip, validation errors, structure hash."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profiler import Layer, ModelInput, Profile, ProfileError, TiedGroup, load_profile

pytestmark = pytest.mark.timeout(120)


def _layer(name: str, fwd: float = 1.0, bwd: float = 2.0, act: float = 100.0, par: float = 10.0, desc: str = "") -> Layer:
    return Layer(name, desc or f"Layer {name}", fwd, bwd, act, par)


def _diamond() -> Profile:
    layers = tuple(_layer(n, fwd=i + 0.5) for i, n in enumerate(["in", "a", "b", "out"]))
    return Profile(layers, ((0, 1), (0, 2), (1, 3), (2, 3)), {"model": "diamond", "batch_size": 8})


def _doc() -> dict:
    return json.loads(json.dumps(_diamond().to_json()))


def test_json_round_trip() -> None:
    p = _diamond()
    q = Profile.from_json(json.loads(json.dumps(p.to_json())))
    assert q == p
    assert q.meta == {"model": "diamond", "batch_size": 8}


@pytest.mark.parametrize("suffix", [".json", ".txt"])
def test_save_and_load(tmp_path: Path, suffix: str) -> None:
    p = _diamond()
    path = tmp_path / f"p{suffix}"
    p.save(path)
    q = load_profile(path)
    assert [l.forward_ms for l in q.layers] == [l.forward_ms for l in p.layers]
    assert q.edges == p.edges
    if suffix == ".json":
        assert q == p
    assert not list(tmp_path.glob("*.tmp"))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 1e4, allow_nan=False),
            st.floats(0, 1e4, allow_nan=False),
            st.integers(0, 2**40),
            st.integers(0, 2**32),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_json_round_trip_chains(rows: list[tuple[float, float, int, int]]) -> None:
    layers = tuple(Layer(f"l{i}", "x", f, b, float(a), float(p)) for i, (f, b, a, p) in enumerate(rows))
    p = Profile(layers, tuple((i, i + 1) for i in range(len(rows) - 1)))
    assert Profile.from_json(json.loads(json.dumps(p.to_json()))) == p


def test_error_wrong_format() -> None:
    doc = _doc()
    doc["format"] = "something-else"
    with pytest.raises(ProfileError, match="format"):
        Profile.from_json(doc, source="x.json")
    with pytest.raises(ProfileError, match="JSON object"):
        Profile.from_json([1, 2, 3])


def test_error_wrong_version() -> None:
    doc = _doc()
    doc["version"] = 99
    with pytest.raises(ProfileError, match="version"):
        Profile.from_json(doc)


def test_error_missing_field() -> None:
    doc = _doc()
    del doc["layers"][2]["backward_ms"]
    with pytest.raises(ProfileError, match=r"layers\[2\].*backward_ms"):
        Profile.from_json(doc, source="x.json")
    doc = _doc()
    del doc["layers"]
    with pytest.raises(ProfileError, match="layers"):
        Profile.from_json(doc)


def test_error_negative_time() -> None:
    doc = _doc()
    doc["layers"][1]["forward_ms"] = -0.5
    with pytest.raises(ProfileError, match=r"layers\[1\].*forward_ms"):
        Profile.from_json(doc)


def test_error_nan_time() -> None:
    text = json.dumps(_doc()).replace('"backward_ms": 2.0', '"backward_ms": NaN', 1)
    doc = json.loads(text)  # Python's json accepts the NaN token
    assert math.isnan(doc["layers"][0]["backward_ms"])
    with pytest.raises(ProfileError, match="backward_ms"):
        Profile.from_json(doc)


def test_error_non_number() -> None:
    doc = _doc()
    doc["layers"][0]["activation_bytes"] = "lots"
    with pytest.raises(ProfileError, match="activation_bytes"):
        Profile.from_json(doc)


@pytest.mark.parametrize("edge", [[0, 9], [0], [0, "1"], "0-1", [-1, 2]])
def test_error_bad_edge(edge: object) -> None:
    doc = _doc()
    doc["edges"].append(edge)
    with pytest.raises(ProfileError, match="edges"):
        Profile.from_json(doc)


def test_error_cycle() -> None:
    doc = _doc()
    doc["edges"].append([3, 0])
    with pytest.raises(ProfileError, match="cycle"):
        Profile.from_json(doc)
    with pytest.raises(ProfileError, match="cycle"):
        Profile.from_unordered([_layer("a"), _layer("b"), _layer("c")], [("a", "b"), ("b", "c"), ("c", "b")])


def test_error_backward_edge_in_constructor() -> None:
    with pytest.raises(ProfileError, match="backwards"):
        Profile((_layer("a"), _layer("b")), ((1, 0),))


def test_error_duplicate_name() -> None:
    doc = _doc()
    doc["layers"][2]["name"] = "a"
    with pytest.raises(ProfileError, match="duplicate"):
        Profile.from_json(doc)
    with pytest.raises(ProfileError, match="duplicate"):
        Profile((_layer("a"), _layer("a")), ())


def test_from_unordered_sorts_topologically() -> None:
    layers = [_layer("c"), _layer("a"), _layer("b")]
    p = Profile.from_unordered(layers, [("a", "b"), ("b", "c")])
    assert [l.name for l in p.layers] == ["a", "b", "c"]
    assert p.edges == ((0, 1), (1, 2))
    assert p.is_chain()


def test_structure_hash_ignores_times_and_activations() -> None:
    p = _diamond()
    faster = Profile(
        tuple(Layer(l.name, l.description, l.forward_ms / 3, 0.0, l.activation_bytes * 2, l.parameter_bytes) for l in p.layers),
        p.edges,
        {"batch_size": 64},
    )
    assert faster.structure_hash() == p.structure_hash()
    assert p.structure_hash() == _diamond().structure_hash()


def test_structure_hash_differs_for_different_structure() -> None:
    p = _diamond()
    other_params = Profile(
        tuple(Layer(l.name, l.description, l.forward_ms, l.backward_ms, l.activation_bytes, l.parameter_bytes + 4) for l in p.layers),
        p.edges,
    )
    other_edges = Profile(p.layers, ((0, 1), (1, 2), (2, 3)))
    other_desc = Profile((_layer("in", desc="Conv"),) + p.layers[1:], p.edges)
    hashes = {p.structure_hash(), other_params.structure_hash(), other_edges.structure_hash(), other_desc.structure_hash()}
    assert len(hashes) == 4


def test_structure_hash_differs_for_different_models() -> None:
    from pipedream_ft_examples.models import digits_cnn, digits_resnet, mlp
    from profiler.layers import structure_profile

    hashes = {structure_profile(m).structure_hash() for m in (digits_cnn(), digits_resnet(), mlp(), mlp((64, 32, 10)))}
    assert len(hashes) == 4


def test_load_truncated_json(tmp_path: Path) -> None:
    path = tmp_path / "cut.json"
    text = json.dumps(_diamond().to_json(), indent=1)
    lines = text.splitlines()
    path.write_text("\n".join(lines[: len(lines) // 2]))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert str(path) in message
    assert f"{path}:" in message and "invalid JSON" in message
    line = int(message.split(f"{path}:")[1].split(":")[0])
    assert 1 <= line <= len(lines) // 2 + 1


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="nope.json"):
        load_profile(tmp_path / "nope.json")


def test_layer_rejects_bad_numbers() -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ProfileError):
            Layer("x", "", bad, 0.0, 0.0, 0.0)
    with pytest.raises(ProfileError):
        Layer("x", "", 0.0, 0.0, True, 0.0)  # type: ignore[arg-type]
    with pytest.raises(ProfileError, match="no layers"):
        Profile((), ())


# -- layer kinds, tied parameters, model inputs --------------------------------------------------------------

OLD_DIAMOND_HASH = "49867589116bef314fd68448b4be416cde8acf466651f40ce29aa7fdf72e341f"  # before kinds/tied existed


def _with_extras() -> Profile:
    layers = (_layer("in"), Layer("n", "size", 0.1, 0.0, 0.0, 0.0, kind="value"), _layer("a"), _layer("out"))
    return Profile(layers, ((0, 1), (0, 2), (1, 3), (2, 3)), {"model": "x"},
                   (TiedGroup("in.weight", 40.0, (0, 3)),), (ModelInput("x", 64.0, (0, 1)),))


def test_old_hash_is_kept() -> None:
    assert _diamond().structure_hash() == OLD_DIAMOND_HASH
    doc = _doc()
    for layer in doc["layers"]:
        del layer["kind"]
    del doc["tied"], doc["inputs"]
    old = Profile.from_json(doc)
    assert all(l.kind == "tensor" for l in old.layers) and old.tied == () and old.inputs == ()
    assert old.structure_hash() == OLD_DIAMOND_HASH


def test_kinds_tied_and_inputs_round_trip(tmp_path: Path) -> None:
    p = _with_extras()
    doc = p.to_json()
    assert [l["kind"] for l in doc["layers"]] == ["tensor", "value", "tensor", "tensor"]
    assert doc["tied"] == [{"name": "in.weight", "bytes": 40.0, "layers": [0, 3]}]
    assert doc["inputs"] == [{"name": "x", "bytes": 64.0, "readers": [0, 1]}]
    assert Profile.from_json(json.loads(json.dumps(doc))) == p
    p.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == p


def test_hash_ignores_kinds_and_inputs_but_not_tied() -> None:
    p = _with_extras()
    plain = Profile(tuple(Layer(l.name, l.description, 0, 0, 0, l.parameter_bytes) for l in p.layers), p.edges)
    assert Profile(plain.layers, plain.edges, {}, (), p.inputs).structure_hash() == plain.structure_hash()
    assert p.structure_hash() != plain.structure_hash()
    assert Profile(p.layers, p.edges, {}, p.tied).structure_hash() == p.structure_hash()
    other = Profile(p.layers, p.edges, {}, (TiedGroup("in.weight", 40.0, (0, 2)),))
    assert other.structure_hash() != p.structure_hash()


def test_from_unordered_renumbers_tied_and_inputs() -> None:
    layers = [_layer("b"), _layer("a")]
    p = Profile.from_unordered(layers, [("a", "b")], None, [TiedGroup("w", 8.0, (0, 1))], [ModelInput("x", 4.0, (1,))])
    assert [l.name for l in p.layers] == ["a", "b"]
    assert p.tied[0].layers == (0, 1) and p.inputs[0].readers == (0,)


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d["layers"][1].update(kind="scalar"), "kind must be one of tensor, value"),
    (lambda d: d["layers"][1].update(kind="value", activation_bytes=8), "activation_bytes must be 0"),
    (lambda d: d.update(tied={}), "'tied' must be a list"),
    (lambda d: d.update(tied=[{"name": "w", "bytes": 4}]), r"tied\[0\]: missing field 'layers'"),
    (lambda d: d.update(tied=[{"name": "w", "bytes": 4, "layers": [1]}]), "two or more distinct"),
    (lambda d: d.update(tied=[{"name": "w", "bytes": 4, "layers": [2, 1]}]), "ascending"),
    (lambda d: d.update(tied=[{"name": "w", "bytes": 4, "layers": [0, 9]}]), "names layer 9"),
    (lambda d: d.update(tied=[{"name": "w", "bytes": "4", "layers": [0, 1]}]), "'bytes' must be a number"),
    (lambda d: d.update(tied=[{"name": "w", "bytes": 4, "layers": [0, True]}]), "list of layer indices"),
    (lambda d: d.update(inputs=[{"name": "x", "bytes": -1, "readers": [0]}]), "finite number >= 0"),
    (lambda d: d.update(inputs=[{"name": "x", "bytes": 1, "readers": [7]}]), "names layer 7"),
])
def test_kind_tied_and_input_errors(edit, needle) -> None:
    doc = _doc()
    edit(doc)
    with pytest.raises(ProfileError, match=needle) as info:
        Profile.from_json(doc, source="p.json")
    assert str(info.value).startswith("p.json")


def test_value_layer_needs_zero_activation() -> None:
    with pytest.raises(ProfileError, match="value layer"):
        Layer("n", "size", 0.0, 0.0, 4.0, 0.0, kind="value")
    assert Layer("n", "size", 0.0, 0.0, 0.0, 0.0, kind="value").kind == "value"


def test_the_weight_gradient_share_round_trips_is_optional_and_checked(tmp_path: Path) -> None:
    split = Profile((Layer("a", "", 1.0, 2.0, 4.0, 8.0, weight_backward_ms=1.5), Layer("b", "", 1.0, 2.0, 4.0, 8.0)),
                    ((0, 1),))
    doc = split.to_json()
    assert doc["layers"][0]["weight_backward_ms"] == 1.5 and "weight_backward_ms" not in doc["layers"][1]
    assert Profile.from_json(json.loads(json.dumps(doc))) == split
    unsplit = Profile((Layer("a", "", 1.0, 2.0, 4.0, 8.0), split.layers[1]), split.edges)
    assert split.structure_hash() == unsplit.structure_hash()  # a measurement, not the model's structure
    with pytest.raises(ProfileError, match=r"weight_backward_ms \(2\.5\) is part of backward_ms \(2\.0\)"):
        Layer("a", "", 1.0, 2.0, 4.0, 8.0, weight_backward_ms=2.5)
    with pytest.raises(ProfileError, match="weight_backward_ms must be finite and >= 0"):
        Layer("a", "", 1.0, 2.0, 4.0, 8.0, weight_backward_ms=-1.0)
    doc["layers"][0]["weight_backward_ms"] = "fast"
    with pytest.raises(ProfileError, match=r"layers\[0\].*'weight_backward_ms' must be a number, got 'fast'"):
        Profile.from_json(doc)
