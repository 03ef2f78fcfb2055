"""The ``pipedream-profile`` command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from profiler import load_profile
from profiler.cli import main

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--warmup", "0", "--repeats", "1"]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the current directory on it


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pipedream-profile: error: ")
    assert "Traceback" not in err
    return lines[0]


def test_profile_cnn_to_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cnn.json"
    rc = main(["pipedream_ft_examples.models:digits_cnn", "--input-shape", "1,8,8", "--batch-size", "4", *FAST, "-o", str(out)])
    assert rc == 0
    p = load_profile(out)
    assert len(p) == 11 and p.is_chain()
    assert p.meta["model"] == "pipedream_ft_examples.models:digits_cnn"
    assert p.meta["batch_size"] == 4 and p.meta["input_shapes"] == [[4, 1, 8, 8]]
    stdout = capsys.readouterr().out
    assert "fwd ms" in stdout and "total" in stdout and str(out) in stdout
    assert [f.name for f in tmp_path.iterdir()] == ["cnn.json"]


def test_profile_resnet_to_graph_txt(tmp_path: Path) -> None:
    out = tmp_path / "resnet.graph.txt"
    rc = main(["pipedream_ft_examples.models:digits_resnet", "--input-shape", "1,8,8", "--batch-size", "2", *FAST, "-o", str(out)])
    assert rc == 0
    text = out.read_text()
    assert text.startswith("node1 -- Conv2d(1, 16")
    p = load_profile(out)
    assert len(p) == 15 and not p.is_chain()


def test_structure_hash_matches_in_process_profile(tmp_path: Path) -> None:
    from pipedream_ft_examples.models import mlp
    from profiler.layers import structure_profile

    out = tmp_path / "mlp.json"
    assert main(["pipedream_ft_examples.models:mlp", "--input-shape", "64", "--batch-size", "3", *FAST, "-o", str(out)]) == 0
    assert load_profile(out).structure_hash() == structure_profile(mlp()).structure_hash()


def test_int_input_and_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = tmp_path / "tokmodels.py"
    mod.write_text(
        "from torch import nn\n"
        "def tiny():\n"
        "    return nn.Sequential(nn.Embedding(20, 4), nn.Flatten(), nn.Linear(4 * 5, 2))\n"
    )
    out = tmp_path / "tok.json"
    monkeypatch.chdir(tmp_path)  # the current directory goes on sys.path
    argv = ["tokmodels:tiny", "--input-shape", "5", "--batch-size", "3", "--int-input", "20", "--dtype", "float64"]
    assert main([*argv, *FAST, "-o", str(out)]) == 0
    p = load_profile(out)
    assert p.layers[0].activation_bytes == 3 * 5 * 4 * 8
    assert p.meta["dtype"] == "float64"
    sys.modules.pop("tokmodels", None)


BAD = [
    (["pipedream_ft_examples.models"], "MODULE:FACTORY"),
    (["pipedream_ft_examples.models:"], "MODULE:FACTORY"),
    (["no_such_module_xyz:f"], "cannot import"),
    (["pipedream_ft_examples.models:no_such_factory"], "no attribute"),
    (["pipedream_ft_examples.models:mlp", "--input-shape", "1,x,8"], "--input-shape"),
    (["pipedream_ft_examples.models:mlp", "--input-shape", "0,8"], "--input-shape"),
    (["pipedream_ft_examples.models:mlp", "--batch-size", "0"], "--batch-size"),
    (["pipedream_ft_examples.models:mlp", "--device", "warp9"], "device"),
    (["pipedream_ft_examples.models:mlp", "--dtype", "float99"], "dtype"),
    (["pipedream_ft_examples.models:mlp", "--dtype", "int32"], "dtype"),
    (["pipedream_ft_examples.models:digits_cnn"], "failed"),  # the shape 64 does not fit a CNN
    (["pipedream_ft_examples.models:mlp", "--bogus-flag"], "unrecognized"),
]


@pytest.mark.parametrize("extra,expect", BAD)
def test_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], expect: str) -> None:
    out = tmp_path / "p.json"
    argv = [extra[0], "--input-shape", "64", "--batch-size", "2", *FAST, "-o", str(out), *extra[1:]]
    assert main(argv) == 2
    assert expect in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_factory_raising(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "p.json"
    argv = ["pipedream_ft_examples.models:mlp", "--input-shape", "64", "--batch-size", "2", "-o", str(out)]
    (tmp_path / "badfactory.py").write_text(
        "def boom():\n    raise RuntimeError('no model\\ntoday')\ndef notmodel():\n    return 42\n"
    )
    monkeypatch.chdir(tmp_path)
    argv[0] = "badfactory:boom"
    assert main(argv) == 2
    line = _error_line(capsys)
    assert "boom() raised RuntimeError: no model today" in line
    argv[0] = "badfactory:notmodel"
    assert main(argv) == 2
    assert "not a torch.nn.Module" in _error_line(capsys)
    assert sorted(f.name for f in tmp_path.iterdir() if f.suffix != ".pyc" and f.name != "__pycache__") == ["badfactory.py"]
    sys.modules.pop("badfactory", None)


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "MODULE:FACTORY" in capsys.readouterr().out


def test_missing_required_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipedream_ft_examples.models:mlp"]) == 2
    assert "required" in _error_line(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_unavailable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    argv = ["pipedream_ft_examples.models:mlp", "--input-shape", "64", "--batch-size", "2", "--device", "cuda:0", "-o", str(out)]
    assert main(argv) == 2
    assert "CUDA is not available" in _error_line(capsys)
    assert not out.exists()


def test_unwritable_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["pipedream_ft_examples.models:mlp", "--input-shape", "64", "--batch-size", "2", *FAST, "-o"]
    assert main([*argv, str(tmp_path / "missing" / "p.json")]) == 2
    assert "does not exist" in _error_line(capsys)
    assert main([*argv, str(tmp_path)]) == 2
    assert "directory" in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_kept_on_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    out.write_text("old")
    argv = ["pipedream_ft_examples.models:digits_cnn", "--input-shape", "3", "--batch-size", "2", *FAST, "-o", str(out)]
    assert main(argv) == 2
    _error_line(capsys)
    assert out.read_text() == "old"
    assert [f.name for f in tmp_path.iterdir()] == ["p.json"]


def test_subprocess_exit_status_and_single_line(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "profiler.cli", "pipedream_ft_examples.models:nope", "--input-shape", "1,8,8", "--batch-size", "2", "-o", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipedream-profile: error: ")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert not out.exists()


@pytest.mark.parametrize("suffix", [".json", ".txt"])
def test_gpt_value_layers_and_tied_embedding(tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str) -> None:
    out = tmp_path / f"gpt{suffix}"
    rc = main(["pipedream_ft_examples.gpt:gpt", "--int-input", "256", "--input-shape", "16", "--batch-size", "2", *FAST,
               "-o", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "value layers (no tensor in their output; recomputed where needed, never sent): 32" in stdout
    assert "tied parameter wte.weight (128.0 KiB) shared by layers wte, lm_head" in stdout
    assert ("graph.txt cannot record" in stdout) == (suffix == ".txt")
    p = load_profile(out)
    if suffix == ".json":
        assert sum(l.kind == "value" for l in p.layers) == 32 and p.tied[0].name == "wte.weight"


_HF_FILE = """
import torch, transformers
from profiler.hf import for_pipeline


def llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return for_pipeline(transformers.LlamaForCausalLM(config), ("input_ids", "attention_mask"))
"""


def test_a_file_path_model_with_several_inputs_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.py").write_text(_HF_FILE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = elsewhere / "p.json"
    assert main(["--model", "../models/mine.py:llama", "--input", "input_ids:12:int:64", "--input",
                 "attention_mask:12:ones", "--batch-size", "2", *FAST, "-o", str(out)]) == 0
    profile = load_profile(str(out))
    assert [i.name for i in profile.inputs] == ["input_ids", "attention_mask"]
    assert sum(layer.name.startswith("model_layers_") for layer in profile.layers) == 2
    # the inputs in another order, or another name, are refused in one line naming the model's
    assert main(["../models/mine.py:llama", "--input", "attention_mask:12:ones", "--input", "input_ids:12:int:64",
                 "--batch-size", "2", *FAST, "-o", str(out)]) == 2
    assert "takes inputs ['input_ids', 'attention_mask'], but --input gives ['attention_mask', 'input_ids']" in \
        _error_line(capsys)


@pytest.mark.parametrize("extra,expect", [
    (["--input", "x"], "NAME:SHAPE[:KIND]"),
    (["--input", "x:4:int:0"], "int:VOCAB"),
    (["--input", "x:4:int32"], "kind 'int32'"),
    (["--input", "x:4", "--input", "x:4"], "must differ"),
    (["--input", "x:4", "--input-shape", "4"], "--input-shape (one input) or"),
    (["--model", "pipedream_ft_examples.models:mlp", "--input-shape", "64"], "name the model once"),
    (["--input-shape", "64"], "name the model once"),
    (["--input", "input:64"], ""),
])
def test_input_and_model_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
                                expect: str) -> None:
    out = tmp_path / "p.json"
    target = [] if extra == ["--input-shape", "64"] else ["pipedream_ft_examples.models:mlp"]  # with --model: named twice
    rc = main([*target, "--batch-size", "2", *FAST, "-o", str(out), *extra])
    if not expect:  # --input with the model's one input name works like --input-shape
        assert rc == 0 and [i.name for i in load_profile(str(out)).inputs] == ["input"]
        return
    assert rc == 2
    assert expect in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []
