"""A training script for the fault-injection suite, launched by torchrun.

Trains the test MLP as a 4-stage pipeline, checkpointing to ``--ckpt`` every ``--every`` minibatches, until
``--total`` minibatches; rank 0 then writes the final weights to ``--out``. Faults come from
``PIPEDREAM_FT_FAULTS``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from runtime_cases import adam, data, mlp, plan_for  # noqa: E402


class EndingSource:
    """A resumable stream of minibatches with no len(): the trainer learns that it ended only when it does."""

    def __init__(self, fn, n: int) -> None:
        self.fn, self.n, self.i = fn, n, 0

    def __iter__(self):
        while self.i < self.n:
            self.i += 1
            yield self.fn(self.i - 1)

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--total", type=int, default=40)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sleep-ms", type=float, default=0.0, help="per forward, to stretch the run")
    ap.add_argument("--storage-options", default=None, help="fsspec storage options as JSON")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--memory-every", type=int, default=None, help="memory-tier checkpoints (default: off)")
    ap.add_argument("--odd-replacement", action="store_true",
                    help="a replacement process (in-place recovery) runs another plan (a bad-input test)")
    ap.add_argument("--source-ends", type=int, default=None,
                    help="feed a stateful iterable without len() that ends after this many minibatches")
    ap.add_argument("--mode", default="stash", help="training mode (flush: windows of 4 minibatches)")
    ap.add_argument("--schedule", default="1f1b", help="flush mode's schedule")
    ap.add_argument("--hold", nargs=2, default=None, metavar=("MINIBATCH", "FILE"),
                    type=lambda v: int(v) if v.isdigit() else v,
                    help="wait before minibatch MINIBATCH's data while FILE exists (a test's hold on training)")
    ap.add_argument("--meta", action="store_true",
                    help="build the model on the meta device: each process materialises and seeds its stage only")
    ap.add_argument("--linger", default=None,
                    help="before closing the trainer, wait until this file exists (keeps the job alive)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from pipedream_ft import CheckpointConfig
    from pipedream_ft import shutdown
    from pipedream_ft.policies import EveryNSteps
    from pipedream_ft import PipelineConfig, PipelineTrainer, read_env

    def slow_data(b: int):
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        if args.hold is not None and b == args.hold[0]:  # a test holds training here until it removes the file
            deadline = time.monotonic() + 240
            while os.path.exists(args.hold[1]) and time.monotonic() < deadline:
                time.sleep(0.05)
        return data(b)

    options = json.loads(args.storage_options) if args.storage_options else None
    if args.meta:
        with torch.device("meta"):
            model = mlp()
    else:
        model = mlp()
    stages = [[0, 1], [2, 3], [4, 5], [6, 7, 8]]
    if args.odd_replacement and read_env().incarnation > 0:
        stages = [[0, 1, 2], [3], [4, 5], [6, 7, 8]]
    plan = plan_for(model, stages)
    t_start = time.time()
    trainer = PipelineTrainer(
        model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=adam,
        config=PipelineConfig(timeout_s=args.timeout, watchdog_s=args.timeout + 5, mode=args.mode, flush_every=4,
                              schedule=args.schedule),
        checkpoint=CheckpointConfig(url=args.ckpt, storage_options=options, policy=EveryNSteps(args.every),
                                    memory_policy=EveryNSteps(args.memory_every) if args.memory_every else None,
                                    commit_timeout_s=60),
    )
    t_ready = time.time()
    with open(args.out + ".ranks", "a") as f:  # which machine (torchrun node) each rank's process ran on
        f.write(json.dumps({"rank": trainer.env.rank, "node": trainer.env.node, "pid": os.getpid(),
                            "attempt": trainer.env.restart_count}) + "\n")
    if trainer.env.rank == 0:  # one line per attempt: where each one resumed from
        with open(args.out + ".attempts", "a") as f:
            f.write(json.dumps({"attempt": trainer.env.restart_count, "incarnation": trainer.env.incarnation,
                                "resumed_from": trainer.resumed_from}) + "\n")
    source = slow_data if args.source_ends is None else EndingSource(slow_data, args.source_ends)
    result = trainer.fit(source, args.total)
    state = trainer.full_state_dict()
    if trainer.env.rank == 0:
        torch.save(state, args.out)
        with open(args.out + ".json", "w") as f:
            json.dump({"resumed_from": trainer.resumed_from, "attempt": trainer.env.restart_count,
                       "incarnation": trainer.env.incarnation, "recoveries": trainer.recoveries,
                       "start_time": t_start, "ready_time": t_ready, "losses": result.losses,
                       "start": result.start}, f)
    if args.linger:
        deadline = time.monotonic() + 300
        while not os.path.exists(args.linger) and time.monotonic() < deadline:
            time.sleep(0.1)
    trainer.close()
    shutdown()


if __name__ == "__main__":
    import pipedream_ft

    # PIPEDREAM_FT_RECOVERY (set by the tests) picks in-place recovery or torchrun restarts
    pipedream_ft.launch(main)
