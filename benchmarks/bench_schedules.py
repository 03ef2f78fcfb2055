"""``flush`` mode's schedules (1F1B, GPipe, ZB-H1) against ``torch.distributed.pipelining``'s, and against the
schedule simulator's prediction.

Run: ``python benchmarks/bench_schedules.py [--quick] [--cases 10/10/10,2/2/2] [--steps N] [--repeats R]
[--timelines DIR]``.

``--timelines DIR`` also traces two steps of each of our schedules (the first case's sleeps) and draws each as
``DIR/<schedule>.png`` with :func:`pipedream_ft.observe.plot.draw_timeline` (``pipedream-timeline``'s figure):
ranks × time, forwards blue, (input-)backwards green, ZB-H1's deferred weight gradients purple.

A 4-stage split sleep model (:class:`sleep_model.SplitSleepLayer`: each stage computes
``SleepInput(x) * SleepWeight(w)``; the forward sleeps F ms, the input path's backward I ms, the weight path's
backward W ms, on ``(8, 64)`` microbatches) runs on 4 spawned CPU processes (gloo on 127.0.0.1, one thread
each). For each ``F/I/W`` case the same processes train it, schedule after schedule, with pipedream-ft
(``PipelineConfig(mode="flush", flush_every=8, schedule=...)``) and then with the same schedule class of
``torch.distributed.pipelining`` (8 microbatches per step, an optimizer step after each):

- ``1f1b`` against ``Schedule1F1B``, ``gpipe`` against ``ScheduleGPipe``, ``zb_h1`` against
  ``ScheduleInterleavedZeroBubble`` given one stage per rank (torch 2.13 has no single-stage ZB-H1 class; its
  interleaved zero-bubble class with one local stage builds exactly ZB-H1's order, checked here before the run);
- ``table``, a schedule given as data: ZB-H1's order written as a CSV table (one row per rank), run by ours from
  ``PipelineConfig(schedule="<table>.csv")`` and by torch's ``_PipelineScheduleRuntime`` from the same file
  (``_load_csv``, torch's own CSV path, which adds the sends and receives).

Per schedule and library: throughput (minibatches per second over whole steps: fill and drain included, as
each step flushes), against the bound ``1 / (F + I + W)``; the bubble ``1 - busy / elapsed`` over all ranks
(busy: the sleeps each rank actually slept, counted by the model, so the runtime's own work counts as idle), and
for ours the idle time (each rank's time blocked waiting for a peer, from the runtime's ``RankStats.wait_s``, plus
its wait at the end for the slowest rank: the bubble with the runtime's own work as busy, which is what the
simulator's bubble means); and the simulator's
(:func:`pipedream_ft.schedules.simulate`) predicted time per step, the same number of steps run back to back (the
first stage has no input gradient: its ``I`` costs 0, in the model and in the prediction), with the ratio
measured / predicted, for three sets of costs: the nominal sleeps; the sleeps as slept; and the planner's, i.e.
the sleep model as ``pipedream-profile``'s :func:`profiler.measure.profile_model` measures it in one process
(forward, backward, and the backward's weight-gradient share; beside the sleeps, what autograd costs per action),
summed per stage by :func:`partitioner.schedule_choice.schedule_costs` as ``pipedream-partition`` does; and,
unless ``--no-probe``, that with the machine as ``pipedream-probe`` measures it first on as many processes
(``pipedream-partition --machine``: the runtime's fixed cost per action and the links' latency added).

``--schedule auto`` against the measurement: the same profile, planned one layer per stage, and
:func:`partitioner.schedule_choice.choose` picks a schedule as ``pipedream-partition --schedule auto`` would; the
pick is compared with the schedule of ours measured fastest.

Targets (printed; ``MISSED`` beside one missed; the exit status is 0 either way): every schedule of ours at
least 1.0x its peer's throughput; ZB-H1's idle time (and the table's) within 10 % (relative) of the planner's
predicted bubble; the planner's prediction (with the machine, when the probe ran) within 5 % of our measured
step time; ``auto`` picks the measured-fastest schedule.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spawned import run_world  # noqa: E402

__all__ = ["Case", "PEERS", "run_cases", "predict", "split_check", "parse_cases", "arguments", "runs", "fastest", "our_trainer", "rank_main",
           "sleep_data", "sleep_plan", "measured", "draw_timelines", "main"]

PEERS = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "zb_h1": "ScheduleInterleavedZeroBubble",
         "table": "_PipelineScheduleRuntime"}
"""Our schedule -> the ``torch.distributed.pipelining`` class it is measured against. ``table``: ZB-H1's order
written as a CSV table, run by ours from ``PipelineConfig(schedule="<table>.csv")`` and by torch's CSV-loading
runtime class from the same file."""
TABLE_ORDER = "zb_h1"
"""The order the ``table`` row's CSV holds."""
TARGET_PEER = 1.0
"""Our throughput over the peer's, per schedule, at least."""
TARGET_ZB_BUBBLE = 0.10
"""ZB-H1's idle time within this fraction of the planner's predicted bubble."""
TARGET_SIM = 0.05
"""Our measured step time within this fraction of the planner's prediction (the simulator with the measured
profile's costs)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One benchmark world: sleep times and run lengths."""

    forward_ms: float
    input_ms: float
    weight_ms: float
    steps: int = 6
    """Optimizer steps (of ``microbatches`` minibatches each) per measured run."""
    repeats: int = 1
    """Measured runs per schedule and library, alternating ours and torch's; the fastest counts."""
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "zb_h1")
    stages: int = 4
    microbatches: int = 8
    batch: int = 8
    width: int = 64
    timeout_s: float = 180.0
    timeline_dir: str | None = None
    """Trace two steps of each schedule of ours into ``<dir>/<schedule>/`` (after the measured runs)."""
    table: str | None = None
    """The CSV the ``table`` schedule loads (written by :func:`write_table`)."""

    @property
    def label(self) -> str:
        return f"{self.forward_ms:g}/{self.input_ms:g}/{self.weight_ms:g}"

    @property
    def bound(self) -> float:
        """No-bubble throughput of the slowest stage, minibatches per second."""
        total = self.forward_ms + self.input_ms + self.weight_ms
        return 1000.0 / total if total > 0 else float("inf")

    def costs(self) -> Any:
        """The simulator's per-stage costs in ms (stage 0 has no input gradient to compute)."""
        from pipedream_ft.schedules import Costs

        S = self.stages
        return Costs(forward=[self.forward_ms] * S, input_backward=[0.0] + [self.input_ms] * (S - 1),
                     weight_backward=[self.weight_ms] * S)


# -- on paper -------------------------------------------------------------------------------------------------


def predict(case: Case, name: str, steps: int, costs: Any = None) -> tuple[float, float]:
    """The simulator's time per step (ms) and bubble fraction for ``steps`` steps of ``name`` run back to back
    (no barrier between steps, like both runtimes: a rank starts the next step once its own part is done), with
    ``costs`` (default: the case's sleep times)."""
    from pipedream_ft.schedules import Action, build, simulate

    built = build(TABLE_ORDER if name == "table" else name, case.stages, case.microbatches)
    m = case.microbatches
    sched = {r: [Action(a.stage, a.kind, w * m + a.index) for w in range(steps) for a in acts]
             for r, acts in built.schedule.items()}
    t = simulate(sched, costs if costs is not None else case.costs(), built.placement)
    return t.step_time / steps, t.bubble_fraction


def write_table(stages: int, microbatches: int, directory: Path) -> str:
    """Write the ``table`` schedule's CSV (:data:`TABLE_ORDER`, compute actions only) into ``directory``."""
    from pipedream_ft.schedules import build, save_csv

    path = directory / f"{TABLE_ORDER}-{stages}x{microbatches}.csv"
    save_csv(build(TABLE_ORDER, stages, microbatches).schedule, path)
    return str(path)


def peer_matches(name: str, stages: int, microbatches: int) -> str:
    """Whether torch's peer class (one stage per rank) builds our schedule's order of compute actions."""
    from torch.distributed.pipelining import schedules as tps

    from pipedream_ft.schedules import build

    if name == "table":
        return f"both load the same CSV table ({TABLE_ORDER}'s order)"

    cls = getattr(tps, PEERS[name], None)
    if cls is None:
        return f"torch has no {PEERS[name]}"
    stub = [SimpleNamespace(num_stages=stages, group_size=stages, group_rank=0, stage_index=0, submod=None)]
    try:
        order = cls(stub if name == "zb_h1" else stub[0], microbatches).pipeline_order
    except Exception as exc:  # noqa: BLE001 -- reported, not fatal
        return f"{PEERS[name]} cannot build it: {exc}"
    theirs = {r: [f"{a.computation_type.value}{a.microbatch_index}" for a in acts if a is not None and
                  a.computation_type.value in ("F", "B", "I", "W")] for r, acts in order.items()}
    ours = {r: [f"{a.kind.value}{a.index}" for a in acts]
            for r, acts in build(name, stages, microbatches).schedule.items()}
    if name == "1f1b":  # torch 2.13's table numbers the last rank's forwards from 1; its runtime does not read it
        last = stages - 1
        theirs[last] = [a if not a.startswith("F") else f"F{int(a[1:]) - 1}" for a in theirs[last]]
    same = ours == theirs
    return "same order as ours" if same else "a DIFFERENT order from ours"


def split_check(forward_ms: float, input_ms: float, weight_ms: float, repeats: int = 5
                ) -> list[tuple[str, float, float, str, str]]:
    """Time each library's input-gradient-only and weight-gradient-only backward of one middle stage (its input
    needs a gradient), the median of ``repeats`` after a warm-up; return ``(library, I ms, W ms, sleeps in I,
    sleeps in W)`` (the sleeps: kind x count, as the model counted them)."""
    rows = []
    for lib in ("pipedream-ft", "torch"):
        trials = [_split_once(lib, forward_ms, input_ms, weight_ms) for _ in range(repeats + 1)][1:]  # a warm-up
        i_ms = sorted(t[0] for t in trials)[len(trials) // 2]
        w_ms = sorted(t[1] for t in trials)[len(trials) // 2]
        in_i, in_w = {t[2] for t in trials}, {t[3] for t in trials}
        rows.append((lib, i_ms, w_ms, " / ".join(sorted(in_i)), " / ".join(sorted(in_w))))
    return rows


def _split_once(lib: str, forward_ms: float, input_ms: float, weight_ms: float) -> tuple[float, float, str, str]:
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from pipedream_ft.pipeline.splitbackward import input_backward
    from sleep_model import LEDGER, SplitSleepLayer, reset_ledger

    def slept() -> str:
        return " ".join(f"{k}x{int(v[0])}" for k, v in LEDGER.items() if v[0]) or "none"

    layer = SplitSleepLayer(forward_ms, input_ms, weight_ms)
    x = torch.randn(8, 64, requires_grad=True)
    out = layer(x)
    g = torch.randn_like(out)
    reset_ledger()
    t0 = time.perf_counter()
    if lib == "pipedream-ft":
        _, job = input_backward([out], [g], [x], [layer.weight])
    else:
        _, groups = stage_backward_input([out], [g], [x], layer.parameters())
    t1 = time.perf_counter()
    in_i = slept()
    reset_ledger()
    t2 = time.perf_counter()
    if lib == "pipedream-ft":
        job.run()
    else:
        stage_backward_weight(layer.parameters(), groups)
    t3 = time.perf_counter()
    return 1000 * (t1 - t0), 1000 * (t3 - t2), in_i, slept()


# -- one rank -------------------------------------------------------------------------------------------------


def _cpu_s() -> float:
    """CPU seconds this process (all its threads) has used."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def rank_main(body: Any, cases: list[Any]) -> list[dict[str, Any]]:
    """One spawned rank: join the gloo group, then ``body(case)`` for each case (a barrier after each)."""
    import torch
    import torch.distributed as dist

    from pipedream_ft import init_distributed

    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout_s=max(c.timeout_s for c in cases))
    out = []
    for case in cases:
        out.append(body(case))
        dist.barrier()
    return out


def sleep_data(case: Any) -> Any:
    """``data(b)``: minibatch ``b`` of random inputs and targets of the case's shape."""
    import torch

    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(case.batch, case.width, generator=g), torch.randn(case.batch, case.width, generator=g)

    return data


def sleep_plan(case: Any) -> Any:
    """The plan of one split sleep layer per stage."""
    from partitioner.plan import Plan
    from profiler.layers import structure_profile
    from sleep_model import split_sleep_model

    S = case.stages
    prof = structure_profile(split_sleep_model(S, case.forward_ms, case.input_ms, case.weight_ms))
    return Plan.from_stages([[i] for i in range(S)], [1] * S, profile_hash=prof.structure_hash(),
                            layer_names=[l.name for l in prof.layers])


def measured(run: Any, waited: Any = None) -> dict[str, Any]:
    """``run()``'s figures between two barriers: wall time, CPU time, the sleeps slept; ``waited()``: the seconds
    this rank has waited for its peers so far (ours)."""
    import torch.distributed as dist

    from sleep_model import LEDGER, reset_ledger

    dist.barrier()
    reset_ledger()
    w0 = waited() if waited is not None else 0.0
    cpu0, t0 = _cpu_s(), time.perf_counter()
    run()
    elapsed, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    ledger = {k: (int(v[0]), float(v[1])) for k, v in LEDGER.items()}
    wait = waited() - w0 if waited is not None else None
    dist.barrier()
    return {"elapsed_s": elapsed, "cpu_s": cpu, "ledger": ledger, "wait_s": wait}


def our_trainer(case: Any, schedule: str, trace_dir: str | None = None) -> Any:
    """pipedream-ft's trainer of the case's sleep model under ``schedule`` (flush mode, a window per step), the
    weights seeded alike on every rank; ``trace_dir``: trace it there."""
    import torch
    from torch import nn

    from pipedream_ft import PipelineConfig, PipelineTrainer
    from sleep_model import split_sleep_model

    torch.manual_seed(0)
    return PipelineTrainer(split_sleep_model(case.stages, case.forward_ms, case.input_ms, case.weight_ms),
                           sleep_plan(case), loss_fn=nn.functional.mse_loss,
                           optimizer_factory=lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9),
                           config=PipelineConfig(mode="flush", flush_every=case.microbatches, schedule=schedule,
                                                 timeout_s=case.timeout_s, backend="gloo", progress=False,
                                                 summary=False, trace_dir=trace_dir))


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
        # -- pipedream-ft --
        schedule_of_ours = case.table if name == "table" else name
        trainer = our_trainer(case, schedule_of_ours)
        trainer.train(data, m)  # warm-up (and the pre-flight pass)

        # -- torch.distributed.pipelining, same processes, same stage --
        torch.manual_seed(0)
        layer = split_sleep_model(S, F, I, W)[rank]
        stage = PipelineStage(layer, rank, S, torch.device("cpu"))  # shapes inferred on the warm-up step
        cls = getattr(tps, PEERS[name], None)
        schedule = None
        if cls is not None:
            schedule = cls([stage] if name in ("zb_h1", "table") else stage, n_microbatches=m,
                           loss_fn=nn.functional.mse_loss)
            if name == "table":
                schedule._load_csv(case.table)  # compute actions; torch adds the sends and receives
        opt = torch.optim.SGD(layer.parameters(), lr=1e-4, momentum=0.9)

        def step(i: int) -> None:
            g = torch.Generator().manual_seed(10_000 + i)
            x = torch.randn(case.batch * m, case.width, generator=g)
            y = torch.randn(case.batch * m, case.width, generator=g)
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            elif rank == S - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()

        def torch_run() -> None:
            for i in range(case.steps):
                step(1 + i)

        if schedule is not None:
            step(0)  # warm-up
        ours, theirs = [], []
        for _ in range(case.repeats):
            ours.append(measured(lambda: trainer.train(data, case.steps * m), lambda: trainer.stats.wait_s))
            if schedule is not None:
                theirs.append(measured(torch_run))
        trainer.close()
        out["runs"][name] = {"ours": ours, "torch": theirs or None}
        if case.timeline_dir is not None:
            traced = our_trainer(case, schedule_of_ours, str(Path(case.timeline_dir) / name))
            traced.train(data, m)  # warm-up, traced too: the figure draws the last two steps
            traced.train(data, 2 * m)
            traced.close()
    return out


def run_cases(cases: list[Any], body: Any = None, processes: int | None = None) -> list[list[dict[str, Any]]]:
    """Spawn ``processes`` ranks (default: one per stage) once, run ``body(case)`` (default: every case's schedules
    with both libraries) in them for each case; return, per case, each rank's figures (rank order). The processes
    are killed if they take longer than the cases' timeouts."""
    if len({c.stages for c in cases}) != 1:
        raise ValueError("every case of one run needs the same number of stages")
    per_rank = run_world(rank_main, (body or _rank_case, cases), processes or cases[0].stages,
                         sum(c.timeout_s for c in cases), "cases " + ", ".join(c.label for c in cases))
    return [[per_rank[r][i] for r in range(len(per_rank))] for i in range(len(cases))]


def fastest(case: Any, res: list[dict[str, Any]], name: str, lib: str) -> tuple[list[dict[str, Any]], float] | None:
    """Each rank's figures in ``lib``'s fastest repeat of ``name`` (a repeat's time is its slowest rank's), and that
    time in seconds; ``None`` if ``lib`` did not run it."""
    if any(r["runs"][name][lib] is None for r in res):
        return None
    best = min(range(case.repeats), key=lambda i: max(r["runs"][name][lib][i]["elapsed_s"] for r in res))
    runs = [r["runs"][name][lib][best] for r in res]
    return runs, max(r["elapsed_s"] for r in runs)


# -- report ---------------------------------------------------------------------------------------------------


def _figures(case: Case, res: list[dict[str, Any]], name: str, lib: str) -> dict[str, float] | None:
    found = fastest(case, res, name, lib)
    if found is None:
        return None
    runs, elapsed = found
    busy = sum(sum(s for _, s in r["ledger"].values()) for r in runs)
    n = case.steps * case.microbatches
    # every rank slept F and W once per minibatch, and I once on every stage but the first
    counts_ok = all(r["ledger"]["F"][0] == n and r["ledger"]["W"][0] == n and
                    r["ledger"]["I"][0] == (0 if rank == 0 else n) for rank, r in enumerate(runs))
    # a rank is idle while it waits for a peer and, at the end, until the slowest rank is done
    waits = [None if r.get("wait_s") is None else r["wait_s"] + elapsed - r["elapsed_s"] for r in runs]
    return {"rate": n / elapsed, "step_ms": 1000 * elapsed / case.steps,
            "bubble": 1 - busy / (case.stages * elapsed), "counts_ok": float(counts_ok), "slept": _slept_costs(runs),
            "cpu_ms": 1000 * sum(r["cpu_s"] for r in runs) / case.steps,
            # time the ranks sat waiting for a peer (ours only): the bubble with the runtime's own work as busy
            "waiting": None if None in waits else sum(waits) / (case.stages * elapsed)}


def _slept_costs(runs: list[dict[str, Any]]) -> Any:
    """Per-stage costs (ms) as the sleeps actually took (a sleep overshoots its time, more on a loaded machine)."""
    from pipedream_ft.schedules import Costs

    def mean(r: dict[str, Any], kind: str) -> float:
        count, seconds = r["ledger"][kind]
        return 1000 * seconds / count if count else 0.0

    return Costs(forward=[mean(r, "F") for r in runs], input_backward=[mean(r, "I") for r in runs],
                 weight_backward=[mean(r, "W") for r in runs])


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _print_tables(cases: list[Case], results: list[list[dict[str, Any]]], machine: Any = None) -> bool:
    ok = True
    print()
    print("Throughput (minibatches/s over whole steps of 8; bound 1/(F+I+W)), 4 CPU processes, gloo; "
          f"target ours/torch >= {TARGET_PEER:.1f}")
    head = (f"{'F/I/W ms':>9} {'ours':>6} {'torch class':>30} {'bound':>6} {'ours':>7} {'/bound':>6} "
            f"{'torch':>7} {'/bound':>6} {'ours/torch':>10}  target")
    print(head)
    print("-" * len(head))
    for case, res in zip(cases, results):
        for name in case.schedules:
            f_o, f_t = _figures(case, res, name, "ours"), _figures(case, res, name, "torch")
            assert f_o is not None
            if f_t is None:
                print(f"{case.label:>9} {name:>6} {'(torch has no ' + PEERS[name] + ')':>30} {case.bound:6.1f} "
                      f"{f_o['rate']:7.2f} {f_o['rate'] / case.bound:6.3f}")
                continue
            ratio = f_o["rate"] / f_t["rate"]
            ok &= ratio >= TARGET_PEER
            print(f"{case.label:>9} {name:>6} {PEERS[name]:>30} {case.bound:6.1f} {f_o['rate']:7.2f} "
                  f"{f_o['rate'] / case.bound:6.3f} {f_t['rate']:7.2f} {f_t['rate'] / case.bound:6.3f} "
                  f"{ratio:10.3f}  >={TARGET_PEER:.1f}:{_mark(ratio >= TARGET_PEER)}")
    print()
    planner = ("the measured profile's and machine's costs" if machine is not None
               else "the measured profile's costs; no machine measured")
    print("Step time and bubble against the simulator (same steps back to back; bubble = 1 - busy/elapsed over all "
          "ranks, busy = the sleeps;\n"
          f"targets, ours only: step within {100 * TARGET_SIM:.0f} % of the planner's prediction (the simulator "
          f"with {planner}), ZB-H1's idle time (waiting for a peer) within {100 * TARGET_ZB_BUBBLE:.0f} % of the "
          "planner's predicted bubble)")
    head = (f"{'F/I/W ms':>9} {'sched':>6} {'library':>12} {'step ms':>8} {'pred ms':>8} {'meas/pred':>9} "
            f"{'bubble':>7} {'pred':>7} {'slept F/I/W ms':>15} {'pred@slept':>10} {'meas/p@s':>8} "
            f"{'pred@prof':>9} {'meas/p@p':>8} {'pred@mach':>9} {'meas/p@m':>8} {'idle':>6} {'pred':>6} "
            f"{'cpu ms':>6} {'sleeps':>6}  targets")
    print(head)
    print("-" * len(head))
    for case, res in zip(cases, results):
        planned = profile_costs(case)
        with_machine = profile_costs(case, machine) if machine is not None else None
        for name in case.schedules:
            pred_ms, pred_bubble = predict(case, name, case.steps)
            at_profile, idle_profile = predict(case, name, case.steps, planned)
            at_machine, idle_machine = (predict(case, name, case.steps, with_machine) if with_machine is not None
                                        else (None, None))
            planners = at_machine if at_machine is not None else at_profile
            planners_idle = idle_machine if idle_machine is not None else idle_profile
            for lib in ("ours", "torch"):
                f = _figures(case, res, name, lib)
                if f is None:
                    continue
                r = f["step_ms"] / pred_ms
                verdict = []
                if lib == "ours":
                    sim_ok = abs(f["step_ms"] / planners - 1) <= TARGET_SIM
                    ok &= sim_ok
                    verdict.append(f"sim:{_mark(sim_ok)}")
                    if name in ("zb_h1", "table"):
                        b_ok = abs(f["waiting"] - planners_idle) <= TARGET_ZB_BUBBLE * planners_idle
                        ok &= b_ok
                        verdict.append(f"bubble:{_mark(b_ok)}")
                counts = "ok" if f["counts_ok"] else "WRONG"
                ok &= bool(f["counts_ok"])
                label = "pipedream-ft" if lib == "ours" else "torch"
                slept = f["slept"]
                at_slept, _ = predict(case, name, case.steps, slept)
                mid = case.stages // 2  # a middle stage's mean sleeps
                sl = f"{slept.forward[mid]:.2f}/{slept.input_backward[mid]:.2f}/{slept.weight_backward[mid]:.2f}"
                print(f"{case.label:>9} {name:>6} {label:>12} {f['step_ms']:8.1f} {pred_ms:8.1f} {r:9.3f} "
                      f"{100 * f['bubble']:6.1f}% {100 * pred_bubble:6.1f}% {sl:>15} {at_slept:10.1f} "
                      f"{f['step_ms'] / at_slept:8.3f} {at_profile:9.1f} {f['step_ms'] / at_profile:8.3f} "
                      + (f"{at_machine:9.1f} {f['step_ms'] / at_machine:8.3f} " if at_machine is not None
                         else f"{'-':>9} {'-':>8} ")
                      + (f"{100 * f['waiting']:5.1f}% {100 * planners_idle:5.1f}% " if f["waiting"] is not None
                         else f"{'-':>6} {'-':>6} ")
                      + f"{f['cpu_ms']:6.0f} {counts:>6}  {' '.join(verdict)}")
    print("(pred: the simulator with the nominal sleeps; slept: a middle stage's mean sleep per action; pred@slept:\n"
          " the simulator with every stage's slept means, so meas/p@s is the runtime's own overhead; pred@prof: with\n"
          " the costs pipedream-profile measured for the model (one process, no pipeline), as pipedream-partition\n"
          " predicts; pred@mach: also with the machine pipedream-probe measured (the runtime's fixed cost per\n"
          " action, the links' latency), as pipedream-partition --machine predicts; bubble: 1 - slept/elapsed\n"
          " (the runtime's own work counts as idle) against pred, the nominal one; idle: ours only, the time the\n"
          " ranks waited for a peer or, at the end, for the slowest rank, against pred, the planner's bubble; cpu ms:\n"
          " CPU time of all 4 processes per step; sleeps: every rank slept F and W once per minibatch and I once,\n"
          " except the first stage, which has no input gradient)")
    return ok


_PROFILED: dict[Case, tuple[Any, Any]] = {}


def profiled(case: Case) -> tuple[Any, Any]:
    """The case's sleep model as ``pipedream-profile`` measures it (:func:`profiler.measure.profile_model`: forward,
    backward, and the backward's weight-gradient share), and its plan of one layer per stage; measured once per
    case, in this process."""
    if case not in _PROFILED:
        import torch

        from partitioner.plan import Plan
        from profiler.measure import profile_model
        from sleep_model import split_sleep_model

        torch.set_num_threads(1)
        profile = profile_model(split_sleep_model(case.stages, case.forward_ms, case.input_ms, case.weight_ms),
                                torch.randn(case.batch, case.width), warmup=1, repeats=3)
        plan = Plan.from_stages([[i] for i in range(case.stages)], [1] * case.stages,
                                profile_hash=profile.structure_hash(), layer_names=[l.name for l in profile.layers])
        _PROFILED[case] = profile, plan
    return _PROFILED[case]


def profile_costs(case: Case, machine: Any = None) -> Any:
    """The costs (ms) the planner simulates the case with: :func:`partitioner.schedule_choice.schedule_costs` of
    the measured profile, and of ``machine`` (``pipedream-probe``'s) if given. Beside the sleeps the profile holds
    what one action of the model costs a process outside its sleeps (autograd, the sleep's own overshoot); the
    machine, the runtime's own cost per action and the links' latency."""
    from partitioner.schedule_choice import schedule_costs
    from pipedream_ft.schedules import Costs

    profile, plan = profiled(case)
    c = schedule_costs(plan, profile, machine=machine)
    return Costs(forward=[1e3 * x for x in c.forward], input_backward=[1e3 * x for x in c.input_backward],
                 weight_backward=[1e3 * x for x in c.weight_backward], latency=1e3 * c.latency,
                 overhead=1e3 * c.overhead)


def probe_machine(stages: int, directory: Path, timeout_s: float = 180.0) -> Any:
    """``pipedream-probe`` on ``stages`` processes (torchrun, gloo), as a user measures the machine before
    planning; its :class:`~partitioner.machine.MachineProfile`, or ``None`` (said why) if it failed."""
    import os
    import subprocess

    from partitioner.machine import load_machine

    out = directory / "machine.json"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(stages),
           "-m", "pipedream_ft.probe", "--backend", "gloo", "-o", str(out)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"pipedream-probe did not finish in {timeout_s:.0f} s: no machine-aware prediction")
        return None
    if done.returncode != 0 or not out.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        print(f"pipedream-probe failed (exit {done.returncode}): no machine-aware prediction; " + " | ".join(tail))
        return None
    machine = load_machine(out)
    print(f"pipedream-probe on {stages} processes: " + machine.describe().replace("\n", "; "))
    return machine


def auto_choice(case: Case, machine: Any = None) -> tuple[str, str]:
    """What ``pipedream-partition --schedule auto`` picks for the case's sleep model from a measured profile (and
    ``--machine``, if ``machine`` is given), and the ranking's table."""
    from partitioner.schedule_choice import choose, format_ranking, rank_schedules

    profile, plan = profiled(case)
    ranking = rank_schedules(plan, profile, case.microbatches, names=[n for n in case.schedules if n != "table"],
                             machine=machine)
    chosen = choose(ranking).name
    return chosen, format_ranking(ranking, chosen)


def _print_auto(cases: list[Case], results: list[list[dict[str, Any]]], machine: Any = None) -> bool:
    ok = True
    print()
    print("--schedule auto (a profile measured by profile_model, one layer per stage"
          + (", and the probe's machine" if machine is not None else "") + ") against the measured fastest "
          "of ours; target: the same")
    for case, res in zip(cases, results):
        if len([n for n in case.schedules if n != "table"]) < 2:
            continue
        chosen, table = auto_choice(case, machine)
        # the table holds ZB-H1's order: auto is judged among the named schedules
        rates = {name: f["rate"] for name in case.schedules
                 if name != "table" and (f := _figures(case, res, name, "ours")) is not None}
        fastest = max(rates, key=rates.__getitem__)
        # a pick within the run-to-run noise of the fastest is as good as it
        close = rates[chosen] >= 0.98 * rates[fastest]
        ok &= close
        print(f"  F/I/W = {case.label} ms: auto picks {chosen} ({rates[chosen]:.2f}/s), measured fastest {fastest} "
              f"({rates[fastest]:.2f}/s): {_mark(close)}")
        print("    " + table.replace("\n", "\n    "))
    return ok


def draw_timelines(case: Any, directory: Path, where: str = "4 ranks", prefix: str = "") -> None:
    """``directory/<prefix><schedule>.png`` of each traced schedule: its last two steps, from stage 0's first
    forward of them (the warm-up step before them is left out); ``where``: the title's words for the ranks."""
    from pipedream_ft.observe.plot import clip_trace, draw_timeline
    from pipedream_ft.observe.timeline import merge_traces, trace_files

    print()
    for name in case.schedules:
        trace = merge_traces(trace_files(directory / name))
        timed = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        begin = min(e["ts"] for e in timed if e.get("cat") == "forward" and e["args"]["minibatch"] == case.microbatches
                    and e["args"]["stage"] == 0)
        end = max(e["ts"] + e["dur"] for e in timed)
        out = directory / f"{prefix}{name}.png"
        draw_timeline(clip_trace(trace, (end - begin) / 1e6), out, width_px=1200,
                      title=f"{name}: {where}, {case.microbatches} microbatches per step, F/I/W = {case.label} ms")
        print(f"timeline of {name} (two steps): {out}")


def parse_cases(text: str) -> list[tuple[float, float, float]]:
    """``--cases``: comma-separated ``F/I/W`` sleep times in ms; ValueError naming a bad one."""
    out = []
    for item in text.split(","):
        try:
            fwd, inp, wgt = (float(v) for v in item.split("/"))
        except ValueError:
            raise ValueError(f"--cases takes F/I/W triples, got {item!r}") from None
        if min(fwd, inp, wgt) < 0:
            raise ValueError(f"sleep times must be >= 0, got {item!r}")
        out.append((fwd, inp, wgt))
    return out


def arguments(description: str, peers: dict[str, str], default_schedules: str, what: str) -> argparse.ArgumentParser:
    """The options both schedule benches take (``what``: the schedule whose step sets the default length)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--cases", default="10/10/10,2/2/2",
                   help="comma-separated F/I/W sleep times in ms (default 10/10/10,2/2/2)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps (of 8 minibatches) per measured run (default: about 2 s of {what} per "
                        "run, 0.7 s with --quick; at least 3)")
    p.add_argument("--repeats", type=int, default=None,
                   help="measured runs per schedule and library, the fastest counts (default 2; 1 with --quick)")
    p.add_argument("--schedules", default=default_schedules, help=f"which of ours (some of {', '.join(peers)})")
    p.add_argument("--quick", action="store_true", help="short runs")
    p.add_argument("--timelines", metavar="DIR", default=None,
                   help="also draw two traced steps of each schedule of ours as DIR/<schedule>.png")
    p.add_argument("--no-probe", action="store_true",
                   help="skip pipedream-probe (the prediction is then the profile's alone)")
    return p


def runs(p: argparse.ArgumentParser, args: argparse.Namespace, peers: dict[str, str], case: Any, step_of: Any,
         slowest: Any) -> list[Any]:
    """The cases ``args`` ask for, each ``case(F, I, W)`` with its steps (``step_of(probe)``: the step in ms that
    sets the default count), repeats, schedules and timeout (``slowest(probe, schedules)``: the slowest schedule's
    step in ms); a bad option ends ``p``."""
    schedules = tuple(x.strip() for x in args.schedules.split(",") if x.strip())
    for x in schedules:
        if x not in peers:
            p.error(f"unknown schedule {x!r}: expected some of {', '.join(peers)}")
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 2)
    if repeats < 1 or (args.steps is not None and args.steps < 1):
        p.error("--steps and --repeats must be >= 1")
    try:
        triples = parse_cases(args.cases)
    except ValueError as exc:
        p.error(str(exc))
    cases = []
    for fwd, inp, wgt in triples:
        probe = case(fwd, inp, wgt)
        step_ms = max(step_of(probe), 1.0)
        steps = args.steps if args.steps is not None else max(3, round((700 if args.quick else 2000) / step_ms))
        # two libraries, repeats plus a warm-up step each, at most the slowest schedule's step each; spawning
        run_s = 2 * len(schedules) * (repeats * steps + 1) * slowest(probe, schedules) / 1000
        timeout = args.timeout if getattr(args, "timeout", None) is not None else 120 + 4 * run_s
        cases.append(dataclasses.replace(probe, steps=steps, repeats=repeats, schedules=schedules, timeout_s=timeout))
    return cases


def main(argv: list[str] | None = None) -> int:
    p = arguments(__doc__.split("\n\n")[0], PEERS, "1f1b,gpipe,zb_h1,table", "1F1B")
    p.add_argument("--timeout", type=float, default=None, help="seconds one case may take (default: from its length)")
    args = p.parse_args(argv)
    cases = runs(p, args, PEERS, Case, lambda probe: predict(probe, "1f1b", 1)[0],
                 lambda probe, names: predict(probe, "gpipe", 1)[0])  # every schedule is at most as slow as GPipe
    schedules = cases[0].schedules
    if args.timelines is not None:
        cases[0] = dataclasses.replace(cases[0], timeline_dir=str(Path(args.timelines).resolve()))
    tables = tempfile.TemporaryDirectory(prefix="bench-schedules-")
    if "table" in schedules:
        path = write_table(cases[0].stages, cases[0].microbatches, Path(tables.name))
        cases = [dataclasses.replace(c, table=path) for c in cases]

    print("torch's peer of each schedule, one stage per rank (compute actions of 4 ranks, 8 microbatches):")
    for name in schedules:
        print(f"  {name:>6} vs {PEERS[name]}: {peer_matches(name, cases[0].stages, cases[0].microbatches)}")
    c0 = cases[0]
    print(f"Split backward of one middle stage (F/I/W = {c0.label} ms): each library's input-gradient-only and "
          "weight-gradient-only halves")
    for lib, i_ms, w_ms, in_i, in_w in split_check(c0.forward_ms, c0.input_ms, c0.weight_ms):
        want = in_i == "Ix1" and in_w == "Wx1"
        print(f"  {lib:>12}: I {i_ms:6.2f} ms (slept {in_i}), W {w_ms:6.2f} ms (slept {in_w})"
              f"{'' if want else '  NOT SPLIT'}")
    print()
    machine = None if args.no_probe else probe_machine(cases[0].stages, Path(tables.name))
    t0 = time.perf_counter()
    print("Running " + "; ".join(f"F/I/W = {c.label} ms: {c.repeats} x {c.steps} steps" for c in cases) +
          f" (steps of {c0.microbatches}) per schedule and library, in 4 processes ...", end=" ", flush=True)
    results = run_cases(cases)
    print(f"{time.perf_counter() - t0:.1f} s", flush=True)
    ok = _print_tables(cases, results, machine)
    ok &= _print_auto(cases, results, machine)
    if args.timelines is not None:
        draw_timelines(cases[0], Path(args.timelines))
    tables.cleanup()
    print()
    print("all targets met" if ok else "some targets MISSED (exit status 0 all the same: the figures on a shared CPU "
                                      "machine are ratios, see benchmarks/README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
