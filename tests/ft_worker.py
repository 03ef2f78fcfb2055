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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--total", type=int, default=40)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sleep-ms", type=float, default=0.0, help="per forward, to stretch the run")
    ap.add_argument("--storage-options", default=None, help="fsspec storage options as JSON")
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from pipedream_ft import CheckpointConfig
    from pipedream_ft import shutdown
    from pipedream_ft.policies import EveryNSteps
    from pipedream_ft import PipelineConfig, PipelineTrainer

    def slow_data(b: int):
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        return data(b)

    options = json.loads(args.storage_options) if args.storage_options else None
    model = mlp()
    plan = plan_for(model, [[0, 1], [2, 3], [4, 5], [6, 7, 8]])
    t_start = time.time()
    trainer = PipelineTrainer(
        model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=adam,
        config=PipelineConfig(timeout_s=args.timeout, watchdog_s=args.timeout + 5),
        checkpoint=CheckpointConfig(url=args.ckpt, storage_options=options, policy=EveryNSteps(args.every),
                                    commit_timeout_s=60),
    )
    t_ready = time.time()
    if trainer.env.rank == 0:  # one line per attempt: where each one resumed from
        with open(args.out + ".attempts", "a") as f:
            f.write(json.dumps({"attempt": trainer.env.restart_count, "resumed_from": trainer.resumed_from}) + "\n")
    result = trainer.fit(slow_data, args.total)
    state = trainer.full_state_dict()
    if trainer.env.rank == 0:
        torch.save(state, args.out)
        with open(args.out + ".json", "w") as f:
            json.dump({"resumed_from": trainer.resumed_from, "attempt": trainer.env.restart_count,
                       "start_time": t_start, "ready_time": t_ready, "losses": result.losses}, f)
    trainer.close()
    shutdown()


if __name__ == "__main__":
    from pipedream_ft.errors import exit_on_error

    exit_on_error(main)
