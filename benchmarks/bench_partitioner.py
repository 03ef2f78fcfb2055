"""Benchmark of the partitioner on a synthetic ~700-layer ResNet-like profile.

Run: ``python benchmarks/bench_partitioner.py [--layers 700] [--seed 0]``. Prints one row per machine
configuration: layers, antichain states, workers per level, bandwidth, wall time of ``partition`` and the
predicted time per minibatch and speedup over data parallelism.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner.antichain import linearize  # noqa: E402
from partitioner.optimizer import partition  # noqa: E402
from profiler.profile import Layer, Profile  # noqa: E402

__all__ = ["resnet_like_profile", "main"]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=700)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    profile = resnet_like_profile(args.layers, args.seed)
    states = linearize(profile).num_states
    cases = [([8], [1e10]), ([32], [1e10]), ([128], [1e10]), ([8, 16], [1e11, 1e10])]
    print(f"{'layers':>6} {'states':>6} {'workers':>8} {'bandwidth B/s':>16} {'wall s':>8} "
          f"{'time/minibatch s':>17} {'stages':>6} {'speedup vs DP':>13}")
    for workers, bandwidth in cases:
        t0 = time.perf_counter()
        plan = partition(profile, workers, bandwidth)
        wall = time.perf_counter() - t0
        label = "x".join(str(n) for n in workers)
        bws = ",".join(f"{b:.0e}" for b in bandwidth)
        print(f"{len(profile.layers):>6} {states:>6} {label:>8} {bws:>16} {wall:>8.3f} "
              f"{plan.time_per_minibatch_s:>17.6g} {plan.num_stages:>6} {plan.speedup_over_data_parallel:>13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
