"""Benchmark of lowering a run: the list each process runs, made before the run's first forward.

Run: ``python benchmarks/bench_lowering.py [--minibatches 1024] [--repeats 5]``.

Each process lowers its own list (``schedules.comms.lower_rank``, from its own actions), with the sends, the
receives and the receives moved early; ``PipelineTrainer.train(data, n)`` makes it as it runs
(``iter_lower_rank``: the run's list is never held whole). The peer is the pass over every rank's list that gives
the same lists (``add_communication`` then ``post_receives_early``, torch.distributed.pipelining's way of
lowering), run for the same process. For each mode or schedule it prints the microseconds per minibatch of making
the rank's compute list (``schedule``, in both), of ours whole (compute list included), of ours as the run reads
it, and of the peer, the median over repeats and the mean over the ranks, and ``peer/ours`` (whole). The lists are
checked equal first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner.plan import Plan  # noqa: E402
from pipedream_ft.pipeline.modes import make_mode  # noqa: E402
from pipedream_ft.pipeline.topology import Topology  # noqa: E402
from pipedream_ft.schedules.comms import add_communication, post_receives_early  # noqa: E402
from pipedream_ft.schedules.placement import Replicated  # noqa: E402
from pipedream_ft.virtual import iter_process_actions, process_actions, virtual_layout  # noqa: E402

__all__ = ["main"]


def _plan(replicas: list[int]) -> Plan:
    n = len(replicas)
    return Plan.from_stages([[i] for i in range(n)], replicas, profile_hash="bench",
                            layer_names=[f"layer{i}" for i in range(n)])


def _median_us(fn: Callable[[], object], repeats: int, minibatches: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times) / minibatches


def _drain(it: object) -> None:
    for _ in it:  # type: ignore[attr-defined]
        pass


def mode_case(mode: str, replicas: list[int], n: int, repeats: int) -> tuple[float, ...]:
    plan = _plan(replicas)
    m = make_mode(mode, 8, update_every=8 if mode == "2bw" else None)
    topos = [Topology.of(plan, r) for r in range(plan.world_size)]
    placement = Replicated.of([s.ranks for s in plan.stages])
    rows = []
    for t in topos:
        def whole(t: Topology = t) -> list:
            every = {u.rank: m.schedule(u, 0, n) for u in topos}
            return post_receives_early({t.rank: add_communication(every, placement)[t.rank]})[t.rank]

        if not m.lowered(t, 0, n) == list(m.iter_lowered(t, 0, n)) == whole():
            raise SystemExit(f"{mode} {replicas}: rank {t.rank}'s lists differ")
        rows.append((_median_us(lambda t=t: m.schedule(t, 0, n), repeats, n),
                     _median_us(lambda t=t: m.lowered(t, 0, n), repeats, n),
                     _median_us(lambda t=t: _drain(m.iter_lowered(t, 0, n)), repeats, n),
                     _median_us(whole, repeats, n)))
    return tuple(statistics.mean(r[i] for r in rows) for i in range(4))


def virtual_case(schedule: str, processes: int, stages: int, n: int, repeats: int) -> tuple[float, ...]:
    layout = virtual_layout(schedule, _plan([1] * stages), processes, 2 * processes)
    assert layout is not None
    placement = dict(enumerate(layout.placement))
    rows = []
    for r in range(processes):
        def whole(r: int = r) -> list:
            every = {q: layout.rank_actions(q, 0, n) for q in range(processes)}
            return post_receives_early({r: add_communication(every, placement)[r]})[r]

        if not process_actions(layout, r, 0, n) == list(iter_process_actions(layout, r, 0, n)) == whole():
            raise SystemExit(f"{schedule}: process {r}'s lists differ")
        rows.append((_median_us(lambda r=r: layout.rank_actions(r, 0, n), repeats, n),
                     _median_us(lambda r=r: process_actions(layout, r, 0, n), repeats, n),
                     _median_us(lambda r=r: _drain(iter_process_actions(layout, r, 0, n)), repeats, n),
                     _median_us(whole, repeats, n)))
    return tuple(statistics.mean(r[i] for r in rows) for i in range(4))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minibatches", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    n = a.minibatches
    cases: list[tuple[str, Callable[[], tuple[float, ...]]]] = []
    for mode in ("stash", "vertical", "flush", "2bw"):
        for replicas in ([1, 1, 1, 1], [2, 1, 1, 1]):
            if mode == "vertical" and len(set(replicas)) > 1:
                continue
            cases.append((f"{mode} {replicas}", lambda m=mode, r=replicas: mode_case(m, r, n, a.repeats)))
    for schedule in ("interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"):
        cases.append((f"{schedule} 2x2", lambda s=schedule: virtual_case(s, 2, 4, n, a.repeats)))
    print(f"lowering {n} minibatches, µs per minibatch (median of {a.repeats}, mean over ranks)")
    print(f"{'case':<30} {'schedule':>9} {'ours':>8} {'as run':>8} {'peer':>8} {'peer/ours':>10}")
    for name, run in cases:
        sched, ours, lazily, peer = run()
        print(f"{name:<30} {sched:>9.1f} {ours:>8.1f} {lazily:>8.1f} {peer:>8.1f} {peer / ours:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
