"""Benchmark of the partitioner: PipeDream's profiles, cluster-scale chains, a synthetic ResNet, fx-traced GPTs.

Run: ``python benchmarks/bench_partitioner.py [--repeats 5] [--profiles DIR ...] [--scale-layers 300 3000 10000]
[--old-timeout 60] [--layers 700] [--seed 0] [--gpt-layers 4 12 24] [--uncontracted]``. Every wall time is the
median of ``--repeats`` runs of ``partition`` (this machine is shared: the spread is printed too).

* **PipeDream's profiles** (``--profiles``, default ``../shared/profiles``): vgg16, resnet18 and, if
  ``resnet101.graph.txt`` is in one of the folders (PipeDream's
  ``profiler/image_classification/profiles/resnet101/graph.txt``), resnet101, on 32 workers and on a 4 x 8
  machine; ``old s`` is the general path alone on the same case.
* **Cluster scale**: chains of ``--scale-layers`` blocks where every block also feeds the block after next
  (``skip_chain``), on 1,024 workers as 8 GPUs x 16 nodes x 8 racks at 100 / 25 / 5 GB/s, on 64 workers
  (8 x 8) and, for 300 layers, 16 (4 x 4). ``old s`` is the general path's time on the same problem (the
  scalable search switched off), run in a subprocess with ``--old-timeout``; ``same`` says whether both found
  the same optimum; ``path`` which path planned it (``general`` where the scalable search could not rule out
  stages replicated across machines, e.g. 1,000 layers on 1,024 workers: that case takes minutes).
* **resnet-like** (``--layers``): a chain with a residual edge around every 7 layers. **gpt**: ``pipedream_ft_examples.gpt``
  (GPTConfig defaults: vocab 256, 128 wide, 4 heads, a minibatch of 8 sequences of 128 tokens) profiled on this
  machine's CPU at ``n_layer`` 4, 12 and 24; ``--uncontracted`` adds the n_layer-4 GPT with every value layer as
  a cut point, as the planner did before value layers existed (slow).

Each row: the graph (layers, value layers, antichain states the search sees), workers per level, bandwidth,
straight or not, wall time, predicted time per minibatch, stage count and speedup over data parallelism.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner import chain  # noqa: E402
from partitioner.antichain import linearize  # noqa: E402
from partitioner.contract import contract  # noqa: E402
from partitioner.optimizer import partition  # noqa: E402
from profiler import load_profile  # noqa: E402
from profiler.profile import Layer, Profile  # noqa: E402

__all__ = ["resnet_like_profile", "skip_chain", "gpt_profile", "main"]

ROOT = Path(__file__).resolve().parents[1]
SCALE_WORKERS = ([8, 16, 8], [1e11, 2.5e10, 5e9])


def skip_chain(num_layers: int = 10_000, seed: int = 0) -> Profile:
    """An input and ``num_layers - 1`` blocks in a chain, every layer also feeding the one after next.

    Blocks: forward 0.2-1 ms, backward twice that, 2-8 MiB of activations, 4-16 MiB of parameters.
    """
    rng = np.random.default_rng(seed)
    layers = [Layer("0", "Input", 0.0, 0.0, 8.0 * 2**20, 0.0)]
    for i in range(1, num_layers):
        f = float(rng.uniform(0.2, 1.0))
        layers.append(Layer(str(i), "Block", f, 2.0 * f, float(rng.integers(2, 9) * 2**20),
                            float(rng.integers(4, 17) * 2**20)))
    edges = [(i, i + 1) for i in range(num_layers - 1)] + [(i, i + 2) for i in range(num_layers - 2)]
    return Profile(tuple(layers), tuple(sorted(edges)), {"model": f"skip-chain-{num_layers}"})


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
    """A measured profile of ``pipedream_ft_examples.gpt.gpt(n_layer=n_layer)`` on ``batch`` x ``seq`` random tokens (CPU)."""
    import torch

    from pipedream_ft_examples.gpt import gpt
    from profiler.measure import profile_model

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model = gpt(n_layer=n_layer)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    return profile_model(model, tokens, warmup=1, repeats=3, meta={"model": f"pipedream_ft_examples.gpt:gpt(n_layer={n_layer})"})


def _all_tensor(profile: Profile) -> Profile:
    layers = tuple(Layer(l.name, l.description, l.forward_ms, l.backward_ms, l.activation_bytes, l.parameter_bytes,
                         weight_backward_ms=l.weight_backward_ms)
                   for l in profile.layers)
    return Profile(layers, profile.edges, profile.meta, profile.tied, profile.inputs)


def _timed(fn, repeats: int):
    walls = []
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
    return out, statistics.median(walls), min(walls), max(walls)


def _fmt_wall(med: float, lo: float, hi: float) -> str:
    return f"{med:>8.3f} ({lo:.3f}-{hi:.3f})"


def _rows(name: str, profile: Profile, cases: list[tuple[list[int], list[float], bool]], repeats: int = 1,
          old: bool = False) -> None:
    values = sum(l.kind == "value" for l in profile.layers)
    states = linearize(contract(profile).profile).num_states
    for workers, bandwidth, straight in cases:
        plan, med, lo, hi = _timed(lambda: partition(profile, workers, bandwidth, straight=straight), repeats)
        label = "x".join(str(n) for n in workers)
        bws = ",".join(f"{b:.0e}" for b in bandwidth)
        extra = ""
        if old:  # the general path alone (no chain search, no upper plan from the cuts between blocks)
            chain.SCALABLE = False
            try:
                ref, omed, _, _ = _timed(lambda: partition(profile, workers, bandwidth, straight=straight), repeats)
            finally:
                chain.SCALABLE = True
            same = "yes" if ref.time_per_minibatch_s == plan.time_per_minibatch_s else "NO"
            extra = f" {omed:>8.3f} {same:>5}"
        print(f"{name:>14} {len(profile.layers):>6} {values:>6} {states:>6} {label:>8} {bws:>14} "
              f"{'yes' if straight else 'no':>8} {_fmt_wall(med, lo, hi):>24} {plan.time_per_minibatch_s:>16.6g} "
              f"{plan.num_stages:>6} {plan.speedup_over_data_parallel:>8.3f}" + extra, flush=True)


def _header(extra: str = "") -> None:
    print(f"{'graph':>14} {'layers':>6} {'values':>6} {'states':>6} {'workers':>8} {'bandwidth B/s':>14} "
          f"{'straight':>8} {'wall s median (min-max)':>24} {'time/minibatch s':>16} {'stages':>6} {'speedup':>8}"
          + extra)


_OLD_PATH = """
import json, sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
from bench_partitioner import skip_chain
from partitioner import chain, partition
chain.SCALABLE = False
p = skip_chain({layers}, {seed})
t0 = time.perf_counter()
plan = partition(p, {workers}, {bandwidth})
print(json.dumps([time.perf_counter() - t0, plan.time_per_minibatch_s]))
"""


def _old_path(layers: int, seed: int, workers, bandwidth, timeout: float) -> tuple[str, float | None]:
    """Wall time of the general path on ``skip_chain(layers)`` in a subprocess (or why it gave none)."""
    code = _OLD_PATH.format(root=str(ROOT), bench=str(ROOT / "benchmarks"), layers=layers, seed=seed,
                            workers=list(workers), bandwidth=list(bandwidth))
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"> {timeout:g}", None
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["failed"])[-1]
        return last.split(":")[0][:20], None
    wall, value = json.loads(res.stdout.strip().splitlines()[-1])
    return f"{wall:.3f}", value


SCALE_CASES = [(300, [4, 4], [1e11, 2.5e10]), (300, [8, 8], [1e11, 2.5e10]), (3000, [8, 8], [1e11, 2.5e10]),
               (3000, *SCALE_WORKERS), (10000, [8, 8], [1e11, 2.5e10]), (10000, *SCALE_WORKERS)]


def _scale_rows(sizes: list[int], seed: int, repeats: int, old_timeout: float) -> None:
    print(f"{'graph':>14} {'layers':>6} {'states':>6} {'workers':>8} {'bandwidth B/s':>20} "
          f"{'wall s median (min-max)':>24} {'old s':>12} {'same':>5} {'path':>8} {'time/minibatch s':>16} "
          f"{'stages':>6} {'max replicas':>12}")
    for layers, workers, bandwidth in [c for c in SCALE_CASES if c[0] in sizes]:
        profile = skip_chain(layers, seed)
        cs = chain.chain_states(contract(profile).profile)
        states = cs.num_states
        path = "chain" if chain.solve_chain(cs, workers, bandwidth) is not None else "general"
        plan, med, lo, hi = _timed(lambda: partition(profile, workers, bandwidth), repeats)
        old, old_value = _old_path(layers, seed, workers, bandwidth, old_timeout)
        same = "-" if old_value is None else ("yes" if old_value == plan.time_per_minibatch_s else "NO")
        label = "x".join(str(n) for n in workers)
        bws = ",".join(f"{b:.1e}" for b in bandwidth)
        print(f"{'skip-chain':>14} {layers:>6} {states:>6} {label:>8} {bws:>20} {_fmt_wall(med, lo, hi):>24} "
              f"{old:>12} {same:>5} {path:>8} {plan.time_per_minibatch_s:>16.6g} {plan.num_stages:>6} "
              f"{max(s.replicas for s in plan.stages):>12}", flush=True)


def _pipedream_rows(directories: list[Path], repeats: int) -> None:
    for name in ("vgg16", "resnet18", "resnet101"):
        found = [d / f"{name}.graph.txt" for d in directories if (d / f"{name}.graph.txt").exists()]
        if not found:
            print(f"{name:>14}  (no {name}.graph.txt in {', '.join(map(str, directories))}: PipeDream's "
                  f"profiler/image_classification/profiles/{name}/graph.txt)")
            continue
        path = found[0]
        _rows(name, load_profile(path), [([32], [1e10], False), ([32], [1e9], False), ([4, 8], [1e11, 1e10], False)],
              repeats, old=True)
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs per case; the median wall time is printed")
    ap.add_argument("--profiles", type=Path, nargs="+", default=[ROOT.parent / "shared" / "profiles"],
                    help="folders with PipeDream's <model>.graph.txt profiles (the first holding a model is used)")
    ap.add_argument("--scale-layers", type=int, nargs="*", default=[300, 3000, 10000],
                    help="layers of the cluster-scale skip chains (cases: SCALE_CASES)")
    ap.add_argument("--old-timeout", type=float, default=60.0, help="seconds the general path gets per scale case")
    ap.add_argument("--layers", type=int, default=700, help="layers of the synthetic ResNet-like profile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpt-layers", type=int, nargs="*", default=[4, 12, 24], help="GPT depths to plan")
    ap.add_argument("--uncontracted", action="store_true",
                    help="also plan the n_layer-4 GPT with every value layer as a cut point (slow)")
    args = ap.parse_args(argv)
    print("PipeDream's profiles (old s: median wall time of the general path alone; same: same optimum)")
    _header(f" {'old s':>8} {'same':>5}")
    _pipedream_rows(args.profiles, args.repeats)
    print()
    print("cluster scale: 8 GPUs x 16 nodes x 8 racks (and 8 x 8), old = the general path")
    _scale_rows(args.scale_layers, args.seed, args.repeats, args.old_timeout)
    print()
    _header()
    resnet = resnet_like_profile(args.layers, args.seed)
    _rows("resnet-like", resnet, [([8], [1e10], False), ([32], [1e10], False), ([128], [1e10], False),
                                  ([8, 16], [1e11, 1e10], False)], args.repeats)
    transformer_cases = [([n], [1e9], straight) for n in (4, 8, 16) for straight in (False, True)]
    for n_layer in args.gpt_layers:
        profile = gpt_profile(n_layer, seed=args.seed)
        _rows(f"gpt n_layer={n_layer}", profile, transformer_cases, args.repeats)
        if args.uncontracted and n_layer == 4:
            _rows("  every layer", _all_tensor(profile), transformer_cases)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
