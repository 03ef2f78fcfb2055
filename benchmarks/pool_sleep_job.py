"""A pool job whose speed comes from its allocation: a pipeline of sleep layers (see ``sleep_model.py``).

``prepare OUT --layers L --forward-ms F --backward-ms B`` writes ``OUT/sleep.prof.json`` (the layers' true
costs) and ``OUT/sleep-N.plan.json`` for N = 1..L. Under torchrun,
``pool_sleep_job.py --plan P --steps T [--ckpt URL] [--mode flush] [--save W.pt]`` trains on a fixed random
dataset, checkpoints every ``--ckpt-every`` minibatches and resumes from the newest checkpoint (re-planning when
the world size differs from the plan's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def prepare(out: Path, layers: int, forward_ms: float, backward_ms: float) -> None:
    from dataclasses import replace

    from partitioner.optimizer import partition
    from profiler import structure_profile
    from profiler.profile import Profile
    from sleep_model import sleep_model

    prof = structure_profile(sleep_model(layers, forward_ms, backward_ms))
    prof = Profile(tuple(replace(l, forward_ms=forward_ms, backward_ms=backward_ms, activation_bytes=1024.0)
                         for l in prof.layers), prof.edges, {**prof.meta, "structure_only": False})
    out.mkdir(parents=True, exist_ok=True)
    (out / "sleep.prof.json").write_text(json.dumps(prof.to_json()))
    for n in range(1, layers + 1):
        plan = partition(prof, n, 1e10, straight=True)
        (out / f"sleep-{n}.plan.json").write_text(json.dumps(plan.to_json()))


def train(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt")
    ap.add_argument("--ckpt-every", type=int, default=8)
    ap.add_argument("--mode", default="flush")
    ap.add_argument("--flush-every", type=int, default=4)
    ap.add_argument("--forward-ms", type=float, default=5.0)
    ap.add_argument("--backward-ms", type=float, default=10.0)
    ap.add_argument("--save")
    args = ap.parse_args(argv)

    import torch
    from torch import nn

    from partitioner.plan import load_plan
    from pipedream_ft import CheckpointConfig, PipelineConfig, PipelineTrainer
    from pipedream_ft.policies import EveryNSteps
    from sleep_model import sleep_model

    torch.set_num_threads(1)
    plan = load_plan(args.plan)
    torch.manual_seed(0)
    model = sleep_model(len(plan.layer_names) if plan.layer_names else 4, args.forward_ms, args.backward_ms)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(64, 8, 4, generator=g), torch.randn(64, 8, 4, generator=g)

    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return xs[b % 64], ys[b % 64]

    trainer = PipelineTrainer(
        model, plan, loss_fn=nn.functional.mse_loss,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01),
        config=PipelineConfig(mode=args.mode, flush_every=args.flush_every, timeout_s=60, summary=False),
        checkpoint=CheckpointConfig(url=args.ckpt, policy=EveryNSteps(args.ckpt_every)) if args.ckpt else None,
    )
    trainer.fit(data, args.steps)
    state = trainer.full_state_dict()
    trainer.close()
    if trainer.env.rank == 0:
        print(f"trained to minibatch {trainer.position}", flush=True)
        if args.save:
            torch.save(state, args.save)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "prepare":
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        p.add_argument("out", type=Path)
        p.add_argument("--layers", type=int, default=4)
        p.add_argument("--forward-ms", type=float, default=5.0)
        p.add_argument("--backward-ms", type=float, default=10.0)
        a = p.parse_args()
        prepare(a.out, a.layers, a.forward_ms, a.backward_ms)
    else:
        import pipedream_ft

        pipedream_ft.launch(train, sys.argv[1:])  # one-line errors, clean teardown, recovery under torchrun
