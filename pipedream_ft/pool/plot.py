"""Pictures of a simulation: a Gantt chart (devices x time, a colour per job) per policy and a CDF of JCTs.

matplotlib is imported on first use (it is the ``plot`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from .errors import PoolError
from .simulator import JobRecord, PolicyResult

__all__ = ["device_segments", "plot_results"]


def device_segments(jobs: list[JobRecord], devices: int) -> list[list[tuple[float, float, int]]]:
    """Per device, ``(start, end, job index)`` segments: a job keeps its devices when it shrinks and takes the
    lowest free ones when it grows (the simulator counts devices, this places them for the picture)."""
    events: list[tuple[float, int, int, int]] = []  # time, order (releases first), job, new size
    for k, j in enumerate(jobs):
        for t, n in j.allocations:
            events.append((float(t), 0, k, int(n)))
        if j.finish is not None:
            events.append((float(j.finish), 0, k, 0))
    events.sort(key=lambda e: (e[0], e[3] > 0))
    held: dict[int, list[int]] = {}
    owner: list[int | None] = [None] * devices
    began = [0.0] * devices
    segs: list[list[tuple[float, float, int]]] = [[] for _ in range(devices)]
    for t, _, k, n in events:
        mine = held.setdefault(k, [])
        while len(mine) > n:
            d = mine.pop()
            if t > began[d]:
                segs[d].append((began[d], t, k))
            owner[d] = None
        while len(mine) < n:
            free = [d for d in range(devices) if owner[d] is None]
            if not free:
                raise PoolError(f"job {jobs[k].name}: more devices in use than the pool's {devices} at {t:g} s")
            owner[free[0]] = k
            began[free[0]] = t
            mine.append(free[0])
    return segs


def plot_results(results: Mapping[str, PolicyResult], devices: int, out_dir: str | Path,
                 prefix: str = "") -> list[Path]:
    """Write ``<prefix>gantt-<policy>.png`` per policy and ``<prefix>jct-cdf.png``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    cmap = plt.get_cmap("tab20")
    for name, r in results.items():
        fig, ax = plt.subplots(figsize=(9, 3.6), dpi=80)
        t0 = min(j.arrival for j in r.jobs)
        for d, segs in enumerate(device_segments(r.jobs, devices)):
            if segs:
                ax.broken_barh([((a - t0) / 3600, (b - a) / 3600) for a, b, _ in segs], (d, 0.9),
                               facecolors=[cmap(k % 20) for _, _, k in segs], linewidth=0)
        ax.set_xlim(0, r.makespan / 3600)
        ax.set_ylim(0, devices)
        ax.set_xlabel("hours")
        ax.set_ylabel("device")
        ax.set_title(f"{name}: avg JCT {r.avg_jct:.0f} s, makespan {r.makespan / 3600:.1f} h, "
                     f"utilisation {100 * r.utilization:.0f} %", fontsize=10)
        fig.tight_layout()
        path = out / f"{prefix}gantt-{name.replace('/', '_').replace(':', '_')}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
    for name, r in results.items():
        jcts = sorted((j.finish or 0) - j.arrival for j in r.jobs)
        ax.step(jcts, [(k + 1) / len(jcts) for k in range(len(jcts))], where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("JCT (s)")
    ax.set_ylabel("fraction of jobs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{prefix}jct-cdf.png"
    fig.savefig(path)
    plt.close(fig)
    paths.append(path)
    return paths
