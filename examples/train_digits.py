"""Train ``digits_cnn`` on scikit-learn's digits with a pipeline plan, one stage per torchrun rank.

The data set (1797 8x8 images, 10 classes) ships inside scikit-learn, so nothing is downloaded. A fixed,
seeded 20% of it is held out; the rest is the training stream: minibatch ``b`` is slice ``b % E`` of a
permutation reshuffled (seeded) every epoch of ``E`` full minibatches, the partial one dropped, so every rank
computes the same minibatch ``b`` on its own.

Usage::

    pipedream-profile pipedream_ft_examples.models:digits_cnn --input-shape 1,8,8 --batch-size 32 -o digits.prof.json
    pipedream-partition digits.prof.json --workers 4 --bandwidth 1e9 -o digits.plan.json
    torchrun --nproc-per-node 4 examples/train_digits.py --plan digits.plan.json --steps 200

Rank 0 prints the mean loss of every 20 minibatches, then ``first loss``/``final loss`` (means of the first
and last 20), the held-out accuracy of the gathered weights, the time and the throughput. ``--steps`` counts
minibatches and is rounded down to a multiple of the plan's replica counts (and, in ``flush`` mode, of
``--flush-every``).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

import pipedream_ft  # noqa: E402
from pipedream_ft_examples.models import digits_cnn  # noqa: E402
from partitioner.plan import Plan, load_plan  # noqa: E402
from pipedream_ft.env import setting  # noqa: E402
from pipedream_ft.errors import PipelineSetupError  # noqa: E402
from pipedream_ft import CheckpointConfig  # noqa: E402
from pipedream_ft.policies import EveryNSteps  # noqa: E402
from pipedream_ft import PipelineConfig, PipelineTrainer
from pipedream_ft.pipeline.modes import MODES  # noqa: E402

__all__ = ["DigitsData", "plan_for_world", "round_steps", "make_optimizer", "evaluate", "parse_args", "main"]

LOG_EVERY = 20


class DigitsData:
    """The digits split into a held-out test set and a deterministic, seeded training stream."""

    def __init__(self, batch_size: int = 32, seed: int = 0, test_fraction: float = 0.2) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.from_numpy((digits.images / 16.0).astype(np.float32)).unsqueeze(1)  # (N, 1, 8, 8) in [0, 1]
        labels = torch.from_numpy(digits.target.astype(np.int64))
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
        n_test = int(round(test_fraction * len(labels)))
        test, train = order[:n_test], order[n_test:]
        self.train_x, self.train_y = images[train], labels[train]
        self.test_x, self.test_y = images[test], labels[test]
        if not 1 <= batch_size <= len(train):
            raise ValueError(f"batch size must be in [1, {len(train)}], got {batch_size}")
        self.batch_size = batch_size
        self.seed = seed
        self.per_epoch = len(train) // batch_size
        """Full minibatches per epoch (the partial one is dropped)."""
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 1)
            self._perms = {epoch: torch.randperm(len(self.train_y), generator=g)}  # keep one epoch cached
        return self._perms[epoch]

    def __call__(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Minibatch ``b``: images ``(B, 1, 8, 8)`` float32 and labels ``(B,)`` int64."""
        epoch, i = divmod(b, self.per_epoch)
        idx = self._perm(epoch)[i * self.batch_size: (i + 1) * self.batch_size]
        return self.train_x[idx], self.train_y[idx]


def _profile_beside(path: str) -> str:
    """The profile the usage above writes beside plan ``X.plan.json``: ``X.prof.json``."""
    return path[: -len(".plan.json")] + ".prof.json" if path.endswith(".plan.json") else "PROFILE"


def plan_for_world(path: str, schedule: str = "1f1b") -> Plan:
    """The plan at ``path``, or — when torchrun runs another number of processes than it was made for — a plan for
    that number, made from the profile beside it (``X.prof.json`` for ``X.plan.json``) or else from
    ``PIPEDREAM_FT_PROFILE`` (which the pool sets to the job's profile), if it is this plan's model, with one line
    on rank 0 saying so; without that profile, a set-up error naming the command to run.
    Under a ``schedule`` that gives a process several stages the trainer checks the count itself."""
    from pipedream_ft.config import planned_schedule
    from pipedream_ft.virtual import runs_virtual

    plan = load_plan(path)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if plan.world_size == world or runs_virtual(planned_schedule(schedule, plan.settings)):
        return plan
    profile_path = _profile_beside(path)
    given = setting("PIPEDREAM_FT_PROFILE")  # the job's profile, where a pool launched it
    for candidate in [profile_path] + ([given] if given else []):
        if not os.path.exists(candidate):
            continue
        from profiler.profile import load_profile
        from pipedream_ft.ft.elastic import describe_plan, replan

        profile = load_profile(candidate)
        if profile.structure_hash() == plan.profile_hash:
            new = replan(profile, world, plan.settings)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"{path} is a plan for {plan.world_size} processes and {world} run it: re-planned from "
                      f"{candidate} for {world} ({describe_plan(new)})", flush=True)
            return new
    settings = plan.settings
    flags = f" --workers {world} --bandwidth {min(float(b) for b in settings.get('bandwidth') or [1e9]):g}"
    flags += " --straight" if settings.get("straight") else ""
    flags += f" --memory {settings['memory_bytes']:g}" if settings.get("memory_bytes") else ""
    raise PipelineSetupError(f"{path} is a plan for {plan.world_size} processes, but {world} run it: re-plan "
                             f"for {world} with `pipedream-partition {profile_path}{flags} -o {path}` (or run "
                             f"torchrun --nproc-per-node {plan.world_size})")


def round_steps(steps: int, plan: Plan, mode: str, flush_every: int) -> int:
    """``steps`` rounded down to what the plan and mode can run; raises if nothing is left or cannot fit."""
    replicas = [s.replicas for s in plan.stages]
    unit = math.lcm(*replicas)
    if mode == "flush":
        if flush_every % unit:
            raise PipelineSetupError(
                f"--flush-every {flush_every} must be a multiple of {unit}, the least common multiple of the plan's "
                f"replica counts {replicas}"
            )
        unit = math.lcm(unit, flush_every)
    if mode == "vertical" and len(set(replicas)) > 1:
        raise PipelineSetupError(f"--mode vertical needs the same replica count on every stage, the plan has {replicas}")
    rounded = steps - steps % unit
    if rounded <= 0:
        raise PipelineSetupError(
            f"--steps {steps} is less than {unit}, the smallest number of minibatches this plan "
            f"(replicas {replicas}) and mode {mode!r} can run"
        )
    return rounded


def make_optimizer(name: str, lr: float | None) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """The stage optimizer factory: ``"adam"`` or ``"sgd"`` (momentum 0.9); ``lr`` None picks the default."""
    if name == "adam":
        rate = 3e-3 if lr is None else lr
        return lambda params: torch.optim.Adam(params, lr=rate)
    if name == "sgd":
        rate = 0.02 if lr is None else lr
        return lambda params: torch.optim.SGD(params, lr=rate, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}")


@torch.no_grad()
def evaluate(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of a fresh ``digits_cnn`` holding ``state`` on ``(x, y)``."""
    model = digits_cnn()
    model.load_state_dict(state)
    model.eval()
    return float((model(x).argmax(dim=1) == y).float().mean())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_digits.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True, help="plan JSON written by pipedream-partition")
    p.add_argument("--steps", type=int, default=200, help="minibatches to train (default 200)")
    p.add_argument("--batch-size", type=int, default=32, help="minibatch size (default 32)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="Adam, or SGD with momentum 0.9")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 0.003 for Adam, 0.02 for SGD)")
    p.add_argument("--mode", choices=MODES, default="stash", help="weight stashing, vertical sync or flushing")
    p.add_argument("--flush-every", type=int, default=4, help="minibatches per optimizer step with --mode flush")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights, the split and the shuffles")
    p.add_argument("--save", metavar="PATH", help="gather the final weights and save them here (torch.save)")
    p.add_argument("--timeout", type=float, default=45.0, help="seconds to wait for a peer before failing")
    p.add_argument("--ckpt", metavar="URL", help="checkpoint to this fsspec URL (a directory, s3://bucket/prefix, ...) "
                   "and resume from its newest committed checkpoint")
    p.add_argument("--ckpt-every", type=int, default=25, help="minibatches between checkpoints (default 25)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.flush_every < 1:
        p.error(f"--flush-every must be >= 1, got {args.flush_every}")
    if args.timeout <= 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    if args.ckpt_every < 1:
        p.error(f"--ckpt-every must be >= 1, got {args.ckpt_every}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    plan = plan_for_world(args.plan)
    steps = round_steps(args.steps, plan, args.mode, args.flush_every)
    data = DigitsData(args.batch_size, args.seed)
    torch.manual_seed(args.seed)  # every rank builds the same initial model; replicas must start equal
    model = digits_cnn()
    trainer = PipelineTrainer(
        model,
        plan,
        loss_fn=nn.functional.cross_entropy,
        optimizer_factory=make_optimizer(args.optimizer, args.lr),
        config=PipelineConfig(mode=args.mode, flush_every=args.flush_every, timeout_s=args.timeout, seed=args.seed),
        checkpoint=CheckpointConfig(url=args.ckpt, policy=EveryNSteps(args.ckpt_every)) if args.ckpt else None,
    )
    rank = trainer.env.rank
    if rank == 0:
        stages, processes = trainer.plan.num_stages, trainer.env.world_size
        replicas = [s.replicas for s in trainer.plan.stages]
        each = f" ({stages // processes} stages each)" if stages > processes else ""
        print(f"plan {args.plan}: {stages} stages, replicas {replicas}, on {processes} processes{each}; "
              f"mode {args.mode}; {steps} minibatches of {args.batch_size}"
              + (f" (rounded down from {args.steps})" if steps != args.steps else ""), flush=True)
    result = trainer.fit(data, steps)  # continues from the newest committed checkpoint, if any
    state = trainer.full_state_dict()
    trainer.close()
    if rank == 0:
        losses = result.losses
        for end in range(LOG_EVERY, len(losses) + 1, LOG_EVERY):
            print(f"minibatch {result.start + end:5d}  loss {np.mean(losses[end - LOG_EVERY:end]):.4f}", flush=True)
        if not losses:
            print(f"nothing to train: the checkpoint is already at minibatch {trainer.position}", flush=True)
            return 0
        window = min(LOG_EVERY, len(losses))
        first, last = float(np.mean(losses[:window])), float(np.mean(losses[-window:]))
        accuracy = evaluate(state, data.test_x, data.test_y)
        rate = result.trained / result.seconds if result.seconds > 0 else float("inf")
        end = result.start + len(losses)
        print(f"first loss {first:.4f} (minibatches {result.start}-{result.start + window - 1})")
        print(f"final loss {last:.4f} (minibatches {end - window}-{end - 1})")
        print(f"held-out accuracy {accuracy:.4f} ({len(data.test_y)} images)")
        print(f"time {result.seconds:.2f} s, {rate:.1f} minibatches/s, {rate * args.batch_size:.0f} images/s",
              flush=True)
        if args.save:
            torch.save(state, args.save)
            print(f"saved weights to {args.save}", flush=True)
    return 0


if __name__ == "__main__":
    pipedream_ft.launch(main)  # one-line errors, clean teardown, and in-place recovery under torchrun
