"""The pool wing stays torch-free and out of the runtime's internals (like ``partitioner/``)."""

from __future__ import annotations

import ast
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
