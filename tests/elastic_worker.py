"""A training script for the elastic test, launched by torchrun agents with ``--nnodes=MIN:MAX``.

Trains the test MLP from a 4-worker straight plan, re-planning whenever the world size differs, checkpointing
every ``--every`` minibatches; rank 0 appends one JSON line per attempt to ``--events`` (world size, plan, where it
resumed from, the losses it trained).
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

from runtime_cases import adam, data, mlp, plan_for, timed_profile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--total", type=int, default=200)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--sleep-ms", type=float, default=30.0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from pipedream_ft import CheckpointConfig
    from pipedream_ft import shutdown
    from pipedream_ft.policies import EveryNSteps
    from pipedream_ft import PipelineConfig, PipelineTrainer

    def slow_data(b: int):
        time.sleep(args.sleep_ms / 1000)
        return data(b)

    model = mlp()
    plan = plan_for(model, [[0, 1], [2, 3], [4, 5], [6, 7, 8]], None,
                    {"workers": [4], "bandwidth": [1e9], "straight": True})
    trainer = PipelineTrainer(
        model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=adam,
        config=PipelineConfig(timeout_s=6, watchdog_s=20, summary=False),
        checkpoint=CheckpointConfig(url=args.ckpt, policy=EveryNSteps(args.every), commit_timeout_s=30),
        profile=timed_profile(model),
    )
    entry = {"attempt": trainer.env.restart_count, "world": trainer.env.world_size,
             "stages": [list(s.layers) for s in trainer.plan.stages], "resumed_from": trainer.resumed_from,
             "start": trainer.position, "timeline": trainer.timeline}
    if trainer.env.rank == 0:
        with open(args.events, "a") as f:
            f.write(json.dumps({**entry, "event": "started"}) + "\n")
    if trainer.position < args.total:  # a few minibatches first, to report when the first update happened
        trainer.train(slow_data, min(8, args.total - trainer.position))
        if trainer.env.rank == 0:
            with open(args.events, "a") as f:
                f.write(json.dumps({**entry, "event": "running", "timeline": trainer.timeline}) + "\n")
    result = trainer.fit(slow_data, args.total)
    if trainer.env.rank == 0:
        with open(args.events, "a") as f:
            f.write(json.dumps({**entry, "event": "finished", "losses": result.losses,
                                "position": trainer.position}) + "\n")
    trainer.close()
    shutdown()


if __name__ == "__main__":
    from pipedream_ft.reporting import exit_on_error

    exit_on_error(main)
