"""A job in the pool, and the read-only view of it that policies decide from."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from .errors import PoolError

__all__ = ["Job", "JobView"]


@dataclass(frozen=True)
class Job:
    """A training job as submitted: ``workers`` requested, elastic between ``min_workers`` and ``max_workers``.

    ``duration`` is how long it runs on ``workers`` devices; its amount of work (minibatches) is ``duration x
    throughput(model, workers)``. ``min_workers``/``max_workers`` of None mean "not given": rigid policies use
    ``workers``, elastic ones may give the job any size from 1 to the pool's.
    """

    name: str
    arrival: float
    model: str
    workers: int
    duration: float
    min_workers: int | None = None
    max_workers: int | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise PoolError("a job needs a name")
        if not self.arrival >= 0:
            raise PoolError(f"job {self.name}: arrival must be >= 0, got {self.arrival}")
        if not self.duration > 0:
            raise PoolError(f"job {self.name}: duration must be > 0, got {self.duration}")
        if self.workers < 1:
            raise PoolError(f"job {self.name}: workers must be >= 1, got {self.workers}")
        if self.min_workers is not None and not 1 <= self.min_workers <= self.workers:
            raise PoolError(f"job {self.name}: min_workers {self.min_workers} must be >= 1 and <= workers "
                            f"{self.workers}")
        if self.max_workers is not None and self.max_workers < self.workers:
            raise PoolError(f"job {self.name}: max_workers {self.max_workers} is below workers {self.workers}")

    @property
    def elastic_range(self) -> tuple[int | None, int | None]:
        """``(min_workers, max_workers)`` as given (None where absent)."""
        return self.min_workers, self.max_workers


@dataclass(frozen=True, eq=False)
class JobView:
    """What a policy sees of one job at a decision (immutable; the simulator and the service build these).

    ``allocation`` is the devices it holds now (0: waiting). ``since`` is when that state began: the start of
    its current run, or the arrival / the preemption that left it waiting. ``attained`` is the device-seconds it
    has held so far; ``remaining`` and ``work`` are minibatches. ``throughput`` maps every size the job may be
    given (within its elastic range, where a plan exists; ``workers`` always in it) to predicted minibatches per
    second; ``sizes`` lists those sizes ascending. ``started`` says whether it has ever run (resuming it then
    costs a resize).
    """

    name: str
    arrival: float
    workers: int
    min_workers: int
    max_workers: int
    priority: int
    allocation: int
    since: float
    attained: float
    remaining: float
    work: float
    started: bool
    throughput: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.throughput))

    @property
    def running(self) -> bool:
        return self.allocation > 0

    def rate(self, n: int) -> float:
        """Minibatches per second on ``n`` devices (0 for 0)."""
        return 0.0 if n == 0 else self.throughput[n]
