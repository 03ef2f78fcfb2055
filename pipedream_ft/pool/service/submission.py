"""A submission checked at the boundary: every refusal is one line naming the offending value."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import PoolError

__all__ = ["Submission", "checked", "ckpt_of"]


@dataclass(frozen=True)
class Submission:
    name: str
    min_workers: int
    max_workers: int
    profile: str
    argv: tuple[str, ...]
    cwd: str
    workers: int | None = None
    priority: int = 0
    steps: int | None = None
    max_retries: int = 2
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Submission":
        try:
            return cls(name=str(d["name"]), min_workers=int(d["min_workers"]), max_workers=int(d["max_workers"]),
                       profile=str(d["profile"]), argv=tuple(str(a) for a in d["argv"]), cwd=str(d["cwd"]),
                       workers=None if d.get("workers") is None else int(d["workers"]),
                       priority=int(d.get("priority", 0)), steps=None if d.get("steps") is None else int(d["steps"]),
                       max_retries=int(d.get("max_retries", 2)), env=dict(d.get("env") or {}))
        except KeyError as exc:
            raise PoolError(f"submission: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise PoolError(f"submission: {exc}") from None


def _flag(argv: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def ckpt_of(argv: Sequence[str]) -> str | None:
    """The job's own ``--ckpt URL``, if its arguments give one."""
    return _flag(argv, "--ckpt")


def _normal_url(url: str, cwd: str) -> str:
    if "://" in url and not url.startswith("file://"):
        return url.rstrip("/")
    path = url.removeprefix("file://")
    return str((Path(cwd) / path).resolve())


def _check_entry(argv: Sequence[str], cwd: str, env: Mapping[str, str]) -> None:
    if not argv:
        raise PoolError("submission: no job command after --")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise PoolError("submission: -m needs a module name")
        mod = argv[1]
        code = "import importlib.util,sys\ntry:\n s=importlib.util.find_spec(sys.argv[1])\nexcept Exception:\n s=None\nsys.exit(0 if s else 3)"
        # the module is looked for as the job would run it: in its directory, with its environment
        rc = subprocess.run([sys.executable, "-c", code, mod], cwd=cwd, env={**os.environ, **env},
                            capture_output=True, timeout=60).returncode
        if rc != 0:
            raise PoolError(f"submission: module {mod!r} does not exist (looked for from {cwd})")
    elif not argv[0].startswith("-"):
        if not (Path(cwd) / argv[0]).is_file():
            raise PoolError(f"submission: script {argv[0]!r} does not exist (in {cwd})")


def checked(sub: Submission, devices: int, state_dir: Path) -> dict[str, Any]:
    """The job row's values for ``sub`` on a pool of ``devices``; :class:`PoolError` (one line) if it is bad."""
    if not sub.name or "/" in sub.name or sub.name.startswith(".") or sub.name.isdigit():
        raise PoolError(f"submission: bad job name {sub.name!r} (not empty, no '/', not only digits)")
    if sub.min_workers < 1:
        raise PoolError(f"submission: --min-workers must be >= 1, got {sub.min_workers}")
    if sub.min_workers > sub.max_workers:
        raise PoolError(f"submission: --min-workers {sub.min_workers} > --max-workers {sub.max_workers}")
    if sub.max_workers > devices:
        raise PoolError(f"submission: --max-workers {sub.max_workers} is more workers than the pool has ({devices})")
    workers = sub.max_workers if sub.workers is None else sub.workers
    if not sub.min_workers <= workers <= sub.max_workers:
        raise PoolError(f"submission: --workers {workers} is outside {sub.min_workers}..{sub.max_workers}")
    if sub.max_retries < 0:
        raise PoolError(f"submission: --max-retries must be >= 0, got {sub.max_retries}")
    if not Path(sub.cwd).is_dir():
        raise PoolError(f"submission: working directory {sub.cwd} does not exist")
    profile = str((Path(sub.cwd) / sub.profile).resolve())
    from profiler.profile import ProfileError, load_profile

    try:
        load_profile(profile)
    except (ProfileError, OSError, ValueError) as exc:
        text = str(exc.args[0] if exc.args else exc).splitlines()
        raise PoolError(f"submission: profile {sub.profile} does not load: {text[0] if text else type(exc).__name__}"
                        ) from None
    steps = sub.steps
    if steps is None:
        given = _flag(sub.argv, "--steps")
        steps = int(given) if given and given.isdigit() else None
    if steps is None or steps < 1:
        raise PoolError(f"submission: --steps must be >= 1 (the job's minibatches), got {steps}")
    _check_entry(sub.argv, sub.cwd, sub.env)
    argv = list(sub.argv)
    url = ckpt_of(argv)
    if url is None:  # the pool gives the job a checkpoint location of its own
        url = str(Path(state_dir).resolve() / "jobs" / sub.name / "ckpt")
        argv += ["--ckpt", url]
    return dict(name=sub.name, workers=workers, min_workers=sub.min_workers, max_workers=sub.max_workers,
                priority=sub.priority, steps=steps, profile=profile, argv=argv, cwd=sub.cwd, env=dict(sub.env),
                ckpt_url=_normal_url(url, sub.cwd), max_retries=sub.max_retries)
