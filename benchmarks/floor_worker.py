"""torchrun's restart floor for :mod:`bench_recovery`: a trivial training script killed the way the others are.

Each worker imports torch, builds one ``Linear`` layer and its SGD optimizer (building the first optimizer
imports ``torch._dynamo``, part of any PyTorch training script's start) and takes one step every
``--step-ms``; the worker of rank ``R`` in ``--kills R:S`` kills itself (SIGKILL) at step ``S`` of torchrun's
first attempt, after writing the time to ``--events/kill-0.json``. Every process writes
``--events/r{rank}-a{attempt}-i0.json`` with the time its interpreter started running this file (``started``),
``main_start`` (imports done) and ``timeline.first_update`` (its first step), like :mod:`recovery_worker`.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


def main() -> None:
    main_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", required=True)
    ap.add_argument("--kills", default="")
    ap.add_argument("--total", type=int, default=60)
    ap.add_argument("--step-ms", type=float, default=20.0)
    args, _ = ap.parse_known_args()
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # forked by torchrun's agent (fork start), not its handler
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = Path(args.events)
    events.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "attempt": attempt, "incarnation": 0, "started": STARTED, "main_start": main_start,
              "timeline": {}, "recoveries": []}
    layer = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(layer.parameters(), lr=0.01)
    kill = [(int(r), int(s)) for r, s in (k.split(":") for k in args.kills.split(",") if k)][:1]
    for step in range(args.total):
        if attempt == 0 and kill and kill[0] == (rank, step):
            (events / "kill-0.json").write_text(json.dumps({"time": time.time(), "rank": rank, "step": step,
                                                            "attempt": 0}))
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        layer(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        if step == 0:
            record["timeline"]["first_update"] = time.time()
            (events / f"r{rank}-a{attempt}-i0.json").write_text(json.dumps(record))
        time.sleep(args.step_ms / 1000)


if __name__ == "__main__":
    main()
