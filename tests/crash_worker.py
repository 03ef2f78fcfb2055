"""A torchrun training script whose user code fails the same way every time (for test_crash_errors.py).

``--error before``: a ``ValueError`` from the script before its trainer exists; ``--error fit``: ``trainer.fit``
with a total that is not a multiple of the replicated stage's replica count (2); ``--error during``: a
``ValueError`` from the data function of rank ``--rank`` at minibatch ``--at``, in every process of that rank.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import pipedream_ft  # noqa: E402
from runtime_cases import data, mlp, plan_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--error", choices=["before", "fit", "during"], required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--at", type=int, default=6)
    ap.add_argument("--total", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if args.error == "before":
        raise ValueError(f"bad dataset path on rank {rank}")

    from pipedream_ft import CheckpointConfig, EveryNSteps, PipelineConfig, PipelineTrainer

    model = mlp()
    if args.error == "fit":  # stage 0 on two replicas: totals must be even
        plan = plan_for(model, [[0, 1, 2, 3], [4, 5], [6, 7, 8]], [2, 1, 1])
    else:
        plan = plan_for(model, [[0, 1], [2, 3], [4, 5], [6, 7, 8]])

    def source(b: int):
        if args.error == "during" and rank == args.rank and b == args.at:
            raise ValueError(f"corrupt record in minibatch {b}")
        return data(b)

    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy,
                              optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.05),
                              config=PipelineConfig(timeout_s=8, summary=False),
                              checkpoint=CheckpointConfig(memory_policy=EveryNSteps(4)))
    trainer.fit(source, args.total + (1 if args.error == "fit" else 0))
    trainer.close()


if __name__ == "__main__":
    pipedream_ft.launch(main)
