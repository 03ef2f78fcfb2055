"""A torchrun script for the re-planning test: a sleep model whose profile gets its last four layers 3x too cheap.

Trains ``--total`` minibatches of an 8-layer sleep model (layers 4-7 three times slower than layers 0-3) on 2 ranks
with the plan made from the wrong profile, re-planning from measured costs (``RePlanPolicy``), checkpointing to
``--ckpt``. Rank 1 (the last stage of any plan here) writes, per process, the time each minibatch's loss was
computed and the plan it ran, to ``--out``-<pid>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import pipedream_ft  # noqa: E402
from pipedream_ft import CheckpointConfig, EveryNSteps, PipelineConfig, PipelineTrainer, RePlanPolicy  # noqa: E402
from sleep_model import SleepLayer  # noqa: E402

TRUE_MS = [(4, 8)] * 4 + [(12, 24)] * 4
"""(forward, backward) milliseconds of each layer."""
WRONG_BY = 3.0
"""How much too cheap the profile makes layers 4-7."""


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(SleepLayer(f, b) for f, b in TRUE_MS))


def misprofile() -> "pipedream_ft.Profile":
    """The model's profile with layers 4-7 :data:`WRONG_BY` times too cheap."""
    from dataclasses import replace

    from profiler.layers import structure_profile

    prof = structure_profile(model())
    layers = [replace(l, forward_ms=float(f), backward_ms=float(b), activation_bytes=2048.0)
              for l, (f, b) in zip(prof.layers, TRUE_MS)]
    layers[4:] = [replace(l, forward_ms=l.forward_ms / WRONG_BY, backward_ms=l.backward_ms / WRONG_BY)
                  for l in layers[4:]]
    from profiler.profile import Profile

    return Profile(tuple(layers), prof.edges, dict(prof.meta))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--total", type=int, default=80)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from partitioner import partition

    profile = misprofile()
    plan = partition(profile, 2, 1e9, straight=True)
    stamps: list[float] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            stamps.append(time.time())
        return nn.functional.mse_loss(out, y)

    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)

    trainer = PipelineTrainer(model(), plan, loss_fn=loss_fn,
                              optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01),
                              config=PipelineConfig(timeout_s=30, summary=False,
                                                    replan=RePlanPolicy(every=10, after=6, min_gain=0.10)),
                              checkpoint=CheckpointConfig(url=args.ckpt, policy=EveryNSteps(1000)),
                              profile=profile)
    record = {"stages": [list(s.layers) for s in trainer.plan.stages], "start": trainer.position,
              "stamps": stamps}
    try:
        trainer.fit(data, args.total)
    finally:
        if trainer.is_last:
            Path(f"{args.out}-{os.getpid()}.json").write_text(json.dumps(record))
    trainer.close()


if __name__ == "__main__":
    pipedream_ft.launch(main)
