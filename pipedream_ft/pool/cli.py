"""``pipedream-pool``: simulate a shared pool of devices under scheduling policies.

Usage::

    pipedream-pool simulate --workload W.csv --profiles DIR --devices 64 \\
        --policy fifo,elastic-fifo,round-robin,tiresias,goodput [--round-s 60] [--resize-cost 30] \\
        [--bandwidth 1.25e9] [--switch 3600:goodput ...] [--json out.json] [--plot out/]

Prints one line of metrics per policy. ``--json`` writes ``{"policies": {NAME: {"avg_jct", "p50_jct", "p99_jct",
"makespan", "avg_queue", "utilization", "resizes", "preemptions", "jobs": [{"name", "arrival", "start",
"finish", "allocations": [[time, workers], ...]}, ...]}}}``. ``--plot DIR`` draws ``gantt-<policy>.png`` per
policy and ``jct-cdf.png``. Throughput curves are cached under ``--cache`` (default
``$PIPEDREAM_POOL_CACHE`` or ``~/.cache/pipedream-pool``). Errors print one line
``pipedream-pool: error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from profiler.cliutil import CliError, OneLineParser, number, run_cli, write_atomic

from .errors import PoolError
from .job import Job
from .policy import POLICIES
from .service.cli import add_subcommands
from .simulator import PolicyResult, job_sizes, simulate
from .throughput import PlanSettings, ThroughputModel, default_cache_dir
from .workload import find_profiles, read_workload

__all__ = ["main", "build_parser", "job_curves"]


def _switch(text: str) -> tuple[float, str]:
    t, sep, pol = text.partition(":")
    try:
        when = float(t)
    except ValueError:
        when = -1.0
    if not sep or not pol or not when >= 0:
        raise argparse.ArgumentTypeError(f"--switch must be TIME:POLICY with TIME >= 0 seconds, got {text!r}")
    return when, pol


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="pipedream-pool", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    s = sub.add_parser("simulate", help="run policies on a workload, with no processes")
    s.add_argument("--workload", required=True, type=Path, help="CSV: name,time,model,workers,duration[,...]")
    s.add_argument("--profiles", required=True, type=Path, help="folder of M.graph.txt / M.json profiles")
    s.add_argument("--devices", required=True, type=number("--devices", integer=True, low=1))
    s.add_argument("--policy", default=",".join(POLICIES),
                   help="comma-separated names, or package.module:Class (default: all five)")
    s.add_argument("--round-s", type=number("--round-s", low=0, unit=" s"), default=60.0)
    s.add_argument("--resize-cost", type=number("--resize-cost", unit=" s"), default=30.0)
    s.add_argument("--bandwidth", type=number("--bandwidth", low=0, unit=" bytes/s"), default=1.25e9)
    s.add_argument("--machine-size", type=number("--machine-size", integer=True, low=1), default=None,
                   help="devices per machine: sizes that are a multiple are planned on two levels")
    s.add_argument("--inter-bandwidth", type=number("--inter-bandwidth", low=0, unit=" bytes/s"), default=None)
    s.add_argument("--memory", type=number("--memory", low=0, unit=" bytes"), default=None,
                   help="bytes per device: sizes no plan fits are not allowed")
    s.add_argument("--straight", action="store_true", help="plan straight pipelines (no replicated stages)")
    s.add_argument("--quantum", type=number("--quantum", low=0, unit=" s"), default=600.0,
                   help="round-robin's time slice")
    s.add_argument("--starve-s", type=number("--starve-s", low=0, unit=" s"), default=None,
                   help="goodput's starvation bound")
    s.add_argument("--backfill", action="store_true", help="fifo starts later jobs that fit past the head")
    s.add_argument("--switch", type=_switch, action="append", default=[], metavar="TIME:POLICY",
                   help="from TIME on, POLICY decides (from the current allocation)")
    s.add_argument("--cache", type=Path, default=None, help="throughput cache folder")
    s.add_argument("--json", type=Path, default=None)
    s.add_argument("--plot", type=Path, default=None, help="folder for the Gantt and JCT-CDF PNGs")
    add_subcommands(sub)  # serve, submit, list, status, logs, cancel, policy, render-k8s
    return ap


def job_curves(jobs: Sequence[Job], model: ThroughputModel, devices: int) -> dict[str, dict[int, float]]:
    """Each job's ``{size: minibatches/s}`` over the sizes it may be given (planned once per model and size)."""
    need: dict[str, set[int]] = {}
    offered: dict[str, list[int]] = {}
    for j in jobs:
        r = job_sizes(j, devices)
        offered[j.name] = model.elastic_sizes(j.model, r.start, r.stop - 1)
        need.setdefault(j.model, set()).update(offered[j.name], [j.workers])
    full = {m: model.curve(m, sorted(ns)) for m, ns in need.items()}
    out: dict[str, dict[int, float]] = {}
    for j in jobs:
        c = full[j.model]
        if j.workers not in c:
            raise PoolError(f"job {j.name}: model {j.model!r} has no plan on its {j.workers} workers")
        out[j.name] = {n: c[n] for n in offered[j.name] if n in c}
        out[j.name][j.workers] = c[j.workers]
    return out


def _line(r: PolicyResult) -> str:
    return (f"{r.policy:>14}: avg JCT {r.avg_jct:9.0f} s  p50 {r.p50_jct:8.0f} s  p99 {r.p99_jct:9.0f} s  "
            f"makespan {r.makespan:9.0f} s  avg queue {r.avg_queue:8.0f} s  util {100 * r.utilization:5.1f} %  "
            f"resizes {r.resizes:5d}  preemptions {r.preemptions:5d}")


def _simulate(a: argparse.Namespace) -> int:
    devices = int(a.devices)
    profiles = find_profiles(a.profiles)
    jobs = read_workload(a.workload, profiles, devices)
    settings = PlanSettings(bandwidth=a.bandwidth, straight=a.straight, memory_bytes=a.memory,
                            machine_size=None if a.machine_size is None else int(a.machine_size),
                            inter_bandwidth=a.inter_bandwidth)
    cache = a.cache if a.cache is not None else default_cache_dir()
    tm = ThroughputModel({m: profiles[m] for m in {j.model for j in jobs}}, settings, cache)
    t0 = time.perf_counter()
    curves = job_curves(jobs, tm, devices)
    t_curves = time.perf_counter() - t0
    names = [p.strip() for p in a.policy.split(",") if p.strip()]
    if not names:
        raise PoolError("--policy names no policy")
    options = {"quantum": a.quantum, "backfill": a.backfill, "starve_s": a.starve_s}
    results: dict[str, PolicyResult] = {}
    t1 = time.perf_counter()
    for p in names:
        r = simulate(jobs, curves, p, devices=devices, round_s=a.round_s, resize_cost=a.resize_cost,
                     switches=a.switch, policy_options=options)
        results[r.policy] = r
        print(_line(r))
    print(f"{len(jobs)} jobs on {devices} devices: curves {t_curves:.1f} s ({tm.planned} sizes planned), "
          f"simulation {time.perf_counter() - t1:.1f} s")
    if a.json is not None:
        write_atomic(a.json, json.dumps({"devices": devices, "round_s": a.round_s, "resize_cost": a.resize_cost,
                                         "policies": {k: v.to_json() for k, v in results.items()}}) + "\n")
    if a.plot is not None:
        from .plot import plot_results

        for path in plot_results(results, devices, a.plot):
            print(f"wrote {path}")
    return 0


def _run(argv: list[str] | None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.command == "simulate":
            return _simulate(a)
        code: int = a.func(a)  # the service's commands (pipedream_ft.pool.service.cli)
        return code
    except PoolError as exc:
        raise CliError(str(exc) if a.command == "simulate" else f"{a.command}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    return run_cli("pipedream-pool", _run, argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
