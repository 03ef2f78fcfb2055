"""Schedules of virtual stages (several stages per process) against ``torch.distributed.pipelining``'s, and
against the schedule simulator's prediction.

Run: ``python benchmarks/bench_virtual.py [--quick] [--cases 10/10/10,2/2/2] [--steps N] [--repeats R]
[--schedules interleaved_1f1b,...] [--no-probe] [--timelines DIR]``.

``--timelines DIR`` also traces two steps of each schedule of ours (the first case's sleeps) and draws each as
``DIR/<schedule>.png`` with ``pipedream-timeline``'s figure: one row per process, its later stage hatched.

A 4-stage split sleep model (:class:`sleep_model.SplitSleepLayer`: the forward sleeps F ms, the input path's
backward I ms, the weight path's backward W ms, on ``(8, 64)`` microbatches) runs on 2 spawned CPU processes
(gloo on 127.0.0.1), 2 stages per process, placed as each schedule places them (interleaved 1F1B, interleaved
zero bubble and looped BFS: stage ``s`` on process ``s % 2``; ZBV and DualPipeV: process ``r`` holds ``r`` and
``3 - r``). For each ``F/I/W`` case the same processes train it, schedule after schedule, with pipedream-ft
(``PipelineConfig(mode="flush", flush_every=8, schedule=NAME)`` on a 4-stage plan: one
:class:`~pipedream_ft.PipelineTrainer` per process, both of its stages on one rank and one thread) and then with
the same schedule class of ``torch.distributed.pipelining`` (its stages of the process in one schedule, 8
microbatches per step, an optimizer step after each).

Per schedule and library: throughput (minibatches per second over whole steps); the bubble ``1 - busy /
elapsed`` over both processes (busy: the sleeps each process slept, so the runtime's own work counts as idle);
and ours against the simulator's (:func:`pipedream_ft.schedules.simulate`) time per step, the same number of steps
run back to back, with the nominal sleeps and with the planner's costs: the model as
:func:`profiler.measure.profile_model` measures it and, unless ``--no-probe``, the machine ``pipedream-probe``
measures on 2 processes (:func:`partitioner.schedule_choice.schedule_costs` with each stage's process, so two
stages of one process exchange nothing).

Targets (printed; ``MISSED`` beside one missed; the exit status is 0 either way): every schedule of ours at least
1.0x its peer's throughput; the planner's prediction within 5 % of our measured step time.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_schedules  # noqa: E402
from bench_schedules import (arguments, draw_timelines, fastest, measured, our_trainer, probe_machine,  # noqa: E402
                             runs, sleep_data)

__all__ = ["Case", "PEERS", "predict", "run_cases", "main"]

PEERS = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
         "looped_bfs": "ScheduleLoopedBFS", "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
"""Our schedule -> the ``torch.distributed.pipelining`` class it is measured against."""
TARGET_PEER = 1.0
TARGET_SIM = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class Case(bench_schedules.Case):
    """One benchmark world (see :class:`bench_schedules.Case`): ``stages`` on ``processes`` processes."""

    schedules: tuple[str, ...] = tuple(PEERS)
    processes: int = 2
    timeout_s: float = 240.0
    ours_only: tuple[str, ...] = ()
    """Schedules run without their torch peer (a torch build whose class cannot run here)."""


def built(case: Case, name: str) -> Any:
    """The schedule (compute actions per process) and its placement, as :mod:`pipedream_ft.schedules` builds it."""
    from pipedream_ft.schedules import build

    v = case.stages // case.processes
    return build(name, case.processes, case.microbatches, None if name in ("zbv", "dualpipev") else v)


def predict(case: Case, name: str, steps: int, costs: Any = None) -> tuple[float, float]:
    """The simulator's time per step (ms) and bubble for ``steps`` steps back to back, with ``costs`` (default: the
    case's sleeps)."""
    from pipedream_ft.schedules import Action, simulate

    b = built(case, name)
    m = case.microbatches
    sched = {r: [Action(a.stage, a.kind, w * m + a.index) for w in range(steps) for a in acts]
             for r, acts in b.schedule.items()}
    t = simulate(sched, costs if costs is not None else case.costs(), b.placement)
    return t.step_time / steps, t.bubble_fraction


def planner_costs(case: Case, name: str, machine: Any = None) -> Any:
    """The costs (ms) ``pipedream-partition`` simulates the case with: the model as ``profile_model`` measures it
    (in this process), plus ``machine``'s fixed cost per action and latency between processes, if given."""
    import torch

    from partitioner.plan import Plan
    from partitioner.schedule_choice import schedule_costs
    from pipedream_ft.schedules import Costs
    from profiler.measure import profile_model
    from sleep_model import split_sleep_model

    torch.set_num_threads(1)
    key = (case.forward_ms, case.input_ms, case.weight_ms, case.stages)
    if key not in _PROFILES:
        model = split_sleep_model(case.stages, case.forward_ms, case.input_ms, case.weight_ms)
        _PROFILES[key] = profile_model(model, torch.randn(case.batch, case.width), warmup=1, repeats=3)
    profile = _PROFILES[key]
    plan = Plan.from_stages([[i] for i in range(case.stages)], [1] * case.stages,
                            profile_hash=profile.structure_hash(), layer_names=[l.name for l in profile.layers])
    placement = built(case, name).placement
    c = schedule_costs(plan, profile, machine=machine, workers=[placement[s] for s in range(case.stages)])
    return Costs(forward=[1e3 * x for x in c.forward], input_backward=[1e3 * x for x in c.input_backward],
                 weight_backward=[1e3 * x for x in c.weight_backward], latency=1e3 * c.latency,
                 overhead=1e3 * c.overhead)


_PROFILES: dict[tuple[float, float, float, int], Any] = {}


# -- one process ----------------------------------------------------------------------------------------------


def _rank_case(case: Case) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as tps

    from sleep_model import split_sleep_model

    rank, S, m = dist.get_rank(), case.stages, case.microbatches
    F, I, W = case.forward_ms, case.input_ms, case.weight_ms
    data = sleep_data(case)
    out: dict[str, Any] = {"rank": rank, "runs": {}}
    for name in case.schedules:
        local = sorted(s for s, r in built(case, name).placement.items() if r == rank)
        # -- pipedream-ft: the 4-stage plan on 2 processes --
        trainer = our_trainer(case, name)
        assert trainer.stage_indices == local, (trainer.stage_indices, local)
        trainer.train(data, m)  # warm-up (and the pre-flight pass)

        # -- torch.distributed.pipelining: the same stages in this process --
        torch.manual_seed(0)
        model = split_sleep_model(S, F, I, W)
        stages = [PipelineStage(model[s], s, S, torch.device("cpu")) for s in local]
        schedule = None if name in case.ours_only else \
            getattr(tps, PEERS[name])(stages, n_microbatches=m, loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD([p for s in local for p in model[s].parameters()], lr=1e-4, momentum=0.9)

        def step(i: int) -> None:
            g = torch.Generator().manual_seed(10_000 + i)
            x = torch.randn(case.batch * m, case.width, generator=g)
            y = torch.randn(case.batch * m, case.width, generator=g)
            opt.zero_grad(set_to_none=True)
            args = (x,) if 0 in local else ()
            kwargs = {"target": y} if S - 1 in local else {}
            schedule.step(*args, **kwargs)
            opt.step()

        def torch_run() -> None:
            for i in range(case.steps):
                step(1 + i)

        if schedule is not None:
            step(0)  # warm-up
        ours, theirs = [], []
        for _ in range(case.repeats):
            ours.append(measured(lambda: trainer.train(data, case.steps * m)))
            if schedule is not None:
                theirs.append(measured(torch_run))
        trainer.close()
        out["runs"][name] = {"ours": ours, "torch": theirs or None}
        if case.timeline_dir is not None:
            traced = our_trainer(case, name, str(Path(case.timeline_dir) / name))
            traced.train(data, 3 * m)  # a warm-up step, then the two the figure draws
            traced.close()
    return out


def run_cases(cases: list[Case]) -> list[list[dict[str, Any]]]:
    """Spawn the processes once, run every case's schedules with both libraries in them; per case, each process's
    figures."""
    return bench_schedules.run_cases(cases, _rank_case, cases[0].processes)


# -- report ---------------------------------------------------------------------------------------------------


def _figures(case: Case, res: list[dict[str, Any]], name: str, lib: str) -> dict[str, float] | None:
    found = fastest(case, res, name, lib)
    if found is None:
        return None
    runs, elapsed = found
    busy = sum(sum(s for _, s in r["ledger"].values()) for r in runs)
    n = case.steps * case.microbatches
    v = case.stages // case.processes
    # each process slept F and W once per minibatch per stage, and I once on every stage but the first
    local = [sorted(s for s, w in built(case, name).placement.items() if w == rank) for rank in range(len(runs))]
    counts_ok = all(r["ledger"]["F"][0] == v * n and r["ledger"]["W"][0] == v * n and
                    r["ledger"]["I"][0] == n * sum(s != 0 for s in local[rank]) for rank, r in enumerate(runs))
    return {"rate": n / elapsed, "step_ms": 1000 * elapsed / case.steps,
            "bubble": 1 - busy / (case.processes * elapsed), "counts_ok": float(counts_ok)}


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _print_table(cases: list[Case], results: list[list[dict[str, Any]]], machine: Any) -> bool:
    ok = True
    planner = "profile + machine" if machine is not None else "profile; no machine measured"
    print()
    print(f"4 stages on 2 CPU processes (gloo), 8 microbatches per step; targets: ours/torch >= {TARGET_PEER:.1f}, "
          f"ours within {100 * TARGET_SIM:.0f} % of the planner's prediction ({planner})")
    head = (f"{'F/I/W ms':>9} {'schedule':>24} {'torch class':>30} {'ours/s':>7} {'torch/s':>7} {'ours/torch':>10} "
            f"{'ours ms':>8} {'pred ms':>8} {'/pred':>6} {'planner':>8} {'/planner':>8} {'bubble':>7} {'torch':>7} "
            f"{'pred':>7} {'sleeps':>6}  targets")
    print(head)
    print("-" * len(head))
    for case, res in zip(cases, results):
        for name in case.schedules:
            o, t = _figures(case, res, name, "ours"), _figures(case, res, name, "torch")
            assert o is not None
            pred_ms, pred_bubble = predict(case, name, case.steps)
            plan_ms, _ = predict(case, name, case.steps, planner_costs(case, name, machine))
            sim = o["step_ms"] / plan_ms
            sim_ok = abs(sim - 1) <= TARGET_SIM
            counts = "ok" if o["counts_ok"] and (t is None or t["counts_ok"]) else "WRONG"
            ok &= sim_ok and counts == "ok"
            if t is not None:
                ratio = o["rate"] / t["rate"]
                ok &= ratio >= TARGET_PEER
                peer = f"{t['rate']:7.2f} {ratio:10.3f}"
                verdict = f"peer:{_mark(ratio >= TARGET_PEER)} "
                bubble = f"{100 * t['bubble']:6.1f}%"
            else:
                peer, verdict, bubble = f"{'-':>7} {'(not run)':>10}", "", f"{'-':>7}"
            print(f"{case.label:>9} {name:>24} {PEERS[name]:>30} {o['rate']:7.2f} {peer} "
                  f"{o['step_ms']:8.1f} {pred_ms:8.1f} {o['step_ms'] / pred_ms:6.3f} {plan_ms:8.1f} {sim:8.3f} "
                  f"{100 * o['bubble']:6.1f}% {bubble} {100 * pred_bubble:6.1f}% {counts:>6}  "
                  f"{verdict}sim:{_mark(sim_ok)}")
    print("(pred: the simulator with the nominal sleeps; planner: with the costs pipedream-partition simulates, see\n"
          " the module docstring; bubble: 1 - slept/elapsed over both processes, ours, torch's and the nominal\n"
          " prediction's; sleeps: every process slept F and W once per minibatch per stage, I once per stage but the\n"
          " first's)")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = arguments(__doc__.split("\n\n")[0], PEERS, ",".join(PEERS), "interleaved 1F1B")
    p.add_argument("--ours-only", default="", help="schedules to run without their torch peer (comma-separated; "
                                                  "for a torch whose class cannot run them here)")
    args = p.parse_args(argv)
    ours_only = tuple(x.strip() for x in args.ours_only.split(",") if x.strip())
    cases = [dataclasses.replace(c, ours_only=ours_only) for c in
             runs(p, args, PEERS, Case, lambda probe: predict(probe, "interleaved_1f1b", 1)[0],
                  lambda probe, names: max(predict(probe, name, 1)[0] for name in names))]
    if args.timelines is not None:
        cases[0] = dataclasses.replace(cases[0], timeline_dir=str(Path(args.timelines).resolve()))
    with tempfile.TemporaryDirectory(prefix="bench-virtual-") as tmp:
        machine = None if args.no_probe else probe_machine(cases[0].processes, Path(tmp))
    t0 = time.perf_counter()
    print("Running " + "; ".join(f"F/I/W = {c.label} ms: {c.repeats} x {c.steps} steps" for c in cases) +
          " per schedule and library, in 2 processes ...", end=" ", flush=True)
    results = run_cases(cases)
    print(f"{time.perf_counter() - t0:.1f} s", flush=True)
    ok = _print_table(cases, results, machine)
    if args.timelines is not None:
        draw_timelines(cases[0], Path(args.timelines), "4 stages on 2 processes", prefix="virtual-")
    print()
    print("all targets met" if ok else "some targets MISSED (exit status 0 all the same: the figures on a shared CPU "
                                      "machine are ratios, see benchmarks/README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
