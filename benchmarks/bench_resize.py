"""Time of an elastic resize: detection, restart + rendezvous, re-plan + reshard-load, first step.

Two torchrun agents (2 workers each) share a c10d rendezvous on loopback and train the test MLP
(``tests/elastic_worker.py``). The benchmark kills the second agent with all its workers (a lost node) and
reads the surviving attempt's milestones (``PipelineTrainer.timeline``): from the kill to its workers'
start (detection + restart + rendezvous), to ``joined`` (process group formed), to ``restored`` (re-planned for
2 workers and the checkpoint resharded into the new stages), to ``first_update``. Then it starts the agent
again and measures the grow-back the same way, from the new agent's launch. It also times the re-plan alone on
a 700-layer profile for several worker counts.

    python benchmarks/bench_resize.py

The agents run with ``keep_alive_interval=1,keep_alive_max_attempt=3`` so the rendezvous drops a lost node
after about 3 s (torchrun's defaults, 5 s x 3, add about 10 s to the shrink).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

__all__ = ["main"]


def _agent(port: int, tmp: Path, name: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--max-restarts", "6", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "resize-bench", "--monitor-interval", "0.5", "--rdzv-conf",
           "join_timeout=90,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3", str(ROOT / "tests" / "elastic_worker.py"),
           "--ckpt", str(tmp / "ckpt"), "--events", str(tmp / "events.jsonl"), "--total", "1500",
           "--sleep-ms", "40", "--every", "8"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.Popen(cmd, env=env, stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill_tree(pid: int) -> None:
    pids, frontier = [pid], [pid]
    while frontier:
        out = subprocess.run(["pgrep", "-P", str(frontier.pop())], capture_output=True, text=True).stdout
        kids = [int(x) for x in out.split()]
        pids += kids
        frontier += kids
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _events(tmp: Path) -> list[dict]:
    p = tmp / "events.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def _wait(pred, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise SystemExit("bench_resize: the job did not reach the expected state in time")
        time.sleep(0.2)


def _row(label: str, t0: float, tl: dict) -> str:
    phases = [("restart+rendezvous", tl["start"] - t0), ("join group", tl["joined"] - tl["start"]),
              ("re-plan+reshard-load", tl["restored"] - tl["joined"]),
              ("first step", tl["first_update"] - tl["restored"])]
    total = tl["first_update"] - t0
    return f"{label:<22}" + "".join(f"{v:>22.2f}" for _, v in phases) + f"{total:>12.2f}"


def main() -> int:
    from bench_partitioner import resnet_like_profile
    from pipedream_ft.ft.elastic import replan

    prof = resnet_like_profile()
    print(f"re-plan alone ({len(prof)}-layer profile):")
    for workers in (4, 16, 31, 64):
        t = time.perf_counter()
        plan = replan(prof, workers, {"workers": [32], "bandwidth": [1e10]})
        print(f"  {workers:4d} workers: {time.perf_counter() - t:6.2f} s  ({plan.num_stages} stages)")

    from dist_helpers import free_port

    tmp = Path(tempfile.mkdtemp(prefix="bench-resize-"))
    port = free_port()
    a = _agent(port, tmp, "a")
    b = None
    try:
        time.sleep(1.0)
        b = _agent(port, tmp, "b1")
        _wait(lambda: any(e["world"] == 4 for e in _events(tmp)), 120)
        time.sleep(5)
        t_kill = time.time()
        _kill_tree(b.pid)
        _wait(lambda: any(e["world"] == 2 and e["event"] == "running" for e in _events(tmp)), 150)
        time.sleep(6)
        t_launch = time.time()
        b = _agent(port, tmp, "b2")
        a.wait(timeout=400)
        b.wait(timeout=60)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                _kill_tree(p.pid)
    ev = _events(tmp)
    shrink = next(e for e in ev if e["world"] == 2 and e["event"] == "running")
    grow = [e for e in ev if e["world"] == 4 and e["resumed_from"] is not None and e["event"] == "running"]
    header = f"{'resize':<22}" + "".join(f"{h:>22}" for h in ("restart+rendezvous", "join group",
                                                               "re-plan+reshard-load", "first step")) + \
        f"{'total s':>12}"
    print("\nresize of a 4-worker job (2 agents x 2 workers), seconds:")
    print(header)
    print(_row("4 -> 2 (node lost)", t_kill, shrink["timeline"]))
    if grow:
        print(_row("2 -> 4 (node back)", t_launch, grow[-1]["timeline"]))
    print("\n(the 4 -> 2 row starts at the kill; detection is immediate here because the lost workers' sockets "
          "close; the 2 -> 4 row starts when the new agent is launched)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
