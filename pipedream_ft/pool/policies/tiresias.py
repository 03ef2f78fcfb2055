"""``tiresias``: discretised two-dimensional least attained service (Gu et al., NSDI'19), rigid sizes.

A job's attained service is the device-seconds it has held (size x time: the two dimensions). Jobs sit in
queues by thresholds on it (default 3,200 and 32,000 device-seconds, as in Tiresias's own evaluation: a lower
queue holds jobs that received more); queues are served in order, each in arrival order, placing every job that
fits (skipping those that do not); a running job that no longer has a place is preempted. A job left waiting
longer than ``promote_knob`` x the time it has run is promoted to the first queue (starvation promotion).
The job size and the remaining work are not used: Tiresias assumes them unknown.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import PoolError
from ..job import JobView

__all__ = ["Tiresias"]


class Tiresias:
    def __init__(self, thresholds: Sequence[float] = (3200.0, 32000.0), promote_knob: float = 8.0) -> None:
        if any(not t > 0 for t in thresholds) or list(thresholds) != sorted(thresholds):
            raise PoolError(f"tiresias: thresholds must be positive and ascending, got {list(thresholds)}")
        if not promote_knob > 0:
            raise PoolError(f"tiresias: promote_knob must be > 0, got {promote_knob}")
        self.thresholds = tuple(float(t) for t in thresholds)
        self.promote_knob = float(promote_knob)

    def queue(self, now: float, j: JobView) -> int:
        """The job's queue: 0 is served first."""
        if not j.allocation and j.attained > 0:
            ran = j.attained / max(j.workers, 1)
            if now - j.since >= self.promote_knob * ran:
                return 0
        return sum(j.attained >= t for t in self.thresholds)

    def allocate(self, now: float, jobs: Sequence[JobView], devices: int) -> dict[str, int]:
        # running jobs first within a queue and arrival: keeps a job running rather than swapping equals
        order = sorted(jobs, key=lambda j: (self.queue(now, j), -j.priority, j.arrival, j.name))
        alloc: dict[str, int] = {}
        free = devices
        for j in order:
            size = j.allocation or j.workers
            if size <= free:
                alloc[j.name] = size
                free -= size
        return alloc
