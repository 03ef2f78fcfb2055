from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_profiles import PROFILES_DIR
from partitioner import load_plan
from partitioner.cli import layer_ranges, main
from profiler.profile import Layer, Profile

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
VGG = str(PROFILES_DIR / "vgg16.graph.txt")


def _json_profile(tmp_path: Path) -> Path:
    layers = tuple(Layer(str(i), "Conv", 1.0 + i, 2.0, 1e5, 1e6) for i in range(6))
    p = Profile(layers, tuple((i, i + 1) for i in range(5)))
    path = tmp_path / "prof.json"
    p.save(path)
    return path


def _err_lines(capsys) -> list[str]:
    return [l for l in capsys.readouterr().err.splitlines() if l.strip()]


def test_plans_graph_txt(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([VGG, "--workers", "4", "--bandwidth", "1e9", "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.time_per_minibatch_s == pytest.approx(0.205520896, rel=1e-6)
    text = capsys.readouterr().out
    assert "stage" in text and "replicas" in text and "speedup over data parallelism" in text
    assert "205.521 ms" in text
    data = json.loads(out.read_text())
    for key in ("time_per_minibatch_s", "speedup_over_data_parallel", "profile_hash", "layer_to_stage",
                "stage_to_ranks"):
        assert key in data


def test_hierarchical_and_straight(tmp_path):
    out = tmp_path / "plan.json"
    assert main([VGG, "--workers", "4", "--workers", "4", "--bandwidth", "1e10", "--bandwidth", "1e9",
                 "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.world_size == 16
    assert plan.time_per_minibatch_s == pytest.approx(0.06974994146666665, rel=1e-6)
    assert main([VGG, "-n", "4", "-b", "1e9", "--straight", "-o", str(out)]) == 0
    assert load_plan(out).num_stages == 4


def test_json_profile_and_memory(tmp_path):
    prof = _json_profile(tmp_path)
    out = tmp_path / "plan.json"
    assert main([str(prof), "--workers", "2", "--bandwidth", "1e9", "--memory", "1e9", "-o", str(out)]) == 0
    assert load_plan(out).settings["memory_bytes"] == 1e9


@pytest.mark.parametrize("content,needle", [
    ("node1 -- Conv -- forward_compute_time=1.0, backward_compute_time=1.0\n", ":1"),
    ("node1 -- Conv -- forward_compute_time=-1.0, backward_compute_time=1.0, activation_size=1.0, "
     "parameter_size=1.0\n", "forward"),
    ("node1 -- Conv -- forward_compute_time=nan, backward_compute_time=1.0, activation_size=1.0, "
     "parameter_size=1.0\n", "forward"),
    ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=1\n"
     "node2 -- B -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=1\n"
     "\tnode1 -- node2\n\tnode2 -- node1\n", "cycle"),
    ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=1\n"
     "\tnode1 -- node9\n", "node9"),
    ('{"format": "pipedream-ft-profile", "version": 1, "layers": [', "invalid JSON"),
    ("", "no node lines"),
    ("node1 -- Conv -- forward_compute_time=1e308, backward_compute_time=1.0, activation_size=1.0, "
     "parameter_size=1.0\n", "'node1': forward_ms is 1e+308"),
    ('{"format": "pipedream-ft-profile", "version": 1, "layers": [{"name": "a", "description": "A", '
     '"forward_ms": 1.0, "backward_ms": 1e308, "activation_bytes": 1.0, "parameter_bytes": 1.0}], "edges": []}',
     "'a': backward_ms is 1e+308"),
    ('{"format": "pipedream-ft-profile", "version": 1, "layers": [{"name": "a", "description": "A", '
     '"forward_ms": 1.0, "backward_ms": 1.0, "activation_bytes": 1e300, "parameter_bytes": 1.0}], "edges": []}',
     "'a': activation_bytes is 1e+300"),
])
def test_bad_profiles(tmp_path, capsys, content, needle):
    prof = tmp_path / "bad.txt"
    prof.write_text(content)
    out = tmp_path / "plan.json"
    assert main([str(prof), "--workers", "2", "--bandwidth", "1e9", "-o", str(out)]) == 2
    lines = _err_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("pipedream-partition: error: ")
    assert needle in lines[0] and str(prof) in lines[0]
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [prof]  # no temporary files left behind


@pytest.mark.parametrize("head", [b"", b'{"format": "pipedream-ft-profile", '])
def test_a_profile_that_is_not_utf8_is_one_line(tmp_path, head):
    """Bytes that are not UTF-8 (a binary file, another encoding) are named, not a UnicodeDecodeError traceback."""
    prof = tmp_path / "bad.prof"
    prof.write_bytes(head + b"\xff\xfe\x00 node1 -- Conv")
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "partitioner.cli", str(prof), "--workers", "2", "--bandwidth", "1e9", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines == [f"pipedream-partition: error: {prof}: not a profile: not UTF-8 text (byte {len(head)} is 0xff)"]
    assert not out.exists()


def test_a_huge_time_is_one_line_without_a_numpy_warning(tmp_path):
    """A finite but absurd time (1e308 ms) is refused while loading, naming the layer and the value, before
    the planner's sums overflow (a numpy RuntimeWarning, then "no plan exists")."""
    layers = [{"name": str(i), "description": "Linear", "forward_ms": 1.0, "backward_ms": 2.0,
               "activation_bytes": 1e5, "parameter_bytes": 1e6} for i in range(4)]
    layers[2]["forward_ms"] = 1e308
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"format": "pipedream-ft-profile", "version": 1, "layers": layers,
                                "edges": [[i, i + 1] for i in range(3)]}))
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "partitioner.cli", str(prof), "--workers", "2",
         "--bandwidth", "1e9", "-o", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"pipedream-partition: error: {prof}"), lines
    assert "layer '2': forward_ms is 1e+308" in lines[0] and "at most 1e+09 ms" in lines[0], lines
    assert not out.exists()


def test_a_machine_profile_that_is_not_utf8_is_one_line(tmp_path, capsys):
    machine = tmp_path / "machine.json"
    machine.write_bytes(b"\xff\xfe{}")
    out = tmp_path / "plan.json"
    assert main([VGG, "--machine", str(machine), "-o", str(out)]) == 2
    lines = _err_lines(capsys)
    assert lines == [f"pipedream-partition: error: {machine}: not a machine profile: not UTF-8 text (byte 0)"]
    assert not out.exists()


@pytest.mark.parametrize("args,needle", [
    (["--workers", "0", "--bandwidth", "1e9"], "workers"),
    (["--workers", "-3", "--bandwidth", "1e9"], "workers"),
    (["--workers", "two", "--bandwidth", "1e9"], "workers"),
    (["--workers", "2", "--bandwidth", "0"], "bandwidth"),
    (["--workers", "2", "--bandwidth", "-1e9"], "bandwidth"),
    (["--workers", "2", "--bandwidth", "nan"], "bandwidth"),
    (["--workers", "2", "--workers", "2", "--bandwidth", "1e9"], "--bandwidth"),
    (["--workers", "2", "--bandwidth", "1e9", "--memory", "1000"], "memory limit of 1000 bytes"),
    (["--workers", "2", "--bandwidth", "1e9", "--memory", "-5"], "memory"),
    (["--bandwidth", "1e9"], "--workers"),
])
def test_bad_settings(tmp_path, capsys, args, needle):
    out = tmp_path / "plan.json"
    out.write_text("old")
    assert main([VGG, *args, "-o", str(out)]) == 2
    lines = _err_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("pipedream-partition: error: ")
    assert needle in lines[0]
    assert out.read_text() == "old"


def test_missing_profile(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([str(tmp_path / "nope.txt"), "--workers", "1", "--bandwidth", "1e9", "-o", str(out)]) == 2
    lines = _err_lines(capsys)
    assert len(lines) == 1 and "nope.txt" in lines[0]
    assert not out.exists()


def test_layer_ranges():
    assert layer_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert layer_ranges([3]) == "3"


def test_subprocess_error_exit_status(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("node1 -- Conv -- forward_compute_time=1.0\n")
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "partitioner.cli", str(bad), "--workers", "2", "--bandwidth", "1e9", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("pipedream-partition: error: ")
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_gpt_profile_with_value_layers(tmp_path, capsys):
    import torch

    from pipedream_ft_examples.gpt import gpt
    from profiler.measure import profile_model

    torch.manual_seed(0)
    prof = tmp_path / "gpt.json"
    profile = profile_model(gpt(n_layer=2, n_embd=32, n_head=2), torch.randint(0, 256, (2, 8)), warmup=0, repeats=1)
    profile.save(prof)
    out = tmp_path / "plan.json"
    assert main([str(prof), "-n", "4", "-b", "1e9", "--straight", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    plan = load_plan(out)
    assert plan.recompute and plan.recompute == tuple(i for i, l in enumerate(profile.layers) if l.kind == "value")
    assert f"value layers recomputed where needed (never sent): {len(plan.recompute)}" in text
