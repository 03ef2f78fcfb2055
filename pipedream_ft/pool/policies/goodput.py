"""``goodput``: devices go where the predicted gain per device is largest, from each job's planned curve.

A job's value at ``n`` devices is the fraction of its *remaining work* it completes per second,
``rate(n) / remaining`` (so jobs of any size and speed compare, and nearer completions count more: the
policy uses the remaining work). Changing a started job's size (or resuming it) costs ``resize_cost`` seconds
of no progress, so that size is valued ``1 / (resize_cost + remaining / rate(n))`` instead: a running job grows
only when the time its rest takes shrinks by more than the resize cost, and it is shrunk or preempted only when
its devices are worth more elsewhere by the same measure. Devices are dealt greedily by the largest value gained
per device added (a step may skip sizes, so a curve that is not concave is followed along its upper hull), so a
job whose pipeline stops scaling at 6 workers never gets 16 and a non-scaling size is left free.

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
    def __init__(self, resize_cost: float = 30.0, starve_s: float = 3 * 3600.0) -> None:
        if not resize_cost >= 0:
            raise PoolError(f"goodput: resize_cost must be >= 0 s, got {resize_cost}")
        if not starve_s > 0:
            raise PoolError(f"goodput: starve_s must be > 0 s, got {starve_s}")
        self.resize_cost = float(resize_cost)
        self.starve_s = float(starve_s)

    def value(self, j: JobView, n: int) -> float:
        """Fraction of the job's remaining work done per second on ``n`` devices, resize cost included."""
        if n == 0:
            return 0.0
        rate = j.throughput[n]
        rem = max(j.remaining, 1e-12)
        if n == j.allocation or (not j.allocation and not j.started):
            return rate / rem
        return 1.0 / (self.resize_cost + rem / rate)

    def _best_step(self, j: JobView, n: int, free: int, sizes: tuple[int, ...]) -> tuple[float, int] | None:
        base = self.value(j, n)
        best: tuple[float, int] | None = None
        for s in sizes:
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
        sizes = {j.name: j.sizes for j in jobs}
        rank = {j.name: k for k, j in enumerate(sorted(jobs, key=order_key))}
        heap: list[tuple[float, int, int, int]] = []
        by_rank = {rank[j.name]: j for j in jobs}

        def push(j: JobView) -> None:
            step = self._best_step(j, alloc[j.name], free, sizes[j.name])
            if step is not None:
                heapq.heappush(heap, (-step[0], rank[j.name], alloc[j.name], step[1]))

        for j in jobs:
            push(j)
        while heap and free > 0:
            _, r, frm, to = heapq.heappop(heap)
            j = by_rank[r]
            if alloc[j.name] != frm or to - frm > free:
                if alloc[j.name] == frm:
                    push(j)  # the step no longer fits: the best one that does
                continue
            alloc[j.name] = to
            free -= to - frm
            push(j)
        return {k: v for k, v in alloc.items() if v}
