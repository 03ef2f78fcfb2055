"""Benchmark of the shared pool's policies in the simulator, on the Philly-derived workloads.

Run: ``python benchmarks/bench_pool.py [--workloads DIR] [--profiles DIR] [--devices 64] [--loads 80 160 320]
[--costs 0 30 120] [--figures docs/figures]``.

* **The table**: every workload ``philly-<N>-s1.csv`` of ``--workloads`` (default ``../shared/pool/workloads``;
  80, 160 and 320 jobs are 0.5x, 1x and 2x load) at every resize cost, the five policies: average, median and
  p99 JCT, makespan, average queueing, utilisation, resizes and preemptions.
* **The targets** (issue 27): on the 160-job workload, goodput's average JCT against tiresias's (<= 0.6x) and
  fifo's (<= 0.5x), its makespan against elastic-fifo's (no worse) and its utilisation (>= elastic-fifo's - 2
  points); printed for every load and cost.
* **Schedulearn's comparison**: elastic-fifo against fifo and round-robin, on makespan and average turnaround.
* **goodput's remaining-work exponent**: 0, 0.25 (the default), 0.5 and 1 at the 30 s resize cost.
* **Wall time** of the 320-job workload with the five policies, curves included: cold (an empty cache: every
  (model, size) planned) and warm (curves read from the disk cache), wall and CPU (this machine is shared).

``--figures DIR`` writes ``pool-gantt-<policy>.png`` and ``pool-jct-cdf.png`` for the 160-job workload at 30 s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipedream_ft.pool import POLICIES, PlanSettings, ThroughputModel, find_profiles, read_workload  # noqa: E402
from pipedream_ft.pool.cli import job_curves  # noqa: E402
from pipedream_ft.pool.policies import Goodput  # noqa: E402
from pipedream_ft.pool.simulator import PolicyResult, simulate  # noqa: E402

__all__ = ["run_workload", "main"]

ROOT = Path(__file__).resolve().parents[1]


def run_workload(workload: Path, profiles: Path, devices: int, cost: float, cache: Path | None,
                 policies: tuple[str, ...] = POLICIES) -> dict[str, PolicyResult]:
    """All ``policies`` on one workload (curves from ``cache``, planned where missing)."""
    found = find_profiles(profiles)
    jobs = read_workload(workload, found, devices)
    tm = ThroughputModel({m: found[m] for m in {j.model for j in jobs}}, PlanSettings(), cache)
    curves = job_curves(jobs, tm, devices)
    return {p: simulate(jobs, curves, p, devices=devices, resize_cost=cost) for p in policies}


def _row(load: int, cost: float, name: str, r: PolicyResult) -> str:
    return (f"| {load} | {cost:g} | {name} | {r.avg_jct:.0f} | {r.p50_jct:.0f} | {r.p99_jct:.0f} | "
            f"{r.makespan:.0f} | {r.avg_queue:.0f} | {100 * r.utilization:.1f} | {r.resizes} | {r.preemptions} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", type=Path, default=ROOT.parent / "shared" / "pool" / "workloads")
    ap.add_argument("--profiles", type=Path, default=ROOT.parent / "shared" / "profiles")
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--loads", type=int, nargs="+", default=[80, 160, 320])
    ap.add_argument("--costs", type=float, nargs="+", default=[0.0, 30.0, 120.0])
    ap.add_argument("--figures", type=Path, default=None)
    a = ap.parse_args()
    for d in (a.workloads, a.profiles):
        if not d.is_dir():
            raise SystemExit(f"bench_pool: {d} is not a directory (give --workloads / --profiles)")
    cache = Path(tempfile.mkdtemp(prefix="bench-pool-cache-"))

    # wall time first, on an empty cache, then warm
    big = a.workloads / f"philly-{max(a.loads)}-s1.csv"
    walls = []
    for label in ("cold", "warm"):
        t0, c0 = time.perf_counter(), time.process_time()
        run_workload(big, a.profiles, a.devices, 30.0, cache)
        walls.append((label, time.perf_counter() - t0, time.process_time() - c0))

    results: dict[tuple[int, float], dict[str, PolicyResult]] = {}
    print("| jobs | resize s | policy | avg JCT s | p50 s | p99 s | makespan s | avg queue s | util % | resizes | "
          "preemptions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for load in a.loads:
        for cost in a.costs:
            res = run_workload(a.workloads / f"philly-{load}-s1.csv", a.profiles, a.devices, cost, cache)
            results[(load, cost)] = res
            for name, r in res.items():
                print(_row(load, cost, name, r))

    print("\ngoodput against the targets (160 jobs is the stated one):")
    print("| jobs | resize s | goodput/tiresias JCT (<= 0.6) | goodput/fifo JCT (<= 0.5) | goodput/elastic-fifo "
          "makespan (<= 1) | util goodput - elastic-fifo (>= -2 pt) |")
    print("|---|---|---|---|---|---|")
    for (load, cost), res in results.items():
        g, t, f, e = (res[p] for p in ("goodput", "tiresias", "fifo", "elastic-fifo"))
        print(f"| {load} | {cost:g} | {g.avg_jct / t.avg_jct:.2f} | {g.avg_jct / f.avg_jct:.2f} | "
              f"{g.makespan / e.makespan:.3f} | {100 * (g.utilization - e.utilization):+.1f} |")

    print("\nSchedulearn's comparison: elastic-fifo / fifo and elastic-fifo / round-robin")
    print("| jobs | resize s | makespan / fifo | turnaround / fifo | makespan / round-robin | turnaround / "
          "round-robin |")
    print("|---|---|---|---|---|---|")
    for (load, cost), res in results.items():
        e, f, rr = res["elastic-fifo"], res["fifo"], res["round-robin"]
        print(f"| {load} | {cost:g} | {e.makespan / f.makespan:.2f} | {e.avg_jct / f.avg_jct:.2f} | "
              f"{e.makespan / rr.makespan:.2f} | {e.avg_jct / rr.avg_jct:.2f} |")

    mid = 160 if 160 in a.loads else a.loads[0]
    print(f"\ngoodput's remaining-work exponent ({mid} jobs, 30 s resizes):")
    print("| exponent | avg JCT s | p99 s | makespan s | util % |")
    print("|---|---|---|---|---|")
    found = find_profiles(a.profiles)
    jobs = read_workload(a.workloads / f"philly-{mid}-s1.csv", found, a.devices)
    curves = job_curves(jobs, ThroughputModel({m: found[m] for m in {j.model for j in jobs}}, PlanSettings(),
                                              cache), a.devices)
    for x in (0.0, 0.25, 0.5, 1.0):
        r = simulate(jobs, curves, Goodput(resize_cost=30.0, remaining_exponent=x), devices=a.devices,
                     resize_cost=30.0)
        print(f"| {x:g} | {r.avg_jct:.0f} | {r.p99_jct:.0f} | {r.makespan:.0f} | {100 * r.utilization:.1f} |")

    print(f"\n{big.name}, {a.devices} devices, five policies, curves included: "
          + ", ".join(f"{label} cache {w:.1f} s wall ({c:.1f} s CPU)" for label, w, c in walls))
    if a.figures is not None:
        from pipedream_ft.pool.plot import plot_results

        res = results.get((mid, 30.0)) or run_workload(a.workloads / f"philly-{mid}-s1.csv", a.profiles,
                                                       a.devices, 30.0, cache)
        for p in plot_results(res, a.devices, a.figures, prefix="pool-"):
            print(f"wrote {p}")


if __name__ == "__main__":
    main()
