"""``goodput``: devices go where the predicted gain per device is largest, from each job's planned curve.

A job's value on ``n`` devices is its speedup over its smallest size, weighted by the time its *remaining work*
would take on that size: ``rate(n) / rate(min) x (rate(min) / remaining) ** remaining_exponent``. With exponent
1 that is the fraction of the remaining work done per second (shortest remaining time first, best for the
average JCT, worst for long jobs and the makespan); with 0 it is the plain speedup (no job-size knowledge). The
default, 0.25, was chosen by a sweep on the shared Philly workloads (see ``docs/pool.md``): nearer completions
count more, long jobs still get the devices they use well. The policy uses the remaining work.

Changing a started job's size (or resuming it) costs ``resize_cost`` seconds of no progress, so that size is
valued as if its rate were ``remaining / (resize_cost + remaining / rate(n))``: a running job grows only when
the time its rest takes shrinks by more than the resize cost, and is shrunk or preempted only when its devices
are worth more elsewhere by the same measure.

Dealing: first every job (best value per device first) gets its smallest size (or keeps the size it runs at)
while they fit, so no job waits while another grows (``admit_first``); then devices are dealt greedily by the
largest value gained per device added. A step may skip sizes, so a curve that is not concave is followed along
its upper hull; a job whose pipeline stops scaling at 6 workers never gets 16, and a size that gains nothing
is left free.

Starvation: a job that has waited ``starve_s`` seconds (since it arrived or was preempted) is given its
smallest size before anything else is dealt, taking devices from jobs above their minimum.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from ..errors import PoolError
from ..job import JobView
from ..policy import order_key

__all__ = ["Goodput"]


class Goodput:
    def __init__(self, resize_cost: float = 30.0, starve_s: float = 3 * 3600.0, remaining_exponent: float = 0.25,
                 admit_first: bool = True) -> None:
        if not resize_cost >= 0:
            raise PoolError(f"goodput: resize_cost must be >= 0 s, got {resize_cost}")
        if not starve_s > 0:
            raise PoolError(f"goodput: starve_s must be > 0 s, got {starve_s}")
        if not 0 <= remaining_exponent <= 1:
            raise PoolError(f"goodput: remaining_exponent must be in [0, 1], got {remaining_exponent}")
        self.resize_cost = float(resize_cost)
        self.starve_s = float(starve_s)
        self.remaining_exponent = float(remaining_exponent)
        self.admit_first = admit_first

    def value(self, j: JobView, n: int) -> float:
        """The job's value on ``n`` devices (0 for 0), the resize cost included where ``n`` changes its size."""
        if n == 0:
            return 0.0
        rate = j.throughput[n]
        rem = max(j.remaining, 1e-12)
        if n != j.allocation and (j.allocation or j.started):
            rate = rem / (self.resize_cost + rem / rate)
        base = j.throughput[j.sizes[0]]
        return rate / base * (base / rem) ** self.remaining_exponent

    def _best_step(self, j: JobView, n: int, free: int) -> tuple[float, int] | None:
        base = self.value(j, n)
        best: tuple[float, int] | None = None
        for s in j.sizes:
            if s <= n:
                continue
            if s - n > free:
                break
            gain = (self.value(j, s) - base) / (s - n)
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, s)
        return best

    def allocate(self, now: float, jobs: Sequence[JobView], devices: int) -> dict[str, int]:
        alloc = {j.name: 0 for j in jobs}
        free = devices
        starving = sorted((j for j in jobs if not j.allocation and now - j.since >= self.starve_s),
                          key=lambda j: (j.since, *order_key(j)))
        for j in starving:
            if j.sizes[0] <= free:
                alloc[j.name] = j.sizes[0]
                free -= j.sizes[0]
        if self.admit_first:
            def first(j: JobView) -> int:
                return j.allocation or j.sizes[0]

            for j in sorted(jobs, key=lambda j: (-self.value(j, first(j)) / first(j), *order_key(j))):
                if not alloc[j.name] and first(j) <= free:
                    alloc[j.name] = first(j)
                    free -= first(j)
        rank = {j.name: k for k, j in enumerate(sorted(jobs, key=order_key))}
        by_rank = {rank[j.name]: j for j in jobs}
        heap: list[tuple[float, int, int, int]] = []

        def push(j: JobView) -> None:
            step = self._best_step(j, alloc[j.name], free)
            if step is not None:
                heapq.heappush(heap, (-step[0], rank[j.name], alloc[j.name], step[1]))

        for j in jobs:
            push(j)
        while heap and free > 0:
            _, r, frm, to = heapq.heappop(heap)
            j = by_rank[r]
            if alloc[j.name] != frm:
                continue  # stale: the job has moved since
            if to - frm > free:
                push(j)  # the step no longer fits: the best one that does
                continue
            alloc[j.name] = to
            free -= to - frm
            push(j)
        return {k: v for k, v in alloc.items() if v}
