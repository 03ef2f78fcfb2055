"""Convergence of the training modes and delay compensations on the GPT example, simulated in one process.

Each configuration trains ``examples/gpt.py``'s GPT on ``examples/text_data.py``'s text with the one-process
references of the modes' semantics (``tests/pipedream_reference.py``; the runtime is tested exact against
them on real processes): the plain loop, ``flush``, ``stash``, ``vertical`` and ``2bw``, with and without delay
compensation, for each learning rate of a small sweep, the same number of minibatches each. It prints, per
configuration, the held-out loss at the end for its best learning rate, against the plain loop's at its best.

    python benchmarks/bench_convergence.py --quick   # a smaller GPT (4 x 32 wide, 32 bytes), 100 minibatches

This is a first cut of issue 18 item 3: no PNG, no per-checkpoint curves and no time-to-target yet.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from examples.gpt import gpt  # noqa: E402
from examples.text_data import TextData  # noqa: E402
from examples.train_gpt import held_out_loss, lm_loss, make_optimizer  # noqa: E402
from pipedream_ft.pipeline.compensation import Compensation  # noqa: E402
from pipedream_reference import minibatch_sgd_reference, two_bw_reference, weight_stashing_reference  # noqa: E402

CONFIGS: dict[str, tuple[str, Compensation | None]] = {
    "plain": ("plain", None),
    "flush": ("flush", None),
    "stash": ("stash", None),
    "stash+predict": ("stash", Compensation(predict=True)),
    "stash+lr": ("stash", Compensation(lr_scale=True, lr_warmup=100)),
    "vertical": ("vertical", None),
    "vertical+predict": ("vertical", Compensation(predict=True)),
    "2bw": ("2bw", None),
    "2bw+predict": ("2bw", Compensation(predict=True)),
}


SIZE: dict[str, int] = {}
"""The GPT's size (empty: ``examples/gpt.py``'s default); ``--quick`` makes it smaller."""


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return gpt(**SIZE)


def run(name: str, lr: float, steps: int, stages: int, data: TextData, plan: Any, seed: int) -> float:
    mode, comp = CONFIGS[name]
    opt: Callable[..., Any] = make_optimizer("adamw", lr)
    model = _model(seed)
    if mode == "plain":
        state, _ = minibatch_sgd_reference(model, data, lm_loss, opt, steps, 1)
    elif mode == "flush":
        state, _ = minibatch_sgd_reference(model, data, lm_loss, opt, steps, stages)
    elif mode == "2bw":
        state, _ = two_bw_reference(model, plan, data, lm_loss, opt, steps, stages, compensation=comp)
    else:
        state, _ = weight_stashing_reference(model, plan, data, lm_loss, opt, steps, vertical=mode == "vertical",
                                             compensation=comp)
    final = _model(seed)
    final.load_state_dict(state)
    return held_out_loss(final, data, 64)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller GPT, 100 minibatches of 8 x 32 bytes, LR 2e-3")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--lrs", type=float, nargs="+", default=[2e-3, 1e-3, 5e-4, 2.5e-4])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--small", action="store_true", help="the smaller GPT of --quick (4 x 32 wide, 32 bytes)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    block = 64
    if args.quick:
        args.steps, args.lrs, args.small = 100, [2e-3], True
    if args.small:
        block = 32
        SIZE.update(n_layer=4, n_head=2, n_embd=32, block_size=32)
    args.steps -= args.steps % args.stages
    torch.set_num_threads(1)
    from partitioner.optimizer import partition
    from profiler.measure import profile_model

    data = TextData(block, 8, args.seed)
    profile = profile_model(_model(args.seed), data(0)[0], warmup=0, repeats=1)
    plan = partition(profile, args.stages, 1e9, straight=True)
    results: dict[str, dict[float, float]] = {}
    for name in args.configs:
        for lr in args.lrs:
            t0 = time.perf_counter()
            loss = run(name, lr, args.steps, args.stages, data, plan, args.seed)
            results.setdefault(name, {})[lr] = loss
            print(f"{name:18s} lr {lr:<8g} held-out {loss:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    best_plain = min(results["plain"].values()) if "plain" in results else None
    print(f"\n{args.steps} minibatches, {args.stages} stages, AdamW; best learning rate per configuration")
    for name, by_lr in results.items():
        lr, loss = min(by_lr.items(), key=lambda kv: kv[1])
        rel = f"{100 * (loss / best_plain - 1):+.1f} % vs plain" if best_plain else ""
        print(f"{name:18s} {loss:.4f} at lr {lr:g}  {rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
