"""Small hand-made inputs for the pool's tests: job views, curves, tiny profiles and workloads."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from pipedream_ft.pool.job import JobView

__all__ = ["view", "linear", "write_chain_profile", "write_workload"]


def linear(lo: int, hi: int, per: float = 1.0) -> dict[int, float]:
    """A perfectly scaling curve: ``per`` minibatches/s per device, sizes ``lo..hi``."""
    return {n: per * n for n in range(lo, hi + 1)}


def view(name: str, *, arrival: float = 0.0, workers: int = 1, alloc: int = 0, since: float | None = None,
         attained: float = 0.0, remaining: float = 100.0, work: float | None = None, started: bool | None = None,
         curve: Mapping[int, float] | None = None, priority: int = 0) -> JobView:
    curve = dict(curve) if curve is not None else {workers: float(workers)}
    return JobView(name, arrival, workers, min(curve), max(curve), priority, alloc,
                   arrival if since is None else since, attained, remaining,
                   remaining if work is None else work, bool(alloc) if started is None else started,
                   MappingProxyType(curve))


def write_chain_profile(path: Path, layers: int = 6, ms: float = 10.0) -> Path:
    """A PipeDream ``graph.txt`` chain of ``layers`` equal layers (``ms`` forward, twice that backward)."""
    lines = []
    for k in range(layers):
        lines.append(f"node{k} -- Linear(k={k}) -- forward_compute_time={ms:.3f}, backward_compute_time="
                     f"{2 * ms:.3f}, activation_size=1000.000, parameter_size=4000.000")
    for k in range(layers - 1):
        lines.append(f"\tnode{k} -- node{k + 1}")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_workload(path: Path, rows: list[str], header: str = "name,time,model,workers,duration") -> Path:
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return path
