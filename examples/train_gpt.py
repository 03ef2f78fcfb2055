"""Train a small GPT (``examples/gpt.py``: byte-level, tied embeddings) on Python's own help text, pipelined.

The flow, on one machine with 4 CPU processes::

    pipedream-profile pipedream_ft_examples.gpt:gpt --int-input 256 --input-shape 64 --batch-size 16 -o gpt.prof.json
    pipedream-partition gpt.prof.json --workers 4 --bandwidth 1e9 --straight -o gpt.plan.json
    torchrun --nproc-per-node 4 examples/train_gpt.py --plan gpt.plan.json --steps 300

``pipedream_ft_examples.gpt:gpt`` is the default size (4 layers, 4 heads, width 128, 256 byte tokens, positions up to 128:
0.8 M parameters); ``--input-shape 64`` is the context length ``T`` of the token-id input ``(B, T)`` and
should match ``--block-size``. ``--straight`` keeps one worker per stage. Without it the partitioner may
replicate stages, but never the ones holding part of a tied weight (here the token embedding in the first
stage and the language-model head in the last): those exchange the weight's gradients replica by replica. Add ``--ckpt DIR --ckpt-every N`` for durable checkpoints; the script
runs under ``pipedream_ft.launch``, so a killed worker (``PIPEDREAM_FT_FAULTS="kill@rank=2,step=150"`` injects
one) is replaced in place and every rank goes on from the newest memory-tier cut (every 8 minibatches), the
others keeping their processes; ``--max-restarts R`` is left for what cannot be recovered in place. The
recovered run's final weights are bitwise those of an uninterrupted one. ``python examples/train_gpt.py
--single-process ...`` trains the same model on the same data with the same optimizer in one plain process
(no plan, no torchrun), for comparison.

The text is ``pydoc_data.topics`` (see :mod:`pipedream_ft_examples.text_data`): a seeded 10% of it is held out, minibatch
``b`` is a deterministic set of random windows of the rest. Rank 0 prints the mean loss of every 20 minibatches,
then ``first loss``/``final loss`` (means of the first and last 20), the held-out loss of the gathered weights
(``trainer.full_state_dict()`` loaded into a plain ``GPT``), a sample of generated text, and tokens/s.

**Learning rate and the pipeline modes (measured: 300 minibatches of 16 x 64 bytes, AdamW, 4 stages).**
``flush`` is synchronous SGD over windows of ``--flush-every`` minibatches: exactly plain training with that
many minibatches per step (same losses to 4 decimals), so per *minibatch* it makes ``--flush-every`` times fewer
updates. ``stash`` and ``vertical`` update after every minibatch like the plain loop, but with stale weights:
stage ``s`` of ``S`` computes its gradient with weights ``S - 1 - s`` updates old (``vertical``: ``S - 1`` on
every stage; the tied embedding is read at the first stage's version). The runtime is exact — a one-process
simulation of these delays gives the same losses — but with AdamW at the plain loop's 1e-3 the delay stalls
training on the byte-frequency plateau (final loss: plain 2.35, stash 3.20, vertical 3.19). The delayed
transformer blocks are the cause, not the tied embedding or Adam's state per se: delaying only the embedding by
3 updates costs nothing (2.33), reading the tied embedding fresh does not help (3.07), delaying only the first
stage stalls (3.12), and even a delay of 1 on every weight stalls at 1e-3 (2.97); 100 minibatches of warm-up do
not help (3.26). A smaller LR does: at 2.5e-4 stash reaches 2.67 (plain at 2.5e-4: 2.51, vertical 2.88).
Guidance: divide the LR by ``1 + delay`` (the default: 1e-3 / 4 on 4 stages), use fewer stages where you can,
or ``flush`` for exact synchronous semantics. Warm-up (``--warmup``) and cosine decay (``--cosine``) are off by
default.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from pipedream_ft_examples.gpt import GPT, gpt  # noqa: E402
from pipedream_ft_examples.text_data import TextData, decode  # noqa: E402
from pipedream_ft_examples.train_digits import plan_for_world, round_steps  # noqa: E402
from partitioner.plan import Plan  # noqa: E402
import pipedream_ft  # noqa: E402
from pipedream_ft import CheckpointConfig, PipelineConfig, PipelineSetupError, PipelineTrainer  # noqa: E402
from pipedream_ft.pipeline.modes import MODES, Mode, make_mode  # noqa: E402
from pipedream_ft.config import planned_schedule  # noqa: E402
from pipedream_ft.schedules.replicated import SYNCHRONOUS  # noqa: E402
from pipedream_ft.pipeline.topology import Topology  # noqa: E402
from pipedream_ft.schedules.window import VIRTUAL  # noqa: E402
from pipedream_ft.virtual import runs_virtual  # noqa: E402
from pipedream_ft.policies import EveryNSteps  # noqa: E402

__all__ = ["lm_loss", "make_optimizer", "lr_factor", "weight_delay", "default_lr", "held_out_loss", "generate", "train_single_process",
           "parse_args", "main"]

LOG_EVERY = 20
DEFAULT_LR = {"adamw": 1e-3, "adam": 1e-3, "sgd": 0.1}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy over every position of every window."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(name: str, lr: float, weight_decay: float = 0.1
                   ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """The stage optimizer factory. ``adamw``: betas (0.9, 0.95), weight decay on matrices and embeddings only
    (nanoGPT's rule, by dimension: the factory sees parameters, not names); ``adam``; ``sgd`` (momentum 0.9)."""
    if name == "adamw":
        def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
            return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))
        return adamw
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr, betas=(0.9, 0.95))
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}")


def lr_factor(minibatch: int, *, warmup: int, total: int, cosine: bool, min_ratio: float = 0.1) -> float:
    """LR multiplier once ``minibatch`` minibatches are done: linear warm-up over ``warmup`` minibatches, then
    constant, or (``cosine``) a cosine decay to ``min_ratio`` at ``total``."""
    if warmup > 0 and minibatch < warmup:
        return (minibatch + 1) / warmup
    if not cosine or total <= warmup:
        return 1.0
    progress = min(1.0, (minibatch - warmup) / (total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _scheduler_factory(args: argparse.Namespace, unit: int, total: int) -> Callable[[torch.optim.Optimizer], Any] | None:
    """A ``LambdaLR`` for a stage that updates once per ``unit`` minibatches (``None``: constant LR)."""
    if args.warmup == 0 and not args.cosine:
        return None

    def factor(update: int) -> float:
        return lr_factor(update * unit, warmup=args.warmup, total=total, cosine=args.cosine)

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def weight_delay(plan: Plan, mode: str) -> int:
    """Most updates a gradient is late by: stage 0's weight-stashing depth (``S - 1`` on a straight pipeline;
    vertical sync delays every stage that much); 1 in ``2bw`` mode; 0 in ``flush`` mode."""
    if mode == "flush":
        return 0
    if mode == "2bw":
        return 1
    replicas = [s.replicas for s in plan.stages]
    return -(-sum(replicas) // replicas[0]) - 1


def default_lr(optimizer: str, delay: int) -> float:
    """The default peak LR: the single-process one divided by ``1 + delay`` (see the module docstring)."""
    return DEFAULT_LR[optimizer] / (1 + delay)


def _mode_of(args: argparse.Namespace, plan: Plan, rank: int) -> tuple[Mode, Topology]:
    """The library's mode for the arguments, checked against ``rank``'s place in the plan (a schedule of virtual
    stages is checked by the trainer: its windows are 1F1B's, ``flush_every`` minibatches)."""
    schedule = planned_schedule(args.schedule, plan.settings)
    mode = make_mode(args.mode, args.flush_every, args.update_every, "1f1b" if runs_virtual(schedule) else schedule)
    topo = Topology.of(plan, rank)
    mode.check(topo)
    return mode, topo


def _update_unit(args: argparse.Namespace, plan: Plan, rank: int) -> int:
    """Minibatches per optimizer step of ``rank``'s stage (the LR schedule counts minibatches)."""
    mode, topo = _mode_of(args, plan, rank)
    return mode.update_unit(topo)


@torch.no_grad()
def held_out_loss(model: GPT, data: TextData, n_windows: int = 256) -> float:
    """Mean loss of ``model`` on a fixed set of held-out windows."""
    model.eval()
    losses = [float(lm_loss(model(x), y)) * len(x) for x, y in data.held_out_batches(n_windows)]
    return sum(losses) / n_windows


@torch.no_grad()
def generate(model: GPT, prompt: str, n: int, temperature: float = 0.8, seed: int = 0) -> str:
    """``prompt`` continued by ``n`` bytes: greedy with ``temperature`` 0, else sampled (seeded)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt.encode("utf-8")) or [10]], dtype=torch.long)
    for _ in range(n):
        logits = model(idx[:, -model.config.block_size:])[:, -1, :]
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return decode(idx[0])


def _model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    return gpt()


def train_single_process(args: argparse.Namespace, data: TextData, steps: int) -> tuple[GPT, list[float], float]:
    """The same model, data, optimizer and LR schedule in one plain process: a step per minibatch (per
    ``--flush-every`` minibatches, on their mean loss, with ``--mode flush``). Returns the model, the
    per-minibatch losses and the seconds."""
    model = _model(args)
    model.train()
    opt = make_optimizer(args.optimizer, args.lr, args.weight_decay)(list(model.parameters()))
    unit = args.flush_every if args.mode == "flush" else 1
    factory = _scheduler_factory(args, unit, steps)
    sched = factory(opt) if factory is not None else None
    losses: list[float] = []
    t0 = time.perf_counter()
    for b in range(steps):
        x, y = data(b)
        loss = lm_loss(model(x), y)
        losses.append(float(loss.detach()))
        (loss / unit).backward()
        if (b + 1) % unit == 0:
            if args.clip:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
    return model, losses, time.perf_counter() - t0


def _schedule(value: str) -> str:
    if value in SYNCHRONOUS + VIRTUAL or value == "plan" or value.lower().endswith(".csv"):
        return value
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(SYNCHRONOUS + VIRTUAL)}, plan or a table's path "
                                     f"(.csv), got {value!r}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_gpt.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", help="plan JSON written by pipedream-partition (not with --single-process)")
    p.add_argument("--single-process", action="store_true",
                   help="train the same model in this one process, without a pipeline (for comparison)")
    p.add_argument("--steps", type=int, default=300, help="minibatches to train (default 300)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per minibatch (default 16)")
    p.add_argument("--block-size", type=int, default=64, help="bytes per window, at most 128 (default 64)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw",
                   help="AdamW (default; weight decay on matrices), Adam, or SGD with momentum 0.9")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3 for AdamW and Adam, "
                   "0.1 for SGD, divided by the pipeline's weight delay in stash and vertical modes: see above)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    p.add_argument("--warmup", type=int, default=0, help="minibatches of linear LR warm-up (default 0: none)")
    p.add_argument("--cosine", action="store_true", help="cosine LR decay to 10%% of the peak at the last minibatch")
    p.add_argument("--clip", type=float, default=None, help="clip gradients to this norm (per stage in the "
                   "asynchronous modes)")
    p.add_argument("--mode", choices=MODES, default="stash", help="weight stashing, vertical sync or flushing")
    p.add_argument("--flush-every", type=int, default=4, help="minibatches per optimizer step with --mode flush")
    p.add_argument("--schedule", type=_schedule, default="1f1b", metavar="|".join(SYNCHRONOUS + VIRTUAL) + "|plan|TABLE.csv",
                   help="the schedule inside a window with --mode flush (zb_h1: zero bubble; default 1f1b); plan: the "
                   "one pipedream-partition --schedule recorded in the plan; or a table of one window, one row per "
                   "rank (`python -m pipedream_ft.schedules NAME --csv T.csv` writes one); its window is "
                   "--flush-every")
    p.add_argument("--update-every", type=int, default=None,
                   help="minibatches per optimizer step with --mode 2bw (default: the number of stages)")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights, the split and the windows")
    p.add_argument("--ckpt", metavar="URL", help="checkpoint to this fsspec URL (a directory, s3://bucket/prefix, "
                   "...) and resume from its newest committed checkpoint")
    p.add_argument("--ckpt-every", type=int, default=50, help="minibatches between checkpoints (default 50)")
    p.add_argument("--save", metavar="PATH", help="gather the final weights and save them here (torch.save)")
    p.add_argument("--json", metavar="PATH", help="write the figures (losses, held-out loss, tokens/s) here")
    p.add_argument("--sample", type=int, default=200, help="bytes of text to generate at the end (default 200)")
    p.add_argument("--prompt", default="The ", help="text the sample starts from (default 'The ')")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0: greedy (default 0.8)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a peer before failing")
    args = p.parse_args(argv)
    if args.single_process == bool(args.plan):
        p.error("give --plan (under torchrun) or --single-process, not both" if args.plan else
                "--plan is required (or --single-process)")
    for key in ("steps", "batch_size", "block_size", "flush_every", "ckpt_every"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.block_size > 128:
        p.error(f"--block-size must be at most 128 (the model's position embedding), got {args.block_size}")
    if args.warmup < 0 or args.sample < 0:
        p.error("--warmup and --sample must be >= 0")
    if args.timeout <= 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    return args


def _report(args: argparse.Namespace, data: TextData, state: dict[str, torch.Tensor], losses: list[float],
            start: int, seconds: float, extra: dict[str, Any], trained: int | None = None) -> None:
    """Rank 0's (or the single process's) summary: loss curve, held-out loss, sample, throughput (of the
    ``trained`` minibatches this process ran in ``seconds``; default all of ``losses``)."""
    from statistics import fmean

    for end in range(LOG_EVERY, len(losses) + 1, LOG_EVERY):
        print(f"minibatch {start + end:5d}  loss {fmean(losses[end - LOG_EVERY:end]):.4f}", flush=True)
    model = gpt()
    model.load_state_dict(state)
    window = min(LOG_EVERY, len(losses))
    first, last = fmean(losses[:window]), fmean(losses[-window:])
    held = held_out_loss(model, data)
    trained = len(losses) if trained is None else trained
    tokens = trained * data.tokens_per_minibatch
    rate = tokens / seconds if seconds > 0 else float("inf")
    end = start + len(losses)
    print(f"first loss {first:.4f} (minibatches {start}-{start + window - 1})")
    print(f"final loss {last:.4f} (minibatches {end - window}-{end - 1})")
    print(f"held-out loss {held:.4f} ({len(data.held)} bytes held out; uniform bytes would be {math.log(256):.4f})")
    print(f"time {seconds:.2f} s, {trained / seconds:.2f} minibatches/s, {rate:.0f} tokens/s", flush=True)
    if args.sample:
        text = generate(model, args.prompt, args.sample, args.temperature, args.seed)
        print(f"sample (temperature {args.temperature:g}):\n{text}", flush=True)
    if args.save:
        torch.save(state, args.save)
        print(f"saved weights to {args.save}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "mode": "single-process" if args.single_process else args.mode, "optimizer": args.optimizer,
            "lr": args.lr, "warmup": args.warmup, "start": start, "losses": losses, "first_loss": first,
            "final_loss": last, "held_out_loss": held, "seconds": seconds, "tokens_per_s": rate, **extra}))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data = TextData(args.block_size, args.batch_size, args.seed)
    if args.single_process:
        if args.lr is None:
            args.lr = default_lr(args.optimizer, 0)
        steps = args.steps - args.steps % args.flush_every if args.mode == "flush" else args.steps
        print(f"single process: {steps} minibatches of {args.batch_size} x {args.block_size} bytes; "
              f"{args.optimizer} lr {args.lr:g}, warm-up {args.warmup}"
              + (f"; a step per {args.flush_every} minibatches" if args.mode == "flush" else ""), flush=True)
        model, losses, seconds = train_single_process(args, data, steps)
        _report(args, data, model.state_dict(), losses, 0, seconds, {})
        return 0

    plan = plan_for_world(args.plan, args.schedule)  # re-planned from the profile beside it for another process count
    steps = round_steps(args.steps, plan, args.mode, args.flush_every)
    rank = int(os.environ.get("RANK", "0"))
    mode, topo = _mode_of(args, plan, rank)
    steps -= steps % mode.window(topo)  # 2bw: whole windows of --update-every
    if steps <= 0:
        raise PipelineSetupError(f"--steps {args.steps} is less than one window of mode {mode!r} "
                                 f"({mode.window(topo)} minibatches)")
    delay = weight_delay(plan, args.mode)
    if args.lr is None:
        args.lr = default_lr(args.optimizer, delay)
    trainer = PipelineTrainer(
        lambda: _model(args),
        plan,
        loss_fn=lm_loss,
        optimizer_factory=make_optimizer(args.optimizer, args.lr, args.weight_decay),
        scheduler_factory=_scheduler_factory(args, _update_unit(args, plan, rank), steps),
        config=PipelineConfig(mode=args.mode, flush_every=args.flush_every, timeout_s=args.timeout, seed=args.seed,
                              clip_grad_norm=args.clip, schedule=args.schedule, update_every=args.update_every),
        checkpoint=CheckpointConfig(url=args.ckpt, policy=EveryNSteps(args.ckpt_every)) if args.ckpt else None,
    )
    if trainer.env.rank == 0:
        stages, processes = trainer.plan.num_stages, trainer.env.world_size
        replicas = [s.replicas for s in trainer.plan.stages]
        each = f" ({stages // processes} stages each)" if stages > processes else ""
        print(f"plan {args.plan}: {stages} stages, replicas {replicas}, on {processes} processes{each}; "
              f"mode {args.mode}; {steps} minibatches of {args.batch_size} x {args.block_size} bytes"
              + (f" (rounded down from {args.steps})" if steps != args.steps else "")
              + f"; {args.optimizer} lr {args.lr:g}, warm-up {args.warmup}; weight delay {delay}", flush=True)
    result = trainer.fit(data, steps)  # continues from the newest committed checkpoint, if any
    state = trainer.full_state_dict()
    stats = trainer.gather_stats()
    trainer.close()
    if trainer.env.rank == 0:
        if not result.losses:
            print(f"nothing to train: the checkpoint is already at minibatch {trainer.position}", flush=True)
        else:
            _report(args, data, state, result.losses, result.start, result.seconds,
                    {"predicted_s_per_minibatch": plan.time_per_minibatch_s, "stages": plan.num_stages,
                     "resumed_from": trainer.resumed_from, "rank_stats": stats}, trained=result.trained)
    return 0


if __name__ == "__main__":
    pipedream_ft.launch(main)  # one-line errors, clean teardown, and in-place recovery under torchrun
