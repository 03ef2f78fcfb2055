"""Runtime throughput against the no-bubble bound and against ``torch.distributed.pipelining``.

Run: ``python benchmarks/bench_runtime.py [--quick] [--cases 20/40,2/4] [--stages 4]``.

A 4-stage sleep model (:mod:`sleep_model`: each stage's forward sleeps F ms and its backward B ms, on
``(8, 64)`` tensors) runs on 4 spawned CPU processes (gloo on loopback, one thread each). For each ``F/B`` case
the same processes first train it with pipedream-ft (mode ``stash``), then with
``torch.distributed.pipelining``'s ``Schedule1F1B`` (8 microbatches per step, a flush and an optimizer step
after each).

- pipedream-ft steady state: the last stage stamps the time each minibatch's loss is computed (the loss
  function is wrapped; the runtime is not touched); the rate between minibatch ``k0`` and ``k1``, well inside
  the run, leaves out the fill and the drain. The whole run's rate (fill and drain included) is shown too.
- ``Schedule1F1B``: microbatches per second over whole steps (each step fills and drains by design).
- The no-bubble bound is ``1 / (F + B)`` minibatches per second: the slowest stage never idles.

A second table shows, per stage, peak RSS, the weight versions and bytes the stash held at its peak against
what 1F1B needs (``S - s`` versions on stage ``s``), and where the stage's time went over the measured run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spawned import run_world  # noqa: E402

__all__ = ["Case", "run_case", "main"]

TARGET_BOUND = {(20.0, 40.0): 0.97, (2.0, 4.0): 0.85}
"""Fraction of the no-bubble bound pipedream-ft should reach, per (F, B): the runtime issue's targets."""
TARGET_SPEEDUP = 1.3
"""pipedream-ft's throughput over ``Schedule1F1B``'s that it should reach."""


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One benchmark world: sleep times and run lengths."""

    forward_ms: float
    backward_ms: float
    stages: int = 4
    minibatches: int = 64
    """pipedream-ft minibatches in the measured run."""
    pipe_steps: int = 4
    """``Schedule1F1B`` steps (of ``microbatches`` each) in the measured run."""
    microbatches: int = 8
    batch: int = 8
    width: int = 64
    timeout_s: float = 120.0

    @property
    def bound(self) -> float:
        """No-bubble throughput, minibatches per second."""
        return 1000.0 / (self.forward_ms + self.backward_ms) if self.forward_ms + self.backward_ms > 0 else float("inf")


def _cpu_s() -> float:
    """CPU seconds this process (all its threads) has used."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# -- one rank -------------------------------------------------------------------------------------------------


def _rank_main(case: Case) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from partitioner.plan import Plan
    from pipedream_ft import PipelineConfig, PipelineTrainer, init_distributed
    from profiler.layers import structure_profile
    from sleep_model import sleep_model

    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout_s=case.timeout_s)  # the barriers and Schedule1F1B use the default group
    rank, S = int(os.environ["RANK"]), case.stages

    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(case.batch, case.width, generator=g), torch.randn(case.batch, case.width, generator=g)

    stamps: list[float] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # the pre-flight pass runs without gradients
            stamps.append(time.perf_counter())
        return nn.functional.mse_loss(out, target)

    torch.manual_seed(0)
    model = sleep_model(S, case.forward_ms, case.backward_ms)
    prof = structure_profile(model)
    plan = Plan.from_stages([[i] for i in range(S)], [1] * S, profile_hash=prof.structure_hash(),
                            layer_names=[l.name for l in prof.layers])
    trainer = PipelineTrainer(model, plan, loss_fn=loss_fn,
                              optimizer_factory=lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9),
                              config=PipelineConfig(mode="stash", timeout_s=case.timeout_s, backend="gloo"))
    out: dict[str, Any] = {"rank": rank, "stage": trainer.stage_index}

    # -- pipedream-ft --
    trainer.train(data, 2 * S)  # warm-up (and the pre-flight pass)
    before = dataclasses.replace(trainer.stats)
    stamps.clear()
    dist.barrier()
    cpu0, t0 = _cpu_s(), time.perf_counter()
    result = trainer.train(data, case.minibatches)
    out["pd_cpu_s"] = _cpu_s() - cpu0
    dist.barrier()
    out["pd_wall_s"] = time.perf_counter() - t0
    stats = result.stats
    out["pd_stats"] = {f.name: getattr(stats, f.name) - (getattr(before, f.name) if f.name.endswith("_s") or
                                                           f.name == "minibatches" else 0)
                       for f in dataclasses.fields(stats)}
    out["pd_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if trainer.is_last:
        n = len(stamps)
        k0, k1 = min(2 * S, n // 4), n - 1 - S
        out["pd_steady"] = (k1 - k0) / (stamps[k1] - stamps[k0])

    # -- torch.distributed.pipelining, same processes, same stage --
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    layer = sleep_model(S, case.forward_ms, case.backward_ms)[rank]
    stage = PipelineStage(layer, rank, S, torch.device("cpu"))  # shapes inferred on the warm-up step
    schedule = Schedule1F1B(stage, n_microbatches=case.microbatches, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-4, momentum=0.9)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(10_000 + i)
        x = torch.randn(case.batch * case.microbatches, case.width, generator=g)
        y = torch.randn(case.batch * case.microbatches, case.width, generator=g)
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        elif rank == S - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()

    step(0)  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(case.pipe_steps):
        step(1 + i)
    dist.barrier()
    out["tp_wall_s"] = time.perf_counter() - t0
    out["tp_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


def run_case(case: Case) -> list[dict[str, Any]]:
    """Spawn ``case.stages`` ranks, run both pipelines, return each rank's figures (rank order)."""
    return run_world(_rank_main, (case,), case.stages, case.timeout_s + 60, f"case {case}")


# -- report ---------------------------------------------------------------------------------------------------


def _throughput_rows(case: Case, res: list[dict[str, Any]]) -> dict[str, float]:
    last = res[-1]
    pd_steady = float(last["pd_steady"])
    pd_overall = case.minibatches / max(r["pd_wall_s"] for r in res)
    tp = case.pipe_steps * case.microbatches / max(r["tp_wall_s"] for r in res)
    return {"bound": case.bound, "pd_steady": pd_steady, "pd_overall": pd_overall, "tp": tp}


def _print_tables(cases: list[Case], results: list[list[dict[str, Any]]]) -> bool:
    ok = True
    print()
    print(f"Throughput (minibatches/s; Schedule1F1B: microbatches/s), {cases[0].stages} CPU processes, gloo")
    head = (f"{'F/B ms':>8} {'bound':>7} {'pd steady':>10} {'/bound':>7} {'pd whole':>9} {'1F1B x8':>8} "
            f"{'/bound':>7} {'pd/1F1B':>8}  targets")
    print(head)
    print("-" * len(head))
    for case, res in zip(cases, results):
        f = _throughput_rows(case, res)
        want = TARGET_BOUND.get((case.forward_ms, case.backward_ms))
        r_pd, r_tp, speedup = f["pd_steady"] / f["bound"], f["tp"] / f["bound"], f["pd_steady"] / f["tp"]
        verdict = []
        if want is not None:
            verdict.append(f"pd>={want:.2f}:{'ok' if r_pd >= want else 'MISSED'}")
            ok &= r_pd >= want
        verdict.append(f"x{TARGET_SPEEDUP}:{'ok' if speedup >= TARGET_SPEEDUP else 'MISSED'}")
        ok &= speedup >= TARGET_SPEEDUP
        print(f"{case.forward_ms:>3g}/{case.backward_ms:<4g} {f['bound']:7.2f} {f['pd_steady']:10.2f} {r_pd:7.3f} "
              f"{f['pd_overall']:9.2f} {f['tp']:8.2f} {r_tp:7.3f} {speedup:8.2f}  {' '.join(verdict)}")
    print()
    print("Memory and time per stage (pipedream-ft, measured run; RSS is the process peak after it; fwd/bwd include\n"
          "the sleeps, wait is time blocked on a peer, cpu is the process's CPU time, all threads)")
    head = (f"{'F/B ms':>8} {'stage':>5} {'RSS MiB':>8} {'versions':>8} {'need':>4} {'stash B':>7} "
            f"{'fwd s':>6} {'bwd s':>6} {'upd s':>6} {'wait s':>6} {'cpu s':>6} {'mb':>4}")
    print(head)
    print("-" * len(head))
    for case, res in zip(cases, results):
        for r in res:
            st = r["pd_stats"]
            need = case.stages - r["stage"]
            flag = "" if st["peak_stash_versions"] <= need else "  OVER"
            ok &= not flag
            print(f"{case.forward_ms:>3g}/{case.backward_ms:<4g} {r['stage']:5d} {r['pd_rss_kib'] / 1024:8.1f} "
                  f"{st['peak_stash_versions']:8d} {need:4d} {st['peak_stash_bytes']:7d} {st['forward_s']:6.2f} "
                  f"{st['backward_s']:6.2f} {st['update_s']:6.3f} {st['wait_s']:6.2f} {r['pd_cpu_s']:6.2f} "
                  f"{st['minibatches']:4d}{flag}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="20/40,2/4", help="comma-separated F/B pairs in ms (default 20/40,2/4)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages = processes (default 4)")
    p.add_argument("--quick", action="store_true", help="runs half as long")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds one case may take")
    args = p.parse_args(argv)
    cases = []
    for item in args.cases.split(","):
        fwd, bwd = (float(v) for v in item.split("/"))
        step_ms = max(fwd + bwd, 1.0)
        # about 4 s of pipedream-ft (64 minibatches at 20/40, 400 at 2/4) and 3 s of Schedule1F1B per case;
        # half with --quick
        scale = 0.5 if args.quick else 1.0
        minibatches = max(4 * args.stages, int(scale * min(400, 3840 / step_ms)))
        pipe_steps = max(2, int(scale * 3000 / (step_ms * (8 + args.stages - 1))))
        cases.append(Case(fwd, bwd, args.stages, minibatches, pipe_steps, timeout_s=args.timeout))
    results = []
    for case in cases:
        t0 = time.perf_counter()
        print(f"F={case.forward_ms:g} ms B={case.backward_ms:g} ms: {case.minibatches} pipedream-ft minibatches, "
              f"{case.pipe_steps} Schedule1F1B steps of {case.microbatches} ...", end=" ", flush=True)
        results.append(run_case(case))
        print(f"{time.perf_counter() - t0:.1f} s", flush=True)
    ok = _print_tables(cases, results)
    print()
    print("all targets met" if ok else "some targets MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
