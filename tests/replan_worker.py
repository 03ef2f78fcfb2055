"""A torchrun script for the re-planning test: a sleep model whose profile gets its slow layers too cheap.

Trains ``--total`` minibatches of an 8-layer sleep model (layers 4-7 three times slower than layers 0-3) on 2 ranks
with the plan made from the wrong profile, re-planning from measured costs (``RePlanPolicy``), checkpointing to
``--ckpt``. With ``--interleaved``: layers 6-7 four times slower than the rest and profiled as fast, a plan of 4
stages, 2 per process, under interleaved 1F1B (flush mode). The process holding the last stage writes, per process,
the time each minibatch's loss was computed and the plan it ran, to ``--out``-<pid>.json.
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
INTERLEAVED_MS = [(4, 8)] * 6 + [(16, 32)] * 2
"""``--interleaved``: layers 6-7 four times slower, profiled as fast as the others."""


def model(times: list[tuple[int, int]] = TRUE_MS) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(SleepLayer(f, b) for f, b in times))


def misprofile(times: list[tuple[int, int]] = TRUE_MS, slow: int = 4, wrong_by: float = WRONG_BY
               ) -> "pipedream_ft.Profile":
    """The model's profile with layers ``slow`` and later ``wrong_by`` times too cheap."""
    from dataclasses import replace

    from profiler.layers import structure_profile

    prof = structure_profile(model(times))
    layers = [replace(l, forward_ms=float(f), backward_ms=float(b), activation_bytes=2048.0)
              for l, (f, b) in zip(prof.layers, times)]
    layers[slow:] = [replace(l, forward_ms=l.forward_ms / wrong_by, backward_ms=l.backward_ms / wrong_by)
                     for l in layers[slow:]]
    from profiler.profile import Profile

    return Profile(tuple(layers), prof.edges, dict(prof.meta))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--total", type=int, default=80)
    ap.add_argument("--interleaved", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from partitioner import partition

    times = INTERLEAVED_MS if args.interleaved else TRUE_MS
    profile = misprofile(INTERLEAVED_MS, 6, 4.0) if args.interleaved else misprofile()
    plan = partition(profile, 4 if args.interleaved else 2, 1e9, straight=True)
    config = PipelineConfig(timeout_s=30, summary=False, replan=RePlanPolicy(every=8, after=8, min_gain=0.10),
                            mode="flush", flush_every=4, schedule="interleaved_1f1b") if args.interleaved else \
        PipelineConfig(timeout_s=30, summary=False, replan=RePlanPolicy(every=10, after=6, min_gain=0.10))
    stamps: list[float] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            stamps.append(time.time())
        return nn.functional.mse_loss(out, y)

    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)

    trainer = PipelineTrainer(model(times), plan, loss_fn=loss_fn,
                              optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01), config=config,
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
