"""The pool wing stays torch-free and out of the runtime's internals (like ``partitioner/``)."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

POOL = Path(__file__).resolve().parents[1] / "pipedream_ft" / "pool"
FORBIDDEN = ("torch", "pipedream_ft.trainer", "pipedream_ft.pipeline", "pipedream_ft.ft")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.add(node.module or "")
            else:  # relative: resolve against the package
                pkg = ".".join(path.relative_to(POOL.parents[1]).with_suffix("").parts[:-node.level])
                found.add(f"{pkg}.{node.module}" if node.module else pkg)
    return found


def test_no_pool_module_imports_torch_or_the_runtime() -> None:
    files = sorted(POOL.rglob("*.py"))
    assert len(files) >= 10
    for f in files:
        for name in _imports(f):
            assert not any(name == b or name.startswith(b + ".") for b in FORBIDDEN), f"{f.name} imports {name}"


def _without_torch(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run in a fresh interpreter; the importing of modules, not the pool's own code, is what is tested."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("module", [
    "pipedream_ft.pool", "pipedream_ft.pool.cli", "pipedream_ft.pool.simulator",
    pytest.param("pipedream_ft.pool.service.service", marks=pytest.mark.skipif(
        importlib.util.find_spec("sqlalchemy") is None, reason="needs the pool extra (sqlalchemy)")),
    pytest.param("pipedream_ft.pool.service.api", marks=pytest.mark.skipif(
        importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("sqlalchemy") is None,
        reason="needs the pool extra (fastapi, sqlalchemy)")),
])
def test_importing_the_pool_does_not_import_torch(module: str) -> None:
    """The package's ``__init__`` resolves the runtime's names lazily, so the pool's modules (and what they import:
    the partitioner, ``pipedream_ft.errors``) leave torch alone."""
    proc = _without_torch(f"import sys, {module}\n"
                          "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
                          "assert not loaded, loaded[:5]")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_package_still_gives_the_runtime_names() -> None:
    proc = _without_torch("import sys, pipedream_ft\n"
                          "assert 'torch' not in sys.modules\n"
                          "assert set(pipedream_ft.__all__) <= set(dir(pipedream_ft))\n"
                          "from pipedream_ft import PipelineTrainer, launch\n"
                          "import pipedream_ft.launch\n"
                          "assert pipedream_ft.launch is launch and callable(launch), pipedream_ft.launch\n"
                          "assert PipelineTrainer.__module__ == 'pipedream_ft.trainer' and 'torch' in sys.modules\n"
                          "assert all(getattr(pipedream_ft, n) is not None for n in pipedream_ft.__all__)")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_pipedream_pool_help_does_not_import_torch(tmp_path: Path) -> None:
    """``pipedream-pool --help`` and ``python -m pipedream_ft.pool --help``, with a ``torch`` on the path that fails
    when imported."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('pipedream-pool imported torch')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    script = shutil.which("pipedream-pool", path=str(Path(sys.executable).parent))
    commands = [[sys.executable, "-m", "pipedream_ft.pool", "--help"]] + ([[script, "--help"]] if script else [])
    for cmd in commands:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0 and "simulate" in proc.stdout, (cmd, proc.stderr[-3000:])
    broken = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env)
    assert broken.returncode != 0 and "pipedream-pool imported torch" in broken.stderr  # the fake is the one found
