"""Benchmark of the partitioner: a synthetic ~700-layer ResNet-like profile and fx-traced GPTs.

Run: ``python benchmarks/bench_partitioner.py [--layers 700] [--seed 0] [--gpt-layers 4 12 24]
[--uncontracted]``. Prints one row per case: the graph (layers, value layers, antichain states the search
sees), workers per level, bandwidth, straight or not, wall time of ``partition`` and the predicted time per
minibatch, stage count and speedup over data parallelism.

The GPT rows profile ``examples.gpt`` (GPTConfig defaults: vocab 256, 128 wide, 4 heads, a minibatch of 8
sequences of 128 tokens) on this machine's CPU, at ``n_layer`` 4, 12 and 24: real traced graphs with their
shape arithmetic (value layers) and tied embedding. ``--uncontracted`` adds rows for the n_layer-4 GPT with
every layer marked as a tensor layer, i.e. every value layer a cut point, as the planner did before value
layers existed (slow: that search has 4296 states instead of 322).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner.antichain import linearize  # noqa: E402
from partitioner.contract import contract  # noqa: E402
from partitioner.optimizer import partition  # noqa: E402
from profiler.profile import Layer, Profile  # noqa: E402

__all__ = ["resnet_like_profile", "gpt_profile", "main"]


def resnet_like_profile(num_layers: int = 700, seed: int = 0, block: int = 7) -> Profile:
    """A chain of ``num_layers`` layers with a residual skip edge around every ``block`` layers."""
    rng = np.random.default_rng(seed)
    layers = [Layer("0", "Input", 0.0, 0.0, 4.0e6, 0.0)]
    for i in range(1, num_layers):
        kind = ("Conv2d", "BatchNorm2d", "ReLU")[i % 3]
        fwd = float(rng.uniform(0.2, 4.0)) if kind == "Conv2d" else float(rng.uniform(0.05, 0.5))
        params = float(rng.integers(1, 64) * 65536) if kind == "Conv2d" else 0.0
        act = float(rng.integers(1, 32) * 262144)
        layers.append(Layer(str(i), kind, fwd, 2.0 * fwd, act, params))
    edges = [(i, i + 1) for i in range(num_layers - 1)]
    edges += [(s, s + block) for s in range(1, num_layers - block, block)]
    return Profile(tuple(layers), tuple(sorted(edges)), {"model": "synthetic-resnet"})


def gpt_profile(n_layer: int, batch: int = 8, seq: int = 128, seed: int = 0) -> Profile:
    """A measured profile of ``examples.gpt.gpt(n_layer=n_layer)`` on ``batch`` x ``seq`` random tokens (CPU)."""
    import torch

    from examples.gpt import gpt
    from profiler.measure import profile_model

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model = gpt(n_layer=n_layer)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    return profile_model(model, tokens, warmup=1, repeats=3, meta={"model": f"examples.gpt:gpt(n_layer={n_layer})"})


def _all_tensor(profile: Profile) -> Profile:
    layers = tuple(Layer(l.name, l.description, l.forward_ms, l.backward_ms, l.activation_bytes, l.parameter_bytes)
                   for l in profile.layers)
    return Profile(layers, profile.edges, profile.meta, profile.tied, profile.inputs)


def _rows(name: str, profile: Profile, cases: list[tuple[list[int], list[float], bool]]) -> None:
    values = sum(l.kind == "value" for l in profile.layers)
    states = linearize(contract(profile).profile).num_states
    for workers, bandwidth, straight in cases:
        t0 = time.perf_counter()
        plan = partition(profile, workers, bandwidth, straight=straight)
        wall = time.perf_counter() - t0
        label = "x".join(str(n) for n in workers)
        bws = ",".join(f"{b:.0e}" for b in bandwidth)
        print(f"{name:>14} {len(profile.layers):>6} {values:>6} {states:>6} {label:>8} {bws:>14} "
              f"{'yes' if straight else 'no':>8} {wall:>8.3f} {plan.time_per_minibatch_s:>16.6g} "
              f"{plan.num_stages:>6} {plan.speedup_over_data_parallel:>8.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=700, help="layers of the synthetic ResNet-like profile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpt-layers", type=int, nargs="*", default=[4, 12, 24], help="GPT depths to plan")
    ap.add_argument("--uncontracted", action="store_true",
                    help="also plan the n_layer-4 GPT with every value layer as a cut point (slow)")
    args = ap.parse_args(argv)
    print(f"{'graph':>14} {'layers':>6} {'values':>6} {'states':>6} {'workers':>8} {'bandwidth B/s':>14} "
          f"{'straight':>8} {'wall s':>8} {'time/minibatch s':>16} {'stages':>6} {'speedup':>8}")
    resnet = resnet_like_profile(args.layers, args.seed)
    _rows("resnet-like", resnet, [([8], [1e10], False), ([32], [1e10], False), ([128], [1e10], False),
                                  ([8, 16], [1e11, 1e10], False)])
    transformer_cases = [([n], [1e9], straight) for n in (4, 8, 16) for straight in (False, True)]
    for n_layer in args.gpt_layers:
        profile = gpt_profile(n_layer, seed=args.seed)
        _rows(f"gpt n_layer={n_layer}", profile, transformer_cases)
        if args.uncontracted and n_layer == 4:
            _rows("  every layer", _all_tensor(profile), transformer_cases)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
