"""A real pool of ``cpu:4`` on this machine under four policies, against the simulator's prediction.

Six jobs arrive over a minute: four pipelines of the sleep model (``pool_sleep_job.py``: a job's speed comes
from its allocation, not from the shared cores) and two digits jobs (``examples/train_digits.py``). For each
policy (``fifo``, ``elastic-fifo``, ``round-robin``, ``goodput``) a fresh ``pipedream-pool serve`` runs them to
the end; the benchmark reports makespan, average turnaround and resizes from the pool's records, and what the
simulator predicts for the same workload with the resize cost measured in the same run. It splits each resize
(SIGTERM -> the first update on the new count) into stop (emergency checkpoint and exit), wait (for devices)
and restart (torchrun, re-plan, reshard, first update), against the restart floor of a first launch (torchrun
and the job's start-up with no checkpoint to load). Finally a flush-mode job resized by the pool is compared
with the same job run uninterrupted: final weights within 1e-6.

    PYTHONPATH=. python benchmarks/bench_pool_run.py [--policies fifo,elastic-fifo,round-robin,goodput]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from pool_service_fixtures import PROFILE, Serve, digits_plan, env, kill_jobs, wait_for  # noqa: E402

JOB = str(ROOT / "benchmarks" / "pool_sleep_job.py")
FWD, BWD = 10.0, 20.0
QUANTUM = 20.0
# name, arrival s, kind, min, max, steps
WORKLOAD = [("s1", 0, "sleep", 1, 4, 600), ("s2", 8, "sleep", 1, 2, 300), ("d1", 15, "digits", 1, 2, 800),
            ("s3", 30, "sleep", 1, 4, 400), ("d2", 45, "digits", 1, 2, 600), ("s4", 60, "sleep", 2, 2, 300)]


def body(files: Path, name: str, kind: str, lo: int, hi: int, steps: int, save: Path | None = None) -> dict:
    if kind == "sleep":
        argv = [JOB, "--plan", str(files / f"sleep-{hi}.plan.json"), "--steps", str(steps), "--forward-ms", str(FWD),
                "--backward-ms", str(BWD)]
        profile = files / "sleep.prof.json"
    else:
        argv = ["-m", "pipedream_ft_examples.train_digits", "--plan", str(files / f"digits-{hi}.plan.json"), "--steps",
                str(steps), "--mode", "flush", "--ckpt-every", "20"]
        profile = PROFILE
    if save is not None:
        argv += ["--save", str(save)]
    return {"name": name, "min_workers": lo, "max_workers": hi, "steps": steps, "profile": str(profile),
            "cwd": str(ROOT), "argv": argv, "max_retries": 1}


def run_policy(policy: str, files: Path, work: Path) -> dict[str, Any]:
    state = work / policy / "pool"
    state.mkdir(parents=True)
    pool = Serve(state, "cpu:4", "--policy", policy, "--round-s", "2", "--tick-s", "0.3", "--quantum", str(QUANTUM),
                 "--resize-cost", "15").start()
    try:
        t0 = time.time()
        for name, at, kind, lo, hi, steps in WORKLOAD:
            while time.time() < t0 + at:
                time.sleep(0.2)
            pool.api("POST", "/api/jobs", body(files, name, kind, lo, hi, steps,
                                               files / f"{policy}-{name}.pt" if kind == "sleep" else None))
        names = [w[0] for w in WORKLOAD]
        wait_for(lambda: all(pool.job(n)["state"] in ("completed", "failed") for n in names), "every job to end",
                 deadline_s=1200, every=1.0)
        jobs = [pool.job(n) for n in names]
    finally:
        pool.stop()
        kill_jobs(state)
    return {"policy": policy, "jobs": jobs}


def analyse(run: dict[str, Any]) -> dict[str, Any]:
    jobs = run["jobs"]
    first = min(j["submitted"] for j in jobs)
    turn = [j["finished"] - j["submitted"] for j in jobs]
    resizes = sum(1 for j in jobs for l in j["launches"] if l["stop"] in ("resize", "preempt"))
    parts, floors = [], []
    for j in jobs:
        ls = j["launches"]
        for i, l in enumerate(ls):
            if i == 0 and l["first_update"] and l["started"]:
                floors.append(l["first_update"] - l["requested"])
            if l["stop"] in ("resize", "preempt") and i + 1 < len(ls) and ls[i + 1]["first_update"]:
                nxt = ls[i + 1]
                parts.append({"stop": l["ended"] - l["stop_requested"], "wait": nxt["requested"] - l["ended"],
                              "restart": nxt["first_update"] - nxt["requested"],
                              "total": nxt["first_update"] - l["stop_requested"]})
    return {"policy": run["policy"], "makespan": max(j["finished"] for j in jobs) - first,
            "avg_turnaround": statistics.mean(turn), "resizes": resizes,
            "failed": [j["name"] for j in jobs if j["state"] != "completed"], "resize_parts": parts,
            "restart_floor": statistics.median(floors) if floors else None,
            "rates": {j["name"]: [(l["workers"], l["first_update"], l["ended"]) for l in j["launches"]] for j in jobs}}


def calibration(job: dict, curve: dict[int, float]) -> float:
    """How much faster than its curve ``job`` ran, over all its launches: the minibatches each launch trained
    (from its start to the next launch's start, or to the job's end) against what the curve gives for that
    launch's worker count over its training time (first update to end). Falls back to the latest launch's
    measured rate."""
    ls = sorted(job["launches"], key=lambda l: l["requested"])
    done = trained = 0.0
    for i, l in enumerate(ls):
        if not (l["first_update"] and l["ended"]) or l.get("start_progress") is None:
            continue
        end_progress = ls[i + 1].get("start_progress") if i + 1 < len(ls) else job["steps"]
        if end_progress is None:
            continue
        done += max(0, end_progress - l["start_progress"])
        trained += curve[l["workers"]] * max(0.0, l["ended"] - l["first_update"])
    if done and trained:
        return done / trained
    last = ls[-1]["workers"]
    return (job["throughput"] or curve[last]) / curve[last]


def startup(job: dict, floor: float) -> float:
    """The job's own first start-up (request to first update), else the run's median one."""
    ls = sorted(job["launches"], key=lambda l: l["requested"])
    if ls and ls[0]["first_update"]:
        return ls[0]["first_update"] - ls[0]["requested"]
    return floor


def predict(policy: str, jobs: list[dict], resize_cost: float, floor: float, files: Path) -> dict[str, float]:
    """The simulator on the same workload: curves from the partitioner, scaled to each job's measured speed over all
    its launches, plus each job's own measured start-up."""
    from pipedream_ft.pool import Job, PlanSettings, ThroughputModel, simulate

    tm = ThroughputModel({"sleep": files / "sleep.prof.json", "digits": PROFILE}, PlanSettings(bandwidth=1e10))
    spec = {w[0]: w for w in WORKLOAD}
    first = min(j["submitted"] for j in jobs)
    sim_jobs, curves = [], {}
    for j in jobs:
        name, _, kind, lo, hi, steps = spec[j["name"]]
        curve = tm.curve(kind, range(lo, hi + 1))
        scale = calibration(j, curve)
        curves[name] = {n: r * scale for n, r in curve.items()}
        duration = steps / curves[name][hi] + startup(j, floor)
        sim_jobs.append(Job(name, j["submitted"] - first, kind, hi, duration, min_workers=lo, max_workers=hi))
    # the service counts a round-robin slice from the job's first update, the simulator from the decision:
    # the same slice there is the quantum plus the restart
    r = simulate(sim_jobs, curves, policy, devices=4, round_s=2.0, resize_cost=resize_cost,
                 policy_options={"quantum": QUANTUM + resize_cost, "resize_cost": 15.0})
    return {"makespan": r.makespan, "avg_turnaround": r.avg_jct, "resizes": r.resizes + r.preemptions}


def weights_check(files: Path, work: Path, policy_runs: list[dict]) -> dict[str, Any] | None:
    """A resized sleep job's final weights against the same job run uninterrupted on torchrun."""
    import torch

    candidates = [(run, j) for run in policy_runs for j in run["jobs"]]
    # a job whose size changed first, then one preempted and resumed
    candidates.sort(key=lambda rj: len({l["workers"] for l in rj[1]["launches"]}) < 2)
    for run, j in candidates:
        if True:
            spec = next(w for w in WORKLOAD if w[0] == j["name"])
            saved = files / f"{run['policy']}-{j['name']}.pt"
            if spec[2] != "sleep" or len(j["launches"]) < 2 or not saved.exists():
                continue
            ref = work / f"ref-{j['name']}.pt"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(spec[4]),
                   JOB, "--plan", str(files / f"sleep-{spec[4]}.plan.json"), "--steps", str(spec[5]), "--forward-ms",
                   str(FWD), "--backward-ms", str(BWD), "--ckpt", str(work / f"ref-{j['name']}-ck"), "--save", str(ref)]
            subprocess.run(cmd, env={**env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, check=True,
                           capture_output=True, timeout=900)
            a, b = torch.load(saved), torch.load(ref)
            diff = max(float((a[k] - b[k]).abs().max()) for k in a)
            return {"job": j["name"], "policy": run["policy"], "sizes": [l["workers"] for l in j["launches"]],
                    "max_abs_diff": diff}
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="fifo,elastic-fifo,round-robin,goodput")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-pool-run-"))
    files = work / "files"
    subprocess.run([sys.executable, JOB, "prepare", str(files), "--forward-ms", str(FWD), "--backward-ms", str(BWD)],
                   env=env(), check=True)
    for n in (1, 2):
        digits_plan(n, files / f"digits-{n}.plan.json")
    runs, rows = [], []
    for policy in args.policies.split(","):
        run = run_policy(policy, files, work)
        runs.append(run)
        a = analyse(run)
        # a resize's cost to the job is its stop and its restart; waiting for devices is the policy's doing
        costs = [p["stop"] + p["restart"] for p in a["resize_parts"]]
        cost = statistics.median(costs) if costs else (a["restart_floor"] or 15.0)
        a["predicted"] = predict(policy, run["jobs"], cost, a["restart_floor"] or 0.0, files)
        a["resize_cost"] = cost
        rows.append(a)
        p = a["predicted"]
        print(f"{policy:<12} makespan {a['makespan']:6.1f} s (sim {p['makespan']:6.1f}, "
              f"{100 * (p['makespan'] / a['makespan'] - 1):+.0f} %)  avg turnaround {a['avg_turnaround']:6.1f} s "
              f"(sim {p['avg_turnaround']:6.1f}, {100 * (p['avg_turnaround'] / a['avg_turnaround'] - 1):+.0f} %)  "
              f"resizes {a['resizes']} (sim {p['resizes']})  failed {a['failed'] or 'none'}", flush=True)
        for part in a["resize_parts"]:
            print(f"    resize: stop {part['stop']:.1f} s + wait {part['wait']:.1f} s + restart {part['restart']:.1f} s "
                  f"= {part['total']:.1f} s (restart floor of a first launch {a['restart_floor']:.1f} s)", flush=True)
    w = weights_check(files, work, runs)
    if w:
        print(f"weights: {w['job']} under {w['policy']} on sizes {w['sizes']} vs uninterrupted: max |diff| "
              f"{w['max_abs_diff']:.2e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"policies": rows, "weights": w, "runs": runs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
