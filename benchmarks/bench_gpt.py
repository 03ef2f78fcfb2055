"""Tokens/s of the GPT example as a 4-stage pipeline against the same model trained in one process.

Run: ``python benchmarks/bench_gpt.py [--quick] [--minibatches 120] [--batch-size 16] [--block-size 64]``.

The model is ``pipedream_ft_examples.gpt:gpt`` (4 blocks, width 128, 0.8 M parameters, tied embeddings), the data
``examples/text_data.py`` (byte windows of Python's help text), the optimizer AdamW. In the same run:

1. profile the model layer by layer and plan a straight 4-stage pipeline (``partition(..., straight=True)``;
   the partitioner's unconstrained plan for 4 workers is shown too);
2. train ``--minibatches`` minibatches in **one process** (one thread, and again with one thread per core),
   timing every minibatch after a warm-up;
3. train the same minibatches on **4 spawned processes** (gloo on loopback, one thread each) in ``stash`` and
   ``flush`` mode: the last stage stamps the time each loss is computed, and the steady-state rate is taken
   between two minibatches well inside the run (fill and drain left out); the whole run's rate is shown too.

Then it prints tokens/s of each against one single-threaded process, and the plan's predicted time per
minibatch (the slowest stage's profiled forward + backward) against the measured steady-state one, per stage
too (compute = forward + backward + update per minibatch on that rank). The profile is measured one layer at a
time in one process on an idle core; a pipeline of 4 processes on fewer than 4 cores shares them, so there the
measured time is about ``4 / cores`` times the predicted one, and the speedup over one process is bounded by the
number of cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spawned import run_world  # noqa: E402

__all__ = ["Settings", "single_process", "run_pipeline", "main"]


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    minibatches: int = 120
    batch_size: int = 16
    block_size: int = 64
    lr: float = 3e-4
    flush_every: int = 4
    timeout_s: float = 120.0

    @property
    def tokens(self) -> int:
        """Tokens per minibatch."""
        return self.batch_size * self.block_size


def _data(s: Settings) -> Any:
    from pipedream_ft_examples.text_data import TextData

    return TextData(s.block_size, s.batch_size, seed=0)


def _optimizer(s: Settings) -> Any:
    from pipedream_ft_examples.train_gpt import make_optimizer

    return make_optimizer("adamw", s.lr)


def make_plan(s: Settings) -> tuple[Any, Any]:
    """The straight 4-stage plan and the partitioner's unconstrained one, from a fresh profile."""
    import torch

    from pipedream_ft_examples.gpt import gpt
    from partitioner import partition
    from profiler.measure import profile_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    profile = profile_model(gpt(), _data(s)(0)[0], warmup=2, repeats=5)
    return partition(profile, 4, 1e9, straight=True), partition(profile, 4, 1e9)


def single_process(s: Settings, threads: int) -> dict[str, float]:
    """Plain training of the same model: seconds per minibatch over the run after a warm-up of 5."""
    import torch

    from pipedream_ft_examples.gpt import gpt
    from pipedream_ft_examples.train_gpt import lm_loss

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = gpt()
    opt = _optimizer(s)(list(model.parameters()))
    data = _data(s)
    warm = 5
    t0 = 0.0
    for b in range(s.minibatches + warm):
        if b == warm:
            t0 = time.perf_counter()
        x, y = data(b)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    torch.set_num_threads(1)
    return {"s_per_minibatch": seconds / s.minibatches, "final_loss": float(loss.detach())}


# -- the pipeline, one rank -------------------------------------------------------------------------------


def _rank_main(s: Settings, plan_json: dict[str, Any], mode: str) -> dict[str, Any]:
    import torch

    from pipedream_ft_examples.gpt import gpt
    from pipedream_ft_examples.train_gpt import lm_loss
    from partitioner.plan import Plan
    from pipedream_ft import PipelineConfig, PipelineTrainer

    torch.set_num_threads(1)
    stamps: list[float] = []

    def loss_fn(out: Any, target: Any) -> Any:
        if torch.is_grad_enabled():  # the pre-flight pass runs without gradients
            stamps.append(time.perf_counter())
        return lm_loss(out, target)

    torch.manual_seed(0)
    trainer = PipelineTrainer(gpt(), Plan.from_json(plan_json), loss_fn=loss_fn, optimizer_factory=_optimizer(s),
                              config=PipelineConfig(mode=mode, flush_every=s.flush_every, timeout_s=s.timeout_s,
                                                    summary=False, progress=False))
    data = _data(s)
    warm = 2 * s.flush_every * trainer.plan.num_stages  # fills, pre-flight, first allocations
    trainer.train(data, warm)
    before = dataclasses.replace(trainer.stats)
    stamps.clear()
    result = trainer.train(data, s.minibatches)
    after = result.stats
    out: dict[str, Any] = {"stage": trainer.stage_index, "whole_s": result.seconds,
                           "compute_s": (after.forward_s + after.backward_s + after.update_s)
                           - (before.forward_s + before.backward_s + before.update_s),
                           "wait_s": after.wait_s - before.wait_s, "losses": result.losses}
    if trainer.is_last:
        n = len(stamps)
        k0, k1 = n // 6, n - 1 - n // 6
        out["steady_s"] = (stamps[k1] - stamps[k0]) / (k1 - k0)
    trainer.close()
    return out


def run_pipeline(s: Settings, plan_json: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """Spawn one process per rank of the plan, train, return each rank's figures (rank order)."""
    world = sum(len(st["ranks"]) for st in plan_json["stages"])
    return run_world(_rank_main, (s, plan_json, mode), world, s.timeout_s + 120, f"{mode} pipeline")


# -- report ---------------------------------------------------------------------------------------------------


def _describe(plan: Any) -> str:
    return f"{plan.num_stages} stages, replicas {[st.replicas for st in plan.stages]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minibatches", type=int, default=120, help="measured minibatches per configuration")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--modes", default="stash,flush", help="pipeline modes to run (default stash,flush)")
    p.add_argument("--quick", action="store_true", help="a third of the minibatches")
    args = p.parse_args(argv)
    n = max(24, args.minibatches // 3) if args.quick else args.minibatches
    s = Settings(minibatches=n - n % 4, batch_size=args.batch_size, block_size=args.block_size)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    print(f"GPT example: {s.minibatches} minibatches of {s.batch_size} x {s.block_size} tokens; {cores} cores",
          flush=True)

    plan, free = make_plan(s)
    print(f"plan (straight): {_describe(plan)}; predicted {plan.time_per_minibatch_s * 1e3:.2f} ms/minibatch")
    print(f"plan (unconstrained, for reference): {_describe(free)}; predicted "
          f"{free.time_per_minibatch_s * 1e3:.2f} ms/minibatch", flush=True)

    rows: list[tuple[str, float, str]] = []
    one = single_process(s, 1)
    rows.append(("1 process, 1 thread", one["s_per_minibatch"], ""))
    if cores > 1:
        many = single_process(s, cores)
        rows.append((f"1 process, {cores} threads", many["s_per_minibatch"], ""))
    pipelines: dict[str, list[dict[str, Any]]] = {}
    for mode in [m for m in args.modes.split(",") if m]:
        t0 = time.perf_counter()
        res = run_pipeline(s, plan.to_json(), mode)
        pipelines[mode] = res
        steady = res[-1]["steady_s"]
        whole = max(r["whole_s"] for r in res) / s.minibatches
        label = f"4-stage pipeline, {mode}" + (f" (every {s.flush_every})" if mode == "flush" else "")
        rows.append((label, steady, f"whole run {s.tokens / whole:8.0f} tok/s"))
        print(f"  {label}: {time.perf_counter() - t0:.1f} s", flush=True)

    base = one["s_per_minibatch"]
    print()
    print("Throughput (same model, data and optimizer; pipeline: steady state, fill and drain left out)")
    head = f"{'configuration':34} {'ms/minibatch':>12} {'tokens/s':>9} {'vs 1 proc':>9}  note"
    print(head)
    print("-" * len(head))
    for label, sec, note in rows:
        print(f"{label:34} {sec * 1e3:12.2f} {s.tokens / sec:9.0f} {base / sec:9.2f}  {note}")

    print()
    print(f"Predicted (plan, profiled one layer at a time on an idle core) vs measured time per minibatch; "
          f"4 processes on {cores} cores")
    head = f"{'':10} {'predicted ms':>12} " + " ".join(f"{m + ' ms':>11} {'ratio':>6}" for m in pipelines)
    print(head)
    print("-" * len(head))
    line = f"{'pipeline':10} {plan.time_per_minibatch_s * 1e3:12.2f} "
    line += " ".join(f"{res[-1]['steady_s'] * 1e3:11.2f} {res[-1]['steady_s'] / plan.time_per_minibatch_s:6.2f}"
                     for res in pipelines.values())
    print(line)
    for st in plan.stages:
        line = f"{'stage ' + str(st.index):10} {st.time_s * 1e3:12.2f} "
        parts = []
        for res in pipelines.values():
            r = next(x for x in res if x["stage"] == st.index)
            busy = r["compute_s"] / s.minibatches
            parts.append(f"{busy * 1e3:11.2f} {busy / st.time_s:6.2f}")
        print(line + " ".join(parts))
    world = plan.world_size
    if cores < world:
        shared = plan.time_per_minibatch_s * world / cores
        line = f"{'shared':10} {shared * 1e3:12.2f} "
        line += " ".join(f"{res[-1]['steady_s'] * 1e3:11.2f} {res[-1]['steady_s'] / shared:6.2f}"
                         for res in pipelines.values())
        print(line + f"   (predicted x {world}/{cores}: {world} processes sharing {cores} cores)")
    print("(stage rows: compute = forward + backward + update per minibatch on that rank; the pipeline row: the "
          "measured steady-state interval between losses)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
