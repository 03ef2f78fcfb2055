"""``round-robin``: time slices of ``quantum`` seconds among jobs that do not all fit (rigid sizes)."""

from __future__ import annotations

from typing import Sequence

from ..errors import PoolError
from ..job import JobView
from ..policy import order_key

__all__ = ["RoundRobin"]


class RoundRobin:
    """A running job whose slice (``now - since``) has reached ``quantum`` goes to the back of the queue; the
    queue (waiting jobs by the time they started waiting, then the expired ones by when their slice began) is
    served in order at requested sizes while they fit. An expired job that is served again keeps running (no
    preemption when everything fits); one that is not is preempted (a checkpoint; resuming costs a resize)."""

    def __init__(self, quantum: float = 600.0) -> None:
        if not quantum > 0:
            raise PoolError(f"round-robin: quantum must be > 0 s, got {quantum}")
        self.quantum = float(quantum)

    def allocate(self, now: float, jobs: Sequence[JobView], devices: int) -> dict[str, int]:
        expired = [j for j in jobs if j.allocation and now - j.since >= self.quantum - 1e-9]
        keep = {j.name: j.allocation for j in jobs if j.allocation and j not in expired}
        free = devices - sum(keep.values())
        waiting = sorted((j for j in jobs if not j.allocation), key=lambda j: (j.since, *order_key(j)))
        queue = waiting + sorted(expired, key=lambda j: (j.since, *order_key(j)))
        for j in queue:
            size = j.allocation or j.workers
            if size > free:
                break
            keep[j.name] = size
            free -= size
        return keep
