"""A Python without PyTorch gets one line from every command that needs it (what to install, for which Python) and
exit status 2, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from profiler.cliutil import missing_torch, run_cli

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]


def test_run_cli_turns_a_missing_torch_into_one_line(capsys) -> None:
    def run(argv):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    assert run_cli("tool", run, []) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("tool: error: PyTorch is not installed for ") and sys.executable in err[0]
    assert "pip install torch" in err[0]


def test_another_missing_module_is_not_blamed_on_torch() -> None:
    def run(argv):
        raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")

    assert missing_torch(ModuleNotFoundError("x", name="torch.distributed")) is not None
    assert missing_torch(ModuleNotFoundError("x", name="torchvision")) is None
    assert missing_torch(ImportError("x", name="torch")) is None  # torch there but broken: its own traceback
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        run_cli("tool", run, [])


@pytest.fixture
def no_torch_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``import torch`` fails as it does where PyTorch is not installed."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEDREAM_FT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    return env


@pytest.mark.parametrize("argv", [
    ["-m", "profiler.cli", "pipedream_ft_examples.models:digits_cnn", "--input-shape", "1,8,8", "--batch-size", "4",
     "-o", "{tmp}/p.json"],
    ["-m", "pipedream_ft.probe", "-o", "{tmp}/m.json"],
    ["examples/demo.py", "--out", "{tmp}/demo"],
], ids=["pipedream-profile", "pipedream-probe", "demo"])
def test_commands_say_in_one_line_that_torch_is_missing(argv, no_torch_env, tmp_path) -> None:
    cmd = [sys.executable] + [a.replace("{tmp}", str(tmp_path)) for a in argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=no_torch_env, capture_output=True, text=True, timeout=50)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "PyTorch is not installed for" in lines[0] and "pip install torch" in lines[0], lines
    assert not (tmp_path / "demo").exists()  # the demo stops before its first step


def test_the_demo_uses_the_checkouts_set_up_virtualenv_when_this_python_lacks_it(tmp_path, monkeypatch) -> None:
    """A Python without the set-up (the machine's own) runs the demo with the checkout's ``.venv`` if that has
    PyTorch and pipedream-ft; a ``.venv`` without them, or none, leaves the one line above."""
    from pipedream_ft_examples.demo import set_up_python

    monkeypatch.delenv("PIPEDREAM_FT_DEMO_VENV", raising=False)
    assert set_up_python(tmp_path) is None  # no .venv
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a set-up Python: this one
    (bin_dir / "python").chmod(0o755)
    assert set_up_python(tmp_path) == bin_dir / "python"
    monkeypatch.setenv("PIPEDREAM_FT_DEMO_VENV", "1")  # already running with it: never again
    assert set_up_python(tmp_path) is None
    monkeypatch.delenv("PIPEDREAM_FT_DEMO_VENV")
    (bin_dir / "python").unlink()
    (bin_dir / "python").write_text("#!/bin/sh\nexit 1\n")  # a .venv that cannot import them
    (bin_dir / "python").chmod(0o755)
    assert set_up_python(tmp_path) is None
