"""Benchmark of the plans of several stages per process: balanced across the processes, against the dynamic
program's plan of the slowest stage, both simulated by the same schedules.

Run: ``python benchmarks/bench_virtual_plan.py [--profiles DIR] [--workers 2 4 8] [--bandwidth 1e9 1e11]
[--gpt-layers 12] [--chain-layers 3000]``.

For each profile, number of processes ``W``, stages per process ``v`` and bandwidth, and for each placement
(looped: interleaved 1F1B's; the V: ZBV's), it plans ``W v`` straight stages twice — PipeDream's dynamic program
alone (the peer, what ``virtual_plan`` gave before) and balanced (``partitioner.schedule_choice.virtual_plan``) —
and prints the busiest process's compute per minibatch on each, and the schedule's time per minibatch as
``rank_virtual`` simulates it (``2 W v`` minibatches per step) on the program's plan and as ``rank_virtual`` ranks
it now (the faster of the two plans, named). ``gain`` is the peer's simulated time over ours (above 1: faster);
``plan s`` the wall time of planning the balanced plan.

Profiles: PipeDream's (``../shared/profiles/*.graph.txt``), the GPT example profiled on this machine's CPU
(``--gpt-layers``), and a chain of ``--chain-layers`` blocks with skip edges (the scalable chain path).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from partitioner.optimizer import partition  # noqa: E402
from partitioner.plan import PlanError  # noqa: E402
from partitioner.schedule_choice import rank_virtual, virtual_plan  # noqa: E402
from partitioner.balance import virtual_placement  # noqa: E402
from profiler import load_profile  # noqa: E402
from profiler.profile import Profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def busiest_ms(profile: Profile, plan, processes: list[int]) -> float:
    loads: dict[int, float] = {}
    for s, stage in enumerate(plan.stages):
        loads[processes[s]] = loads.get(processes[s], 0.0) + sum(
            profile.layers[i].forward_ms + profile.layers[i].backward_ms for i in stage.layers)
    return max(loads.values())


def rows(name: str, profile: Profile, workers: list[int], bandwidths: list[float]) -> list[float]:
    gains = []
    for bw in bandwidths:
        for w in workers:
            for v, schedule in ((2, "interleaved_1f1b"), (4, "interleaved_1f1b"), (2, "zbv")):
                where = virtual_placement(schedule, w, v)
                m = 2 * w * v
                try:
                    dp = partition(profile, w * v, bw, straight=True)
                except PlanError:
                    continue  # fewer cut points than stages
                t0 = time.perf_counter()
                balanced = virtual_plan(profile, w, v, bw, schedule=schedule)
                wall = time.perf_counter() - t0
                peer_t = rank_virtual(profile, w, m, bw, stages_per_worker=v, names=[schedule],
                                      plan=dp)[0].time_per_minibatch_s
                ranked = rank_virtual(profile, w, m, bw, stages_per_worker=v, names=[schedule])[0]
                ours_t = ranked.time_per_minibatch_s
                kept = "balanced" if ranked.plan == balanced else "program"
                gains.append(peer_t / ours_t)
                print(f"| {name} | {w} x {v} | {schedule} | {bw:.0e} | {busiest_ms(profile, dp, where):.2f} | "
                      f"{busiest_ms(profile, balanced, where):.2f} | {peer_t * 1e3:.2f} | {ours_t * 1e3:.2f} "
                      f"({kept}) | {peer_t / ours_t:.3f} | {wall:.2f} |", flush=True)
    return gains


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", type=Path, default=ROOT.parent / "shared" / "profiles")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--bandwidth", type=float, nargs="+", default=[1e9, 1e11])
    ap.add_argument("--gpt-layers", type=int, default=12, help="GPT example depth to profile (0: none)")
    ap.add_argument("--chain-layers", type=int, default=3000, help="skip-chain length (0: none)")
    args = ap.parse_args(argv)
    cases: list[tuple[str, Profile]] = []
    for path in sorted(args.profiles.glob("*.graph.txt")):
        cases.append((path.name.split(".")[0], load_profile(path)))
    if args.gpt_layers:
        from bench_partitioner import gpt_profile

        cases.append((f"gpt-{args.gpt_layers}", gpt_profile(args.gpt_layers)))
    if args.chain_layers:
        from bench_partitioner import skip_chain

        cases.append((f"chain-{args.chain_layers}", skip_chain(args.chain_layers)))
    print("| profile | W x v | schedule | bandwidth | busiest ms, program | busiest ms, balanced | simulated ms/mb, "
          "program | simulated ms/mb, ranked (plan kept) | gain | plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    gains: list[float] = []
    for name, profile in cases:
        gains += rows(name, profile, args.workers, args.bandwidth)
    if gains:
        print(f"\n{len(gains)} cases: gain (program / ranked, simulated) median {statistics.median(gains):.3f}, "
              f"min {min(gains):.3f}, max {max(gains):.3f}; {sum(g > 1.005 for g in gains)} faster by > 0.5 %, "
              f"{sum(g < 0.995 for g in gains)} slower by > 0.5 %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
