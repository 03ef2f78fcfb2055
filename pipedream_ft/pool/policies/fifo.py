"""``fifo``: in arrival order, each job at its requested size, never preempted."""

from __future__ import annotations

from typing import Sequence

from ..job import JobView
from ..policy import order_key

__all__ = ["Fifo"]


class Fifo:
    """Jobs start in arrival order at their requested ``workers``; a job waits until that many are free.

    Running jobs keep what they hold (after a switch from an elastic policy, their current size). Without
    ``backfill`` nothing starts past a head that does not fit; with it, later jobs that fit start.
    """

    def __init__(self, backfill: bool = False) -> None:
        self.backfill = backfill

    def allocate(self, now: float, jobs: Sequence[JobView], devices: int) -> dict[str, int]:
        alloc = {j.name: j.allocation for j in jobs if j.allocation}
        free = devices - sum(alloc.values())
        for j in sorted((j for j in jobs if not j.allocation), key=order_key):
            if j.workers <= free:
                alloc[j.name] = j.workers
                free -= j.workers
            elif not self.backfill:
                break
        return alloc
