"""Predicted against measured time per minibatch, for plans made with a measured machine profile.

Run: ``python benchmarks/bench_prediction.py [--quick] [--machine probe.json] [--cases sleep-20/40,sleep-2/4,digits,gpt]``.

In one run, on 4 spawned CPU processes (gloo on loopback, one thread each):

1. the machine is probed (``pipedream_ft.probe``, as ``torchrun -m pipedream_ft.probe`` would), unless
   ``--machine`` gives a profile;
2. each model is profiled layer by layer in this process (``profiler.measure.profile_model``, one thread) and
   planned for 4 workers twice: with PipeDream's cost model (``bandwidth`` of the probe, no other term) and
   with the machine profile (``partition(..., machine=...)``);
3. the measured-cost plan trains on 4 ranks: the last stage's replicas stamp the time each loss is computed,
   and the steady-state time per minibatch is taken between two minibatches well inside the run (fill and
   drain left out).

Models: the sleep model of ``benchmarks/sleep_model.py`` (4 layers of F/B ms sleeps on ``(8, 64)``
tensors, at 20/40 and 2/4 ms), the digits CNN (``examples/train_digits.py``, batch 32, Adam) and the GPT
example (``examples/gpt.py`` default small config, batch 16 x 64 tokens, AdamW). Error = measured /
predicted - 1; the target is within 10 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spawned import run_world  # noqa: E402

__all__ = ["Case", "CASES", "make_case", "profile_case", "run_plan", "run_plans", "probe_machine", "main"]

TARGET = 0.10


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One model of the benchmark: how to build it, its data and its loss, on every rank."""

    name: str
    minibatches: int
    """Minibatches in the measured run."""
    timeout_s: float = 120.0


CASES = {
    "sleep-20/40": Case("sleep-20/40", 60),
    "sleep-2/4": Case("sleep-2/4", 300),
    "digits": Case("digits", 300),
    "gpt": Case("gpt", 120),
}


def make_case(name: str) -> tuple[Any, Any, Any, Any]:
    """``(model, data(b), loss_fn, optimizer_factory)`` of a case (deterministic, same on every rank)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name.startswith("sleep-"):
        from sleep_model import sleep_model

        fwd, bwd = (float(v) for v in name.removeprefix("sleep-").split("/"))

        def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(b)
            return torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)

        return (sleep_model(4, fwd, bwd), data, nn.functional.mse_loss,
                lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9))
    if name == "digits":
        from pipedream_ft_examples.models import digits_cnn
        from pipedream_ft_examples.train_digits import DigitsData, make_optimizer

        return digits_cnn(), DigitsData(32, 0), nn.functional.cross_entropy, make_optimizer("adam", None)
    if name == "gpt":
        from pipedream_ft_examples.gpt import gpt
        from pipedream_ft_examples.text_data import TextData
        from pipedream_ft_examples.train_gpt import lm_loss, make_optimizer

        return gpt(), TextData(64, 16, seed=0), lm_loss, make_optimizer("adamw", 3e-4)
    raise ValueError(f"unknown case {name!r}")


def profile_case(name: str) -> Any:
    import torch

    from profiler.measure import profile_model

    torch.set_num_threads(1)
    model, data, _, _ = make_case(name)
    # the sleep layers' time takes no core: tell the cost model's contention bound (see partitioner.cost)
    meta = {"cpu_fraction": 0.0} if name.startswith("sleep-") else None
    return profile_model(model, data(0)[0], warmup=3, repeats=9, meta=meta)


# -- ranks ----------------------------------------------------------------------------------------------------


def _rank_main(runs: list[tuple[Case, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every ``(case, plan)`` of ``runs`` trained in turn by this rank, each by a trainer of its own."""
    return [_train_one(case, plan_json) for case, plan_json in runs]


def _train_one(case: Case, plan_json: dict[str, Any]) -> dict[str, Any]:
    import torch

    from partitioner.plan import Plan
    from pipedream_ft import PipelineConfig, PipelineTrainer

    torch.set_num_threads(1)
    model, data, loss, opt = make_case(case.name)
    stamps: list[float] = []

    def loss_fn(out: Any, target: Any) -> Any:
        if torch.is_grad_enabled():  # the pre-flight pass runs without gradients
            stamps.append(time.perf_counter())
        return loss(out, target)

    plan = Plan.from_json(plan_json)
    trainer = PipelineTrainer(model, plan, loss_fn=loss_fn, optimizer_factory=opt,
                              config=PipelineConfig(timeout_s=case.timeout_s, summary=False, progress=False))
    unit = math.lcm(*(s.replicas for s in plan.stages))
    warm = unit * max(1, -(-2 * plan.num_stages // unit))
    trainer.train(data, warm)
    before = dataclasses.replace(trainer.stats)
    stamps.clear()
    n = case.minibatches - case.minibatches % unit
    cpu0 = time.process_time()
    result = trainer.train(data, n)
    cpu = time.process_time() - cpu0
    after = result.stats
    out = {"stage": trainer.stage_index, "last": trainer.is_last, "stamps": list(stamps), "minibatches": n,
           "cpu_s": cpu, "busy_s": (after.forward_s + after.backward_s + after.update_s)
           - (before.forward_s + before.backward_s + before.update_s), "wait_s": after.wait_s - before.wait_s}
    trainer.close()
    return out


def run_plan(case: Case, plan: Any) -> dict[str, Any]:
    """Train ``plan`` on its ranks; steady-state seconds per minibatch (their mean, ``steady_s``, and the median of
    the minibatches, ``median_s``) and per-rank figures."""
    return run_plans([(case, plan)])[0]


def run_plans(runs: list[tuple[Case, Any]]) -> list[dict[str, Any]]:
    """:func:`run_plan` of each ``(case, plan)``, one after another in one world of spawned ranks (the plans have
    the same number of ranks): one start-up of the processes for all of them."""
    worlds = {plan.world_size for _, plan in runs}
    if len(worlds) != 1:
        raise ValueError(f"run_plans needs plans of one world size, got {sorted(worlds)}")
    res = run_world(_rank_main, ([(case, plan.to_json()) for case, plan in runs],), worlds.pop(),
                    sum(case.timeout_s for case, _ in runs) + 120, "the world")
    return [_steady(plan, [r[i] for r in res]) for i, (_, plan) in enumerate(runs)]


def _steady(plan: Any, res: list[dict[str, Any]]) -> dict[str, Any]:
    stamps = sorted(t for r in res if r["last"] for t in r["stamps"])
    n = len(stamps)
    unit = plan.stages[-1].replicas  # the last stage's replicas stamp in bursts: measure whole bursts
    k0 = unit * (n // (6 * unit))
    k1 = k0 + unit * ((n - 1 - n // 6 - k0) // unit)
    # the median of the steady state's whole bursts: a burst of load from elsewhere on the machine moves the mean
    # of the minibatches it lands on, not their median
    median = statistics.median((stamps[k + unit] - stamps[k]) / unit for k in range(k0, k1, unit))
    return {"steady_s": (stamps[k1] - stamps[k0]) / (k1 - k0), "median_s": median, "ranks": res}


def _probe_rank(path: str) -> int:
    from pipedream_ft.probe import main

    return main(["-o", path, "--timeout", "60"])


def probe_machine(path: str, world: int = 4) -> Any:
    """Run the probe on ``world`` spawned ranks; the machine profile it wrote."""
    from partitioner.machine import load_machine

    codes = run_world(_probe_rank, (path,), world, 240, "the probe")
    if any(codes):
        raise RuntimeError(f"the probe failed: exit codes {codes}")
    return load_machine(path)


# -- report ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from partitioner import partition
    from partitioner.cli import format_plan
    from partitioner.machine import load_machine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine", help="a machine profile (default: probe now)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--quick", action="store_true", help="half as many minibatches")
    ap.add_argument("--show-plans", action="store_true")
    ap.add_argument("--straight", action="store_true", help="plan straight pipelines (one worker per stage)")
    args = ap.parse_args(argv)
    names = args.cases.split(",")
    for n in names:
        if n not in CASES:
            ap.error(f"unknown case {n!r}; choose from {', '.join(CASES)}")
    if args.machine:
        machine = load_machine(args.machine)
    else:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            machine = probe_machine(str(Path(tmp) / "machine.json"))
        print(f"probed the machine in {time.perf_counter() - t0:.1f} s")
    print(machine.describe())
    rows = []
    for name in names:
        case = CASES[name]
        if args.quick:
            case = dataclasses.replace(case, minibatches=max(24, case.minibatches // 2))
        profile = profile_case(name)
        pd_plan = partition(profile, machine.workers, machine.bandwidth, straight=args.straight)
        plan = partition(profile, None, machine=machine, straight=args.straight)
        if args.show_plans:
            print(f"\n{name}:\n{format_plan(plan)}")
        t0 = time.perf_counter()
        measured = run_plan(case, plan)
        stages = " ".join(f"[{s.layers[0]}-{s.layers[-1]}]x{s.replicas}" for s in plan.stages)
        rows.append((name, stages, pd_plan.time_per_minibatch_s, plan.time_per_minibatch_s, measured["steady_s"]))
        busy = " ".join(f"{r['busy_s'] / r['minibatches'] * 1e3:.2f}" for r in measured["ranks"])
        cpu = " ".join(f"{r['cpu_s'] / r['minibatches'] * 1e3:.2f}" for r in measured["ranks"])
        print(f"{name}: {stages}; ran in {time.perf_counter() - t0:.1f} s; per rank ms/minibatch busy {busy}; "
              f"cpu {cpu}", flush=True)
    print()
    print("Time per minibatch on 4 CPU ranks (ms): PipeDream's model, the measured-cost model, measured")
    head = f"{'model':>12} {'PipeDream':>10} {'predicted':>10} {'measured':>10} {'error':>8}  plan"
    print(head)
    print("-" * len(head))
    ok = True
    for name, stages, pd_t, t, m in rows:
        err = m / t - 1.0
        ok &= abs(err) <= TARGET
        print(f"{name:>12} {pd_t * 1e3:10.3f} {t * 1e3:10.3f} {m * 1e3:10.3f} {err * 100:+7.1f}%  {stages}"
              f"{'' if abs(err) <= TARGET else '  MISSED'}")
    print()
    print(f"all within {TARGET:.0%}" if ok else f"some predictions off by more than {TARGET:.0%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
