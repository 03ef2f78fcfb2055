import ast
import sys
from pathlib import Path

import pytest

import pipedream_ft.schedules as schedules
from pipedream_ft.observe.plot import summarize
from pipedream_ft.observe.timeline_cli import load_trace, main
from pipedream_ft.schedules import Costs, build, save_trace, simulate, to_trace

pytestmark = pytest.mark.timeout(120)

PACKAGE = Path(schedules.__file__).parent


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_modules_are_torch_free_and_declare_all(path):
    # the package imports the standard library and itself only, so planning can use it without torch (the
    # command line also uses the project's torch-free CLI helpers)
    allowed = set(sys.stdlib_module_names) | ({"profiler"} if path.name == "__main__.py" else set())
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] in allowed, (path.name, alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            assert node.module.split(".")[0] in allowed or node.module == "__future__", (path.name, node.module)
    assert any(isinstance(n, (ast.Assign, ast.AnnAssign)) and "__all__" in ast.unparse(n) for n in tree.body), path.name


def test_exports_exist():
    for name in schedules.__all__:
        assert hasattr(schedules, name), name


def test_trace_drawn_by_pipedream_timeline(tmp_path, capsys):
    sched, placement = build("zbv", 2, 4)
    timeline = simulate(sched, Costs.uniform(4, 2, 2, 1), placement)
    trace = to_trace(timeline, seconds_per_unit=0.01)
    first = next(e for e in trace["traceEvents"] if e["ph"] == "X")
    assert first == {"name": "0F0", "cat": "forward", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 20000,
                     "args": {"minibatch": 0, "stage": 0, "kind": "F"}}
    cats = {e["args"]["kind"]: e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert cats == {"F": "forward", "I": "backward", "W": "weight"}  # drawn as a run's split backward is
    save_trace(timeline, tmp_path / "zbv.json", seconds_per_unit=0.01)
    summary = summarize(load_trace(tmp_path / "zbv.json"))
    assert summary.ranks == [0, 1] and summary.stages == [0, 1, 2, 3] and sorted(summary.minibatches) == [0, 1, 2, 3]
    assert main([str(tmp_path / "zbv.json"), "-o", str(tmp_path / "zbv.png")]) == 0
    assert (tmp_path / "zbv.png").stat().st_size > 0
    with pytest.raises(ValueError, match="seconds_per_unit must be > 0, got 0"):
        to_trace(timeline, 0)
