"""Recovery time after a worker dies: in-place recovery against torchrun's whole-group restarts, measured in one run.

Run: ``python benchmarks/bench_recovery.py [--failures 5] [--peer-failures 3] [--quick] [--no-peers] [--no-hang]``.
Model flags: ``--width 1024 --blocks 8 --batch 16`` (8.4M parameters, the fault-tolerance benchmarks' MLP as a
straight 4-stage pipeline on 4 CPU processes, ``OMP_NUM_THREADS=1``); ``--memory-every 4`` (memory-tier
checkpoint interval), ``--timeout 5`` (peer timeout).

Every job runs :mod:`recovery_worker` under ``torchrun --nproc-per-node 4`` and :func:`pipedream_ft.launch`; the
``k``-th failure kills (SIGKILL) one worker's training process as it starts a given minibatch, after stamping the
time ``K``. Each process records its milestones (see :mod:`recovery_worker`). For every failure:

**In place** (``PIPEDREAM_FT_RECOVERY=in-place``, ``--max-restarts 0``: a torchrun restart would fail the job):

- *detection*: ``K`` → every survivor has noticed (a broken connection) and the replacement process is running
  (its supervisor forked it, torch already imported);
- *re-forming*: → every rank has joined the next epoch and the group is formed (the newest cut every rank can
  restore agreed on);
- *restore*: → every rank has built the epoch's process groups and loaded the cut (the memory tier);
- *first step*: → every stage's first optimizer step after the rollback (pre-flight and recomputed in-flight
  minibatches included). *total* = ``K`` → that step. *redone*: minibatches between the cut and the failure.

**Peers** (``PIPEDREAM_FT_RECOVERY=restart``): torchrun restarts every worker, with its default start method
(a fresh interpreter imports torch) and with ``--run-path --start-method fork`` (workers forked from the agent,
torch imported); they resume from the newest checkpoint every rank has (the memory tier of the node, else the
durable one). *total* = ``K`` → every stage's first optimizer step in the new attempt.

**Hung worker** (``--no-hang`` to skip): one worker is SIGSTOPped and never continued; its neighbours notice after
the peer timeout, the group evicts it, its supervisor kills it and starts a replacement. Reported: the time from
the hang to every stage's first step after the recovery, minus the peer timeout.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
WORKER = _HERE / "recovery_worker.py"

__all__ = ["main"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(events: Path, recovery: str, kills: list[tuple[int, int]], total: int, args: argparse.Namespace,
            *, fork: bool = False, hang: bool = False, restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", f"--max-restarts={restarts}",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}", "--monitor-interval", "0.1"]
    if fork:
        cmd += ["--run-path", "--start-method", "fork"]
    cmd += [str(WORKER), "--events", str(events), "--total", str(total), "--width", str(args.width),
            "--blocks", str(args.blocks), "--batch", str(args.batch), "--memory-every", str(args.memory_every),
            "--timeout", str(args.timeout), "--kills", ",".join(f"{r}:{s}" for r, s in kills)]
    if hang:
        cmd.append("--hang")
    env = dict(os.environ, OMP_NUM_THREADS="1", PIPEDREAM_FT_RECOVERY=recovery,
               PYTHONPATH=os.pathsep.join([str(_HERE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"bench_recovery: the {recovery} job failed (exit status {proc.returncode})")
    return proc


def _load(events: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    procs = [json.loads(Path(p).read_text()) for p in glob.glob(str(events / "r*-a*-i*.json"))]
    kills = sorted((json.loads(Path(p).read_text()) for p in glob.glob(str(events / "kill-*.json"))),
                   key=lambda k: k["attempt"])
    return procs, kills


def in_place_phases(events: Path) -> list[dict[str, float]]:
    """Per failure: detection, re-forming, restore, first step, total (seconds) and redone (minibatches)."""
    procs, kills = _load(events)
    rows = []
    for k in kills:
        t0, epoch = k["time"], k["attempt"] + 1
        survivors = [r for p in procs for r in p["recoveries"] if r.get("epoch") == epoch and "first_update" in r]
        replacements = [p for p in procs if p["incarnation"] >= 1 and p["main_start"] > t0
                        and p["timeline"].get("formed", 0) > 0 and p["rank"] == k["rank"]]
        replacement = min(replacements, key=lambda p: p["main_start"])["timeline"] if replacements else None
        if not survivors or replacement is None:
            continue
        noticed = max([r["failed"] for r in survivors] + [min(p["main_start"] for p in replacements)])
        formed = max([r["formed"] for r in survivors] + [replacement["formed"]])
        restored = max([r["restored"] for r in survivors] + [replacement["restored"]])
        first = max([r["first_update"] for r in survivors] + [replacement["first_update"]])
        rows.append({"rank": k["rank"], "step": k["step"], "detection": noticed - t0, "re-forming": formed - noticed,
                     "restore": restored - formed, "first step": first - restored, "total": first - t0,
                     "redone": k["step"] - survivors[0]["cut"]})
    return rows


def restart_totals(events: Path) -> list[float]:
    """Per failure of a restart job: the kill to every stage's first optimizer step in the next attempt."""
    procs, kills = _load(events)
    out = []
    for k in kills:
        nxt = [p for p in procs if p["attempt"] == k["attempt"] + 1]
        if len(nxt) == 4 and all("first_update" in p["timeline"] for p in nxt):
            out.append(max(p["timeline"]["first_update"] for p in nxt) - k["time"])
    return out


def _kills(n: int, spacing: int, first: int = 30) -> list[tuple[int, int]]:
    ranks = [2, 1, 3, 0]
    return [(ranks[i % 4], first + i * spacing) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--failures", type=int, default=5, help="in-place failures (default 5)")
    ap.add_argument("--peer-failures", type=int, default=3, help="failures per torchrun restart peer (default 3)")
    ap.add_argument("--spacing", type=int, default=40, help="minibatches between failures")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--memory-every", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--quick", action="store_true", help="2 in-place failures, 1 per peer")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-hang", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.failures, args.peer_failures = 2, 1
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    try:
        params = args.blocks * (args.width * args.width + args.width) + args.width * 16 + 16
        print(f"4 CPU ranks, {params / 1e6:.1f}M parameters, memory tier every {args.memory_every} minibatches, "
              f"peer timeout {args.timeout:.0f}s", flush=True)
        kills = _kills(args.failures, args.spacing)
        run_job(work / "inplace", "in-place", kills, kills[-1][1] + args.spacing, args)
        rows = in_place_phases(work / "inplace")
        cols = ["detection", "re-forming", "restore", "first step", "total"]
        print(f"\nin-place recovery, kill -9 of one worker's training process ({len(rows)} failures):")
        print(f"{'failure':>7} {'rank':>4} " + " ".join(f"{c:>10}" for c in cols) + f" {'redone':>6}")
        for i, r in enumerate(rows):
            print(f"{i + 1:>7} {r['rank']:>4} " + " ".join(f"{r[c]:>9.3f}s" for c in cols) + f" {r['redone']:>6}")
        if rows:
            print(f"{'median':>12} " + " ".join(f"{statistics.median(r[c] for r in rows):>9.3f}s" for c in cols))
        median = statistics.median(r["total"] for r in rows) if rows else float("nan")
        peers: dict[str, float] = {}
        if not args.no_peers:
            for label, fork in (("torchrun restart (default start)", False),
                                ("torchrun restart (--run-path --start-method fork)", True)):
                pk = _kills(args.peer_failures, args.spacing)
                events = work / ("fork" if fork else "spawn")
                run_job(events, "restart", pk, pk[-1][1] + args.spacing, args, fork=fork,
                        restarts=args.peer_failures)
                totals = restart_totals(events)
                if totals:
                    peers[label] = statistics.median(totals)
                    print(f"{label}: kill -> every stage's first step, median {peers[label]:.3f}s over "
                          f"{len(totals)} failures ({', '.join(f'{t:.2f}' for t in totals)})", flush=True)
        print(f"\nin-place median {median:.3f}s (target <= 1.5s)"
              + "".join(f"; {median / v:.2f}x {k}" for k, v in peers.items()))
        if not args.no_hang:
            hk = [(3, 30)]
            run_job(work / "hang", "in-place", hk, 30 + args.spacing, args, hang=True)
            hang = in_place_phases(work / "hang")
            if hang:
                extra = hang[0]["total"] - args.timeout
                print(f"hung worker (SIGSTOP, never continued): recovered {hang[0]['total']:.2f}s after the hang = "
                      f"peer timeout {args.timeout:.0f}s + {extra:.2f}s (target: + 1.5s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
