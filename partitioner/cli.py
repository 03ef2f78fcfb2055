"""``pipedream-partition``: plan a profiled model for a (hierarchical) machine.

Usage::

    pipedream-partition PROFILE --workers N [--workers N ...] --bandwidth B [--bandwidth B ...]
                        [--straight] [--memory BYTES] [--schedule NAME|auto|T.csv [--microbatches M]] -o plan.json
    pipedream-partition PROFILE --machine probe.json [--workers N ...] [--straight] [--memory BYTES] -o plan.json

Repeated ``--workers``/``--bandwidth`` give the levels of the machine innermost first (like PipeDream's
``-n``/``-b``). ``--machine`` plans under the costs ``pipedream-probe`` measured (its levels give the
bandwidths and, unless ``--workers`` is given, the workers); the measured costs and the formulas are printed
with the plan, and the plan records them. ``--schedule`` ranks the schedules the runtime runs for the plan by
their simulated time per minibatch with ``M`` minibatches per step (default ``2 x`` stages) and the memory each
holds (:mod:`partitioner.schedule_choice`); ``auto`` picks the fastest synchronous one that fits ``--memory``;
a table's path (``T.csv``, one window of a synchronous schedule, one row per worker) ranks that table beside them
at its own number of minibatches and chooses it. With ``--machine`` the ranking also simulates the runtime's
measured fixed cost per action and the links' latency. The
plan records the choice and the ranking under ``settings["schedule"]``. ``--virtual-stages V`` adds the
schedules of ``V`` stages per worker (interleaved 1F1B, interleaved zero-bubble, looped BFS; ZBV and DualPipeV
for ``V = 2``) to the ranking, planned on ``workers x V`` straight stages at the slowest ``--bandwidth`` (or the
machine's); ``--schedule NAME`` of one of them implies them (``V = 2`` unless given). When one of them is chosen,
the plan written is that one, of ``workers x V`` stages, to train on ``workers`` processes (see
:mod:`pipedream_ft.virtual`). With a schedule chosen, the plan's predicted time per minibatch is that schedule's
(its row of the ranking), and its time per step is that times the minibatches per step. What each printed figure
means, and the line that says a plan is pure data parallelism, are :mod:`partitioner.report`'s. Errors print one line
``pipedream-partition: error: ...`` and exit with status 2; the output
file is then left untouched.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from profiler.cliutil import CliError, OneLineParser, number, run_cli, write_atomic
from profiler.profile import ProfileError, load_profile

from .optimizer import partition
from .machine import MachineProfile, load_machine
from .plan import Plan, PlanError
from .report import data_parallel_note, format_plan, is_data_parallel, layer_ranges
from .schedule_choice import (DEFAULT_WEIGHT_FRACTION, RUNNABLE, VIRTUAL, choose, format_ranking, rank_schedules,
                              rank_virtual, virtual_plan)

__all__ = ["main", "format_plan", "layer_ranges", "FORMULAS"]

FORMULAS = ("cost model: stage = max((C + O + AR(r, P)) / r, 2 (L + o_in / B) / r, 2 (L + o_out / B) / r); "
            "first stage = (C + O + AR / w) / r;\n"
            "  AR(r, P) = 4 (r-1)/r * (lambda + P / B_ar); C compute, P parameter bytes, o bytes crossing a cut, "
            "r replicas, O fixed cost per stage")

PROG = "pipedream-partition"


_WORKERS = number("workers", integer=True, low=1)
_BANDWIDTH = number("bandwidth", low=0, unit=" of bytes/s")
_MEMORY = number("memory", low=0, unit=" of bytes")
_MICROBATCHES = number("microbatches", integer=True, low=1)
_FRACTION = number("weight-fraction", low=0, high=1)
_VIRTUAL = number("virtual-stages", integer=True, low=2)


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description="Split a profiled model into PipeDream pipeline stages.")
    ap.add_argument("profile", help="profile: pipedream-ft JSON or PipeDream graph.txt")
    ap.add_argument("--workers", "-n", action="append", type=_WORKERS,
                    help="workers (training processes) at one level (repeat for levels, innermost first)")
    ap.add_argument("--bandwidth", "-b", action="append", type=_BANDWIDTH,
                    help="bandwidth of one level in bytes/s, e.g. 1e9 (repeat like --workers)")
    ap.add_argument("--machine", metavar="PROBE_JSON", help="machine profile written by pipedream-probe")
    ap.add_argument("--straight", action="store_true",
                    help="a pipeline without replication: one stage per worker, never pure data parallelism")
    ap.add_argument("--memory", type=_MEMORY, default=None, help="memory per worker in bytes")
    ap.add_argument("--schedule", metavar="NAME|auto|T.csv", default=None,
                    help=f"rank the schedules for the plan and pick NAME ({', '.join(RUNNABLE)}), with auto the "
                         "fastest synchronous one that fits --memory, or the table T.csv (one window, one row per "
                         "worker), ranked beside them")
    ap.add_argument("--microbatches", type=_MICROBATCHES, default=None,
                    help="minibatches per step (one optimizer update) for --schedule (flush_every; default 2 x "
                         "stages)")
    ap.add_argument("--weight-fraction", type=_FRACTION, default=None,
                    help="share of every backward taken as the weight gradient, for the split schedules (default: "
                         "as the profiler measured it, 0.5 for layers it did not)")
    ap.add_argument("--virtual-stages", type=_VIRTUAL, default=None, metavar="V",
                    help="with --schedule: also rank the schedules of V stages per worker (a plan of workers x V "
                         "stages, trained on the workers' processes)")
    ap.add_argument("-o", "--output", required=True, help="where to write the plan JSON")
    return ap


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    machine = None
    if args.machine is not None:
        if args.bandwidth:
            raise CliError("--bandwidth and --machine exclude each other: the machine profile gives the bandwidths")
    else:
        if not args.workers or not args.bandwidth:
            raise CliError("the following arguments are required: --workers and --bandwidth (or --machine)")
        if len(args.workers) != len(args.bandwidth):
            raise CliError(f"{len(args.workers)} --workers levels but {len(args.bandwidth)} --bandwidth levels; "
                           "give one bandwidth per level")
    out = Path(args.output)
    try:
        if args.machine is not None:
            machine = load_machine(args.machine)
        profile = load_profile(args.profile)
        plan = partition(profile, args.workers, None if machine else args.bandwidth, straight=args.straight,
                         memory_bytes=args.memory, machine=machine)
        ranking = None
        if args.virtual_stages is not None and args.schedule is None:
            raise CliError("--virtual-stages needs --schedule")
        if args.schedule is not None:
            plan, ranking = _with_schedule(plan, profile, args, machine)
    except (ProfileError, PlanError) as exc:
        raise CliError(str(exc)) from None
    write_atomic(out, plan.dumps())
    if machine is not None:
        print(machine.describe())
        print(FORMULAS)
    print(format_plan(plan))
    note = data_parallel_note(plan, _straight_time(profile, args, machine) if is_data_parallel(plan) else None)
    if note is not None:
        print(note)
    if ranking is not None:
        print(ranking)
    print(f"plan written to {out}")
    return 0


def _straight_time(profile: object, args: argparse.Namespace, machine: MachineProfile | None) -> float | None:
    """The best straight pipeline's predicted time per minibatch, for comparison; None where none exists."""
    try:
        return partition(profile, args.workers, None if machine else args.bandwidth,  # type: ignore[arg-type]
                         straight=True, memory_bytes=args.memory, machine=machine).time_per_minibatch_s
    except PlanError:
        return None


def _with_schedule(plan: Plan, profile: object, args: argparse.Namespace, machine: MachineProfile | None = None
                   ) -> tuple[Plan, str]:
    """The plan with its schedule chosen (``settings["schedule"]``), and the ranking's table; with ``machine``,
    its measured costs are simulated too."""
    if args.schedule in VIRTUAL and args.virtual_stages is None:
        args.virtual_stages = 2
    tables = []
    if args.schedule.lower().endswith(".csv"):
        from pipedream_ft.schedules import WindowSchedule

        try:
            table = WindowSchedule.load(args.schedule)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        if args.microbatches is not None and args.microbatches != table.microbatches:
            raise PlanError(f"the schedule {table} runs windows of {table.microbatches} minibatches; --microbatches "
                            f"is {args.microbatches}")
        if args.virtual_stages is not None:
            raise PlanError("--virtual-stages ranks the schedules of several stages per worker beside --schedule "
                            "auto, not beside a table")
        tables, args.microbatches = [table], table.microbatches
    elif args.schedule != "auto" and args.schedule not in RUNNABLE + VIRTUAL:
        raise PlanError(f"--schedule must be auto, one of {', '.join(RUNNABLE + VIRTUAL)} or a table's path (.csv), "
                        f"got {args.schedule!r}")
    m = args.microbatches or 2 * plan.num_stages
    data_parallel_s = plan.data_parallel_time_s  # on the workers' processes, which virtual stages keep too
    ranking = rank_schedules(plan, profile, m, weight_fraction=args.weight_fraction,  # type: ignore[arg-type]
                             memory_bytes=args.memory, tables=tables, machine=machine)
    workers = plan.world_size
    if args.virtual_stages is not None:
        bandwidth = min(machine.bandwidth if machine is not None else args.bandwidth)  # type: ignore[arg-type]
        ranking = sorted(ranking + rank_virtual(profile, workers, m, bandwidth,  # type: ignore
                                                stages_per_worker=args.virtual_stages,
                                                weight_fraction=args.weight_fraction, memory_bytes=args.memory,
                                                machine=machine),
                         key=lambda r: (not r.fits, r.time_per_minibatch_s))
    if args.schedule == "auto":
        chosen = choose(ranking)
    else:
        wanted = str(tables[0]) if tables else args.schedule
        chosen = next((r for r in ranking if r.name == wanted), None)
        if chosen is None:  # ZBV and DualPipeV hold 2 stages per worker, DualPipeV at least as many minibatches
            raise PlanError(f"schedule {wanted!r} cannot run {args.virtual_stages} stages per worker with {m} "
                            "minibatches per step")
        if not chosen.fits:
            raise PlanError(f"schedule {chosen.name} needs {chosen.peak_memory_bytes:.4g} bytes per worker, over "
                            f"--memory {args.memory:.4g}")
    measured = sum(layer.weight_backward_ms is not None for layer in profile.layers)  # type: ignore[attr-defined]
    split: float | str = (args.weight_fraction if args.weight_fraction is not None
                          else "measured" if measured == len(profile.layers)  # type: ignore[attr-defined]
                          else DEFAULT_WEIGHT_FRACTION if measured == 0
                          else f"measured, {DEFAULT_WEIGHT_FRACTION:g} where not")
    record = {"name": chosen.name, "microbatches": m, "weight_fraction": split, "machine": machine is not None,
              "workers": workers, "stages_per_worker": chosen.stages_per_worker,
              "ranking": [{"name": r.name, "time_per_minibatch_s": r.time_per_minibatch_s, "bubble": r.bubble,
                           "peak_memory_bytes": r.peak_memory_bytes, "fits": r.fits,
                           "stages_per_worker": r.stages_per_worker} for r in ranking]}
    if chosen.name == "pipedream":
        how = "PipelineConfig(mode='stash')  (asynchronous: PipeDream's weight stashing)"
    else:
        how = f"PipelineConfig(mode='flush', schedule='{chosen.name}', flush_every={m})"
    if chosen.stages_per_worker > 1:  # the plan of workers x V stages the schedule was simulated on
        plan = chosen.plan if chosen.plan is not None else virtual_plan(
            profile, workers, chosen.stages_per_worker, bandwidth, schedule=chosen.name)  # type: ignore[arg-type]
        how += f" on {workers} processes ({chosen.stages_per_worker} of the plan's {plan.num_stages} stages each)"
    costs = (f"the profile's costs, backwards split {split:g} weight gradient" if isinstance(split, float)
             else f"the profile's costs, backwards split as {split}")
    if machine is not None:
        costs += (f", and the machine's: {machine.overhead_s * 1e3:.3f} ms fixed cost per minibatch per stage, "
                  "the links' latency and bandwidth")
    table = (f"schedules for {m} minibatches per step (simulated with {costs}):\n"
             f"{format_ranking(ranking, chosen.name, microbatches=m)}\ntrain with {how}")
    # the plan's figures are the chosen schedule's, on the processes that train it: one set of numbers
    return dataclasses.replace(plan, time_per_minibatch_s=chosen.time_per_minibatch_s,
                               data_parallel_time_s=data_parallel_s,
                               settings={**plan.settings, "schedule": record}), table


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 on any error)."""
    return run_cli(PROG, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
