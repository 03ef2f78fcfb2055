"""A shared pool of devices for many elastic pipeline jobs: scheduling policies and a cluster simulator.

Torch-free (like :mod:`partitioner`): a job's speed on ``n`` workers is the partitioner's predicted time per
minibatch of its best plan (:mod:`.throughput`, planned once per model and size and cached on disk).

The policy interface, shared by the simulator here and by a service that runs real processes::

    class MyPolicy:
        def allocate(self, now: float, jobs: Sequence[JobView], devices: int) -> dict[str, int]:
            ...

``jobs`` are every job that has arrived and not finished, as frozen :class:`JobView` s (allocation held now,
``since`` when that state began, attained device-seconds, remaining and total work in minibatches, the
predicted ``throughput`` at every size it may be given); ``devices`` is the pool's size (free ones are
``devices`` minus the allocations). The answer is the desired ``{name: workers}`` (0 or absent: not running);
the caller resizes, starts and preempts jobs to match, charging the resize cost. Policies are deterministic
and keep no state the views do not give back, so one may be swapped for another between two rounds and start
from the current allocation. Built in (:data:`POLICIES`): ``fifo`` (``backfill=``), ``elastic-fifo``,
``round-robin`` (``quantum=``), ``tiresias`` and ``goodput`` (``resize_cost=``, ``starve_s=``); a user's own
by import path ``package.module:ClassName`` (:func:`make_policy`). ``goodput`` uses the remaining work; the
others do not.
"""

from .errors import PoolError
from .job import Job, JobView
from .policy import POLICIES, Policy, check_allocation, make_policy
from .simulator import JobRecord, PolicyResult, simulate
from .throughput import PlanSettings, ThroughputModel
from .workload import find_profiles, read_workload

__all__ = [
    "POLICIES",
    "Job",
    "JobRecord",
    "JobView",
    "PlanSettings",
    "Policy",
    "PolicyResult",
    "PoolError",
    "ThroughputModel",
    "check_allocation",
    "find_profiles",
    "make_policy",
    "read_workload",
    "simulate",
]
