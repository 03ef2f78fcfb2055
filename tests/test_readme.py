"""The README's Hugging Face section runs as written: its three files and its commands, in an empty folder."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helpers import free_port

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_the_hugging_face_section_runs_as_written(tmp_path: Path) -> None:
    section = _section("Bring your Hugging Face model")
    files = {}
    for block in _blocks(section, "python"):
        first = block.splitlines()[0]
        match = re.match(r"# (\w+\.py) — ", first)
        if match:
            files[match.group(1)] = block
    assert sorted(files) == ["llama_job.py", "plan.py", "train.py"]
    for name, block in files.items():
        (tmp_path / name).write_text(block)
    commands = [c.strip() for line in _blocks(section, "bash")[0].splitlines() for c in line.split("&&")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PET_MASTER_PORT=str(free_port()),
               PIPEDREAM_FT_LOG_DIR=str(tmp_path / "logs"))
    outputs = []
    for command in commands:
        argv = shlex.split(command)
        tool = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}[argv[0]]
        done = subprocess.run(tool + argv[1:], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    assert re.search(r"^2 stages, predicted [\d.]+ ms per minibatch$", outputs[0], flags=re.M), outputs[0]
    losses = re.search(r"^loss ([\d.]+) -> ([\d.]+), held out ([\d.]+)$", outputs[1], flags=re.M)
    assert losses, outputs[1]
    first, last, held_out = map(float, losses.groups())
    assert last < first - 1.0 and held_out < first - 1.0  # counting sequences: learnt within 64 minibatches
    assert (tmp_path / "llama-out" / "model.safetensors.index.json").exists()
