"""Workloads: ``name,time,model,workers,duration[,min_workers,max_workers,priority]`` CSV files.

``time`` is the arrival (seconds from the workload's start), ``model`` a profile found in the profile folder as
``M.graph.txt`` (PipeDream's format) or ``M.json`` (pipedream-ft's), ``workers`` the requested device count and
``duration`` the seconds the job ran on that many devices. A bad row is refused with one line naming it;
nothing is skipped.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from .errors import PoolError
from .job import Job

__all__ = ["REQUIRED_COLUMNS", "OPTIONAL_COLUMNS", "find_profiles", "read_workload"]

REQUIRED_COLUMNS = ("name", "time", "model", "workers", "duration")
OPTIONAL_COLUMNS = ("min_workers", "max_workers", "priority")


def find_profiles(directory: str | Path, models: set[str] | None = None) -> dict[str, Path]:
    """``{model: path}`` of the profiles in ``directory`` (``M.graph.txt`` or ``M.json``; ``.json`` wins)."""
    d = Path(directory)
    if not d.is_dir():
        raise PoolError(f"profiles: {d} is not a directory")
    found: dict[str, Path] = {}
    for p in sorted(d.iterdir()):
        if p.name.endswith(".graph.txt"):
            found.setdefault(p.name[: -len(".graph.txt")], p)
    for p in sorted(d.glob("*.json")):
        found[p.stem] = p
    return found if models is None else {m: found[m] for m in models if m in found}


def _number(row: dict[str, str], col: str, where: str, *, integer: bool, optional: bool = False) -> float | None:
    raw = (row.get(col) or "").strip()
    if not raw:
        if optional:
            return None
        raise PoolError(f"{where}: column {col!r} is empty")
    try:
        value = float(raw)
    except ValueError:
        raise PoolError(f"{where}: {col} {raw!r} is not a number") from None
    if not math.isfinite(value):
        raise PoolError(f"{where}: {col} {raw!r} is not finite")
    if integer and value != int(value):
        raise PoolError(f"{where}: {col} {raw!r} is not a whole number")
    return int(value) if integer else value


def read_workload(path: str | Path, profiles: dict[str, Path] | None = None,
                  devices: int | None = None) -> list[Job]:
    """The jobs of a workload file in file order; each row checked (models against ``profiles``, worker counts
    against ``devices``) and the first bad one refused with a :class:`PoolError` naming it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PoolError(f"workload {path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    reader = csv.DictReader(text.splitlines())
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise PoolError(f"workload {path}: missing column(s) {', '.join(missing)} (header: {','.join(header)})")
    reader.fieldnames = header
    jobs: list[Job] = []
    names: set[str] = set()
    for i, row in enumerate(reader, start=2):
        name = (row.get("name") or "").strip()
        where = f"workload {path} line {i} ({name or 'no name'})"
        if None in row or any(row.get(c) is None for c in REQUIRED_COLUMNS):
            raise PoolError(f"{where}: expected {len(header)} fields")
        if not name:
            raise PoolError(f"{where}: column 'name' is empty")
        if name in names:
            raise PoolError(f"{where}: job name {name!r} appears twice")
        model = row["model"].strip()
        if profiles is not None and model not in profiles:
            raise PoolError(f"{where}: unknown model {model!r} (no {model}.graph.txt or {model}.json among the "
                            f"profiles)")
        arrival = _number(row, "time", where, integer=False)
        duration = _number(row, "duration", where, integer=False)
        workers = _number(row, "workers", where, integer=True)
        lo = _number(row, "min_workers", where, integer=True, optional=True)
        hi = _number(row, "max_workers", where, integer=True, optional=True)
        prio = _number(row, "priority", where, integer=True, optional=True)
        assert arrival is not None and duration is not None and workers is not None
        if arrival < 0:
            raise PoolError(f"{where}: time {arrival:g} is negative")
        if duration <= 0:
            raise PoolError(f"{where}: duration {duration:g} must be > 0")
        if workers < 1:
            raise PoolError(f"{where}: workers {workers} must be >= 1")
        for col, v in (("workers", workers), ("min_workers", lo), ("max_workers", hi)):
            if devices is not None and v is not None and v > devices:
                raise PoolError(f"{where}: {col} {v} is above the pool's {devices} devices")
        try:
            job = Job(name, float(arrival), model, int(workers), float(duration),
                      None if lo is None else int(lo), None if hi is None else int(hi), int(prio or 0))
        except PoolError as exc:
            raise PoolError(f"{where}: {str(exc).split(': ', 1)[-1]}") from None
        names.add(name)
        jobs.append(job)
    if not jobs:
        raise PoolError(f"workload {path}: no jobs")
    return jobs
