"""The pipedream-ft demo, on CPU: profile → plan → train on 4 processes → kill a worker → recover → look.

    python examples/demo.py [--out runs/demo] [--steps 300] [--kill-at 130]

1. profiles ``pipedream_ft_examples.models:digits_cnn`` layer by layer (``pipedream-profile``),
2. plans it for 4 workers with PipeDream's dynamic program (``pipedream-partition``),
3. trains it on scikit-learn's digits with ``torchrun`` on 4 CPU processes, checkpointing to a local directory,
   with rank 2's training process killed (SIGKILL) part-way; its supervisor starts a replacement, the other three
   keep their processes, and all four go on from the newest checkpoint they all have (in-place recovery),
4. prints the ends of the loss curve, the recovery, the work redone, and where the timeline PNG is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


_MEANING = {
    "held-out": ": the share of digits the trained model, never shown them, classifies right; guessing is 0.10, "
                "bad well under 0.9",
    "time": ": training's wall time on this machine, the recovery included; 4 processes share its cores",
}
"""What the training log's figures mean, added to the lines the demo repeats (by their first word)."""


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> str:
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"demo: step failed with exit status {proc.returncode}: {' '.join(cmd[:4])} ...")
    return proc.stdout + proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_up_python(root: Path = ROOT) -> Path | None:
    """The checkout's virtualenv's Python (``.venv``, where ``.ci/run`` sets up) when it is not this one and has
    PyTorch and pipedream-ft; else ``None``."""
    venv = root / ".venv" / "bin" / "python"
    if not venv.exists() or Path(sys.executable) == venv or os.environ.get("PIPEDREAM_FT_DEMO_VENV"):
        return None
    probe = subprocess.run([str(venv), "-c", "import torch, pipedream_ft_examples"], capture_output=True,
                           timeout=120)
    return venv if probe.returncode == 0 else None


def require_setup() -> None:
    """Before any step starts: when this Python lacks PyTorch or pipedream-ft, run the demo with the checkout's
    set-up virtualenv if it has them (saying so), else one line and exit status 2."""
    missing = []
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "torch":
            raise
        missing.append("PyTorch")
    if importlib.util.find_spec("pipedream_ft_examples") is None:
        missing.append("pipedream-ft")
    if not missing:
        return
    what = f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed for {sys.executable}"
    venv = set_up_python()
    if venv is not None:
        print(f"demo: {what}; running with the checkout's virtualenv, {venv}", file=sys.stderr, flush=True)
        env = dict(os.environ, PIPEDREAM_FT_DEMO_VENV="1")
        raise SystemExit(subprocess.run([str(venv), str(Path(__file__).resolve()), *sys.argv[1:]], env=env).returncode)
    print(f"demo: error: {what}; set up first, from {ROOT}: pip install torch==2.13.0 && pip install -e \".[test]\" "
          "(the README's first command)", file=sys.stderr)
    raise SystemExit(2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo", help="output directory (default runs/demo; emptied first)")
    ap.add_argument("--steps", type=int, default=300, help="minibatches to train (default 300)")
    ap.add_argument("--kill-at", type=int, default=130, help="minibatch at which rank 2 is killed (default 130)")
    ap.add_argument("--ckpt-every", type=int, default=25, help="minibatches between checkpoints (default 25)")
    args = ap.parse_args()
    require_setup()
    out = (ROOT / args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    py = sys.executable
    t0 = time.time()

    print("== 1. profile", flush=True)
    run([py, "-m", "profiler.cli", "pipedream_ft_examples.models:digits_cnn", "--input-shape", "1,8,8", "--batch-size", "32",
         "-o", str(out / "digits.prof.json")])
    print("== 2. plan a straight 4-stage pipeline for 4 workers (--straight: a model this small is usually planned "
          "as plain data parallelism, and the demo shows a pipeline; the speedup line says what that costs)",
          flush=True)
    print(run([py, "-m", "partitioner.cli", str(out / "digits.prof.json"), "--workers", "4", "--bandwidth", "1e9",
               "--straight", "-o", str(out / "digits.plan.json")]).rstrip())

    print(f"== 3. train on 4 CPU processes; rank 2 is killed at minibatch {args.kill_at}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PIPEDREAM_FT_FAULTS=f"kill@rank=2,step={args.kill_at}",
               PIPEDREAM_FT_TRACE_DIR=str(out / "trace"), PIPEDREAM_FT_METRICS_DIR=str(out / "metrics"))
    log = run([py, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.5",
               "examples/train_digits.py", "--plan", str(out / "digits.plan.json"), "--steps", str(args.steps),
               "--ckpt", str(out / "checkpoints"), "--ckpt-every", str(args.ckpt_every), "--timeout", "10"],
              env=env)
    (out / "train.log").write_text(log)
    for line in log.splitlines():
        if line.startswith(("pipedream-ft:", "held-out accuracy", "time ")) and "Traceback" not in line:
            print("   " + line + _MEANING.get(line.split(" ", 1)[0], ""))

    print("== 4. results", flush=True)
    records = [json.loads(l) for p in sorted((out / "metrics").glob("metrics-rank*.jsonl"))
               for l in p.read_text().splitlines() if l.strip()]
    # one loss per minibatch: a minibatch redone after a recovery has a record from each process that ran it
    by_minibatch = {r["minibatches"]: r["loss"] for r in sorted(records, key=lambda r: r["time"]) if "loss" in r}
    curve = [by_minibatch[b] for b in sorted(by_minibatch)]
    first, last = curve[:20], curve[-20:]
    print(f"   loss: first 20 minibatches {sum(first) / len(first):.4f} → last 20 {sum(last) / len(last):.4f} (mean "
          "cross-entropy per minibatch; guessing among the 10 digits is ln 10 = 2.30; bad if the last 20 are not well "
          "under the first)")
    attempts = sorted({r["attempt"] for r in records})
    redone = max((r["redone"] for r in records if r["attempt"] == attempts[-1]), default=0)
    recovered = [l for l in log.splitlines() if "recovered in place" in l]
    resumed = [l for l in log.splitlines() if "resumed from checkpoint" in l]
    if recovered:
        print(f"   recovery: {recovered[0].split(': ', 1)[1]}")
    print(f"   restarts of the whole group: {len(attempts) - 1}"
          + (f" — {resumed[0].split(': ', 1)[1]}" if resumed else "")
          + " (0 when the recovery above was in place; above 0, torchrun restarted every process instead)")
    print(f"   work redone after the failure: {redone} minibatches (run again from the newest checkpoint every process "
          f"held: memory checkpoints every 8, durable every {args.ckpt_every}; more than that means checkpoints were "
          "missing)")
    from pipedream_ft.observe.plot import draw_timeline
    from pipedream_ft.observe.timeline import merge_traces, trace_files

    trace = merge_traces(trace_files(out / "trace"))
    (out / "timeline.json").write_text(json.dumps(trace))
    draw_timeline(trace, str(out / "timeline.png"), title="pipedream-ft demo: 4 stages, one worker killed")
    print(f"   timeline: {out / 'timeline.png'} (trace for Perfetto/chrome://tracing: {out / 'timeline.json'})")
    print(f"== done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
