"""``python -m pipedream_ft.schedules``: draw, time and rank schedules on paper.

Usage::

    python -m pipedream_ft.schedules NAME|all|TABLE.csv [--ranks R] [--microbatches N] [--stages-per-rank V]
        [--costs F,I,W] [--latency L] [--messages] [--csv OUT.csv] [--trace OUT.json] [--ms-per-unit MS]

``--costs`` is one rank's share of the model per microbatch (forward, input gradient, weight gradient; default
1,1,1), split evenly over the rank's stages, so schedules with more stages per rank compare on the same model.
``all`` prints one line per schedule, fastest first. Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from profiler.cliutil import CliError, OneLineParser, check_writable, number, run_cli

from .actions import Schedule
from .catalog import SCHEDULES, build
from .comms import add_communication
from .costs import Costs
from .memory import peak_in_flight
from .placement import stage_to_rank
from .render import render
from .simulate import Timeline, simulate
from .tables import load_csv, save_csv
from .trace import save_trace

__all__ = ["main"]

PROG = "python -m pipedream_ft.schedules"
_COUNT = number("count", integer=True, low=1)


def _costs(text: str) -> tuple[float, float, float]:
    try:
        f, i, w = (float(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--costs takes F,I,W (three numbers), got {text!r}") from None
    if not all(math.isfinite(c) and c >= 0 for c in (f, i, w)):
        raise argparse.ArgumentTypeError(f"--costs must be finite and >= 0, got {text!r}")
    return f, i, w


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Draw, time and rank pipeline schedules without running them.")
    p.add_argument("schedule", metavar="NAME|all|TABLE.csv",
                   help=f"one of {', '.join(SCHEDULES)}; all of them; or a CSV table (one row per rank)")
    p.add_argument("--ranks", type=_COUNT, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", type=_COUNT, default=8, help="microbatches per step (default 8)")
    p.add_argument("--stages-per-rank", type=_COUNT,
                   help="stages per rank (the looped schedules: default 2; with 'all', only they use it)")
    p.add_argument("--costs", type=_costs, default=(1.0, 1.0, 1.0), metavar="F,I,W",
                   help="one rank's forward, input-gradient and weight-gradient time per microbatch")
    p.add_argument("--latency", type=number("--latency", low=0.0), default=0.0, help="message latency")
    p.add_argument("--overhead", type=number("--overhead", low=0.0), default=0.0,
                   help="the runtime's own cost per compute action (F, B, I, W)")
    p.add_argument("--messages", action="store_true", help="add the sends and receives (drawn as nothing)")
    p.add_argument("--csv", metavar="OUT.csv", help="write the schedule's table")
    p.add_argument("--trace", metavar="OUT.json", help="write a trace for pipedream-timeline")
    p.add_argument("--ms-per-unit", type=number("--ms-per-unit", low=0), default=1.0,
                   help="milliseconds per cost unit in the trace (default 1)")
    return p


def _time(schedule: Schedule, placement: dict[int, int], args: argparse.Namespace) -> Timeline:
    per_rank = max(1, len(placement) // max(1, len(set(placement.values()))))
    f, i, w = (c / per_rank for c in args.costs)
    costs = Costs.uniform(len(placement), f, i, w, latency=args.latency, overhead=args.overhead)
    return simulate(schedule, costs, placement)


def _summary(t: Timeline, schedule: Schedule, placement: dict[int, int]) -> str:
    per_rank = max(1, len(placement) // max(1, len(set(placement.values()))))
    peak = peak_in_flight(schedule)
    held = {r: sum(peak.get(s, 0) for s, rr in placement.items() if rr == r) / per_rank
            for r in set(placement.values())}
    return (f"step {t.step_time:g}, bubble {100 * t.bubble_fraction:.1f}%, activations held at most "
            f"{max(held.values(), default=0):g} microbatches of a rank's share")


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    for out in (args.csv, args.trace):
        if out is not None:
            check_writable(Path(out))
    try:
        if args.schedule == "all":
            rows = []
            for name in SCHEDULES:
                try:
                    sched, placement = build(name, args.ranks, args.microbatches,
                                             args.stages_per_rank if name in _LOOPED else None)
                except ValueError as e:
                    rows.append((float("inf"), f"{name:<24} cannot run: {e}"))
                    continue
                t = _time(sched, placement, args)
                rows.append((t.step_time, f"{name:<24} {_summary(t, sched, placement)}"))
            print("\n".join(line for _, line in sorted(rows, key=lambda r: r[0])))
            return 0
        if args.schedule in SCHEDULES:
            sched, placement = build(args.schedule, args.ranks, args.microbatches, args.stages_per_rank)
        elif args.schedule.endswith(".csv"):
            table = load_csv(args.schedule)
            sched, placement = table, stage_to_rank(table)
        else:
            raise CliError(f"unknown schedule {args.schedule!r}: expected one of {', '.join(SCHEDULES)}, all, "
                           f"or a .csv table")
        if args.messages:
            sched = add_communication(sched, placement)
        t = _time(sched, placement, args)
    except (ValueError, OSError) as e:  # ScheduleError is a ValueError
        raise CliError(str(e)) from None
    print(render(t))
    print(_summary(t, sched, placement))
    if args.csv:
        save_csv(sched, args.csv)
    if args.trace:
        save_trace(t, args.trace, seconds_per_unit=args.ms_per_unit / 1000)
    return 0


_LOOPED = ("interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 on an error)."""
    return run_cli(PROG, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
