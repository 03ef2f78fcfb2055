"""The installed packages: every package folder is listed in pyproject.toml, and no top-level ``examples``."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> tuple[list[str], dict[str, str]]:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return tool["packages"], tool.get("package-dir", {})


def test_every_package_folder_is_installed() -> None:
    packages, dirs = _declared()
    on_disk = set()
    for top, folder in (("pipedream_ft", "pipedream_ft"), ("profiler", "profiler"), ("partitioner", "partitioner"),
                        ("pipedream_ft_examples", "examples")):
        base = ROOT / folder
        for init in base.rglob("*.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            on_disk.add(".".join((top, *rel.parts)))
    assert sorted(on_disk - set(packages)) == []
    assert dirs == {"pipedream_ft_examples": "examples"}


def test_no_top_level_package_is_named_examples() -> None:
    packages, _ = _declared()
    assert not [p for p in packages if p.split(".")[0] == "examples"]
    import pipedream_ft_examples.models

    assert Path(pipedream_ft_examples.models.__file__).parent == ROOT / "examples"
