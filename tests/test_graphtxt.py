"""PipeDream ``graph.txt`` import and export."""

from __future__ import annotations

from pathlib import Path

import pytest

from profiler import Layer, Profile, ProfileError, dumps_graph_txt, load_profile, parse_graph_txt

pytestmark = pytest.mark.timeout(120)

GOOD = (
    "node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=4096.0, parameter_size=0.000\n"
    "node2 -- Conv2d(1, 16) -- forward_compute_time=1.5, backward_compute_time=2.5, activation_size=8192.0, parameter_size=640.0\n"
    "node3 -- ReLU(inplace) -- forward_compute_time=0.25, backward_compute_time=0.5, activation_size=8192.0, parameter_size=0.0\n"
    "\tnode1 -- node2\n"
    "\tnode2 -- node3\n"
)


def _write(tmp_path: Path, text: str, name: str = "graph.txt") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(tmp_path: Path, text: str) -> str:
    path = _write(tmp_path, text, "bad.graph.txt")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert "bad.graph.txt" in message
    return message


def test_vgg16(shared_profiles: Path) -> None:
    p = load_profile(shared_profiles / "vgg16.graph.txt")
    assert len(p) == 41
    assert p.layers[0].name == "node1"
    assert all(a < b for a, b in p.edges)
    assert p.meta.get("source") == "graph.txt"
    assert sum(l.parameter_bytes for l in p.layers) > 500e6  # VGG-16 has 138M float32 parameters


def test_resnet18(shared_profiles: Path) -> None:
    p = load_profile(shared_profiles / "resnet18.graph.txt")
    assert len(p) == 71
    assert not p.is_chain()
    assert len(p.edges) > len(p) - 1
    assert any(len(preds) > 1 for preds in p.predecessors())  # residual joins
    assert all(a < b for a, b in p.edges)


@pytest.mark.parametrize("name", ["vgg16", "resnet18"])
def test_export_round_trip_is_exact(shared_profiles: Path, tmp_path: Path, name: str) -> None:
    p = load_profile(shared_profiles / f"{name}.graph.txt")
    q = parse_graph_txt(dumps_graph_txt(p))
    assert q.layers == p.layers
    assert q.edges == p.edges
    p.save(tmp_path / "again.txt")
    r = load_profile(tmp_path / "again.txt")
    assert r.layers == p.layers and r.edges == p.edges
    assert r.structure_hash() == p.structure_hash()


def test_export_renames_non_node_layers() -> None:
    p = Profile((Layer("0", "Conv2d(1, 2)", 1.0, 2.0, 3.0, 4.0), Layer("1", "ReLU()", 0.1, 0.2, 3.0, 0.0)), ((0, 1),))
    text = dumps_graph_txt(p)
    assert text.startswith("node1 -- Conv2d(1, 2) -- ")
    q = parse_graph_txt(text)
    assert [l.name for l in q.layers] == ["node1", "node2"]
    assert [(l.forward_ms, l.backward_ms, l.activation_bytes, l.parameter_bytes) for l in q.layers] == [
        (l.forward_ms, l.backward_ms, l.activation_bytes, l.parameter_bytes) for l in p.layers
    ]


def test_nodes_in_any_order(tmp_path: Path) -> None:
    lines = GOOD.splitlines()
    shuffled = "\n".join([lines[2], lines[0], lines[4], lines[1], lines[3]]) + "\n"
    p = load_profile(_write(tmp_path, shuffled))
    assert [l.name for l in p.layers] == ["node1", "node2", "node3"]
    assert p.is_chain()


def test_good_file(tmp_path: Path) -> None:
    p = load_profile(_write(tmp_path, GOOD))
    assert len(p) == 3 and p.layers[1].forward_ms == 1.5 and p.layers[1].parameter_bytes == 640.0


def test_malformed_line(tmp_path: Path) -> None:
    text = GOOD.replace("node2 -- Conv2d(1, 16) -- ", "node2 Conv2d(1, 16) ")
    assert ":2:" in _error(tmp_path, text)


def test_malformed_edge_line(tmp_path: Path) -> None:
    text = GOOD + "\tnode3 => node4\n"
    message = _error(tmp_path, text)
    assert ":6:" in message and "edge" in message


def test_truncated_node_line(tmp_path: Path) -> None:
    lines = GOOD.splitlines()
    cut = lines[2][: lines[2].index("activation_size") + 10]
    message = _error(tmp_path, "\n".join(lines[:2] + [cut]) + "\n")
    assert ":3:" in message


def test_truncated_mid_field(tmp_path: Path) -> None:
    lines = GOOD.splitlines()
    cut = lines[1][: lines[1].index("parameter_size")]  # ends with ", "
    assert ":2:" in _error(tmp_path, lines[0] + "\n" + cut)


def test_truncated_to_nothing(tmp_path: Path) -> None:
    assert "no node lines" in _error(tmp_path, "\n\n")


@pytest.mark.parametrize("bad", ["-1.5", "nan", "NaN", "inf", "abc", ""])
def test_bad_value(tmp_path: Path, bad: str) -> None:
    text = GOOD.replace("backward_compute_time=2.5", f"backward_compute_time={bad}")
    message = _error(tmp_path, text)
    assert ":2:" in message
    assert "backward_compute_time" in message or "backward_ms" in message


def test_unknown_node_in_edge(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD + "\tnode3 -- node9\n")
    assert "node9" in message


def test_cycle(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD + "\tnode3 -- node1\n")
    assert "cycle" in message


def test_duplicate_node(tmp_path: Path) -> None:
    lines = GOOD.splitlines()
    message = _error(tmp_path, "\n".join(lines[:3] + [lines[2]] + lines[3:]) + "\n")
    assert "duplicate" in message and "node3" in message


GNMT_LIKE = (
    "node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=4096.0, parameter_size=0.000\n"
    "node7 -- LSTM(1024, 1024) -- forward_compute_time=4.25, backward_compute_time=8.5, "
    "activation_size=[6291456.0; 131072.0; 131072.0], parameter_size=33587200.000\n"
    "node8 -- Dropout(p=0.2) -- forward_compute_time=0.5, backward_compute_time=0.5, activation_size=6291456.0, parameter_size=0.000\n"
    "\tnode1 -- node7\n"
    "\tnode7 -- node8\n"
)


def test_list_activation_size_is_summed_and_written_back(tmp_path: Path) -> None:
    p = load_profile(_write(tmp_path, GNMT_LIKE))
    lstm = p.layers[p.index("node7")]
    assert lstm.activation_bytes == 6291456.0 + 131072.0 + 131072.0
    assert p.meta["activation_parts"] == {"node7": [6291456.0, 131072.0, 131072.0]}
    text = dumps_graph_txt(p)
    assert "activation_size=[6291456.0; 131072.0; 131072.0], parameter_size=33587200.0" in text
    assert parse_graph_txt(text) == p
    # a changed size is no longer the list that was read: the sum is written
    changed = Profile(tuple(Layer(l.name, l.description, l.forward_ms, l.backward_ms,
                                  1.0 if l.name == "node7" else l.activation_bytes, l.parameter_bytes)
                            for l in p.layers), p.edges, p.meta)
    assert "activation_size=1.0, parameter_size=33587200.0" in dumps_graph_txt(changed)


def test_list_activation_size_plans() -> None:
    from partitioner import partition

    plan = partition(parse_graph_txt(GNMT_LIKE), [2], [1e9])
    assert plan.world_size == 2


@pytest.mark.parametrize("bad", ["[1.0; x]", "[1.0; 2.0", "[-1.0; 2.0]", "[1.0, 2.0]", "[nan]"])
def test_bad_list_activation_size(tmp_path: Path, bad: str) -> None:
    message = _error(tmp_path, GNMT_LIKE.replace("[6291456.0; 131072.0; 131072.0]", bad))
    assert ":2:" in message and "activation" in message


def test_empty_list_activation_size_is_zero(tmp_path: Path) -> None:
    p = load_profile(_write(tmp_path, GNMT_LIKE.replace("[6291456.0; 131072.0; 131072.0]", "[]")))
    assert p.layers[p.index("node7")].activation_bytes == 0.0
