"""Training modes: each owns its schedule, its weight-version rule and its unit of work.

* :class:`Stash` (PipeDream, the default): asynchronous 1F1B with no flush. Stage ``s`` of an ``S``-stage
  straight pipeline runs the forward and the backward of minibatch ``b`` with its weights after
  ``max(0, b - (S - 1 - s))`` updates (weight stashing) and applies update ``b`` as soon as that backward is
  done. With replicated stages the rule counts update *rounds* (one per ``R`` minibatches on a stage with
  ``R`` replicas) and the in-flight depth ``ceil(sum(R[s:]) / R[s])``.
* :class:`Vertical`: like :class:`Stash`, but every stage uses the version stage 0 used for the minibatch
  (vertical sync); the version number travels with the activations.
* :class:`Flush`: 1F1B (or GPipe, or ZB-H1) inside windows of ``flush_every`` minibatches and one optimizer step
  on their mean gradient per window: synchronous minibatch SGD.
* :class:`TwoBW` (PipeDream-2BW): 1F1B with no flush, one optimizer step per window of ``m`` minibatches on
  their mean gradient; every stage runs the forward and backward of the minibatches of window ``k`` with its
  weights after ``max(0, k - 1)`` updates — one update behind, so at most two weight versions per stage.

Each mode names its :meth:`Mode.delay`: how many updates a stage's gradient is late by when it is applied,
which delay compensation (:mod:`pipedream_ft.pipeline.compensation`) works from.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar, Iterator

from partitioner.plan import PlanError

from ..schedules.comms import add_communication, iter_lower_rank, lower_rank, post_receives_early
from ..schedules.placement import Replicated
from ..schedules.window import ScheduleSpec, WindowSchedule, resolve_schedule
from ..schedules.actions import Action
from ..schedules.replicated import (SYNCHRONOUS, async_1f1b, double_buffered, in_flight, iter_async_1f1b,
                                   iter_double_buffered, iter_synchronous)
from .topology import Topology
from .versions import Version, VersionStore

__all__ = ["MODES", "Mode", "Stash", "Vertical", "Flush", "TwoBW", "make_mode"]

MODES = ("stash", "vertical", "flush", "2bw")


class Mode(ABC):
    """How a pipeline trains: which actions a rank runs and which weights each forward reads."""

    name: ClassVar[str]
    asynchronous: ClassVar[bool] = True
    """Updates follow every backward (no flush): gradients of one minibatch, not a window's sum."""
    tied_updates_together: ClassVar[bool] = False
    """Every holder of a tied parameter applies its update at once (else the first holder leads, see
    :mod:`~pipedream_ft.pipeline.tied`)."""

    def identity(self) -> dict[str, object]:
        """What a checkpoint's plan hash records of the mode: the training semantics it was written under."""
        return {"mode": self.name, "flush_every": None}

    def check(self, topo: Topology) -> None:
        """Raise :class:`PlanError` if this mode cannot run ``topo``'s plan."""

    @abstractmethod
    def schedule(self, topo: Topology, start: int, stop: int) -> list[Action]:
        """This rank's actions for minibatches ``[start, stop)``."""

    def lowered(self, topo: Topology, start: int, stop: int) -> list[Action]:
        """This rank's actions for minibatches ``[start, stop)`` with the sends and receives that connect them to
        its neighbours' (:func:`~pipedream_ft.schedules.add_communication` over every rank's :meth:`schedule`):
        the list the executor runs, in order, its receives moved as early as they are useful
        (:func:`~pipedream_ft.schedules.comms.post_receives_early`): a message never waits for its receive."""
        plan = topo.plan
        placement = Replicated.of([s.ranks for s in plan.stages])
        mine = lower_rank(topo.rank, self.schedule(topo, start, stop), placement)  # from this rank's list alone
        if mine is not None:
            return mine
        every = {r: self.schedule(topo if r == topo.rank else Topology.of(plan, r), start, stop)
                 for r in range(plan.world_size)}
        lowered = add_communication(every, placement)
        return post_receives_early({topo.rank: lowered[topo.rank]})[topo.rank]

    def iter_schedule(self, topo: Topology, start: int, stop: int) -> Iterator[Action]:
        """:meth:`schedule`, made as it is read."""
        return iter(self.schedule(topo, start, stop))

    def iter_lowered(self, topo: Topology, start: int, stop: int) -> Iterator[Action]:
        """:meth:`lowered`, made as it is run: a long run's list is never held whole, and a run that starts again
        after a recovery does not wait for the rest of it to be lowered first. Where each stage's order decides
        the receives, it is read from a few windows of the schedule and checked as the run goes
        (:func:`~pipedream_ft.schedules.comms.iter_lower_rank`)."""
        plan = topo.plan
        placement = Replicated.of([s.ranks for s in plan.stages])
        window = self.window(topo)
        sample = self.schedule(topo, start, min(stop, start + window * max(2, -(-64 // window))))
        mine = iter_lower_rank(topo.rank, self.iter_schedule(topo, start, stop), placement, sample)
        return mine if mine is not None else iter(self.lowered(topo, start, stop))

    def window(self, topo: Topology) -> int:
        """Runs of minibatches (and checkpoint cuts) must start and end on multiples of this."""
        return math.lcm(*topo.replicas)

    def update_unit(self, topo: Topology) -> int:
        """Minibatches per update on this rank's stage (per update round)."""
        return topo.replicas[topo.stage]

    @abstractmethod
    def versions_kept(self, topo: Topology) -> int:
        """Weight versions older than the current one that a forward may still ask for."""

    @abstractmethod
    def version_for(self, topo: Topology, versions: VersionStore, minibatch: int, tag: int) -> Version:
        """The weights minibatch ``minibatch``'s forward reads here; ``tag`` is the header's version tag."""

    def loss_scale(self) -> float:
        """Factor applied to each minibatch's loss before its backward."""
        return 1.0

    def tied_version(self, topo: Topology, first: int, minibatch: int) -> int | None:
        """The version of a tied parameter (whose first holder is stage ``first``) that ``minibatch``'s forward
        reads here: the rule of the first holder's own weights (``None``: the current one)."""
        round_ = minibatch // topo.replicas[first]
        return max(0, round_ - (in_flight(first, topo.replicas) - 1))

    def tied_kept(self, topo: Topology, first: int) -> int:
        """Versions of such a tied parameter older than the current one that a forward may still ask for."""
        return in_flight(first, topo.replicas) - 1

    @abstractmethod
    def delay(self, topo: Topology) -> int:
        """Updates between the weights this rank's gradients are computed on and the weights they are applied to:
        update ``u`` applies a gradient taken at version ``u - delay`` (in steady state)."""

    def __repr__(self) -> str:
        return self.name


class Stash(Mode):
    """PipeDream's weight stashing (see the module docstring)."""

    name = "stash"

    def schedule(self, topo: Topology, start: int, stop: int) -> list[Action]:
        return async_1f1b(topo.stage, topo.replica, topo.replicas, start, stop)

    def iter_schedule(self, topo: Topology, start: int, stop: int) -> Iterator[Action]:
        return iter_async_1f1b(topo.stage, topo.replica, topo.replicas, start, stop)

    def versions_kept(self, topo: Topology) -> int:
        return in_flight(topo.stage, topo.replicas) - 1

    def version_for(self, topo: Topology, versions: VersionStore, minibatch: int, tag: int) -> Version:
        round_ = minibatch // topo.replicas[topo.stage]
        return versions.get(max(0, round_ - (in_flight(topo.stage, topo.replicas) - 1)))

    def delay(self, topo: Topology) -> int:
        return in_flight(topo.stage, topo.replicas) - 1


class Vertical(Stash):
    """Every stage uses the weight version stage 0 used for the minibatch."""

    name = "vertical"

    def check(self, topo: Topology) -> None:
        if len(set(topo.replicas)) > 1:
            raise PlanError(f"vertical sync needs one replica count on every stage, the plan has {list(topo.replicas)}")

    def versions_kept(self, topo: Topology) -> int:
        return in_flight(0, topo.replicas) - 1

    def version_for(self, topo: Topology, versions: VersionStore, minibatch: int, tag: int) -> Version:
        if topo.is_first:
            return super().version_for(topo, versions, minibatch, tag)
        return versions.get(tag)

    def delay(self, topo: Topology) -> int:
        return in_flight(0, topo.replicas) - 1

    def tied_version(self, topo: Topology, first: int, minibatch: int) -> int | None:
        return super().tied_version(topo, 0, minibatch)

    def tied_kept(self, topo: Topology, first: int) -> int:
        return super().tied_kept(topo, 0)


class Flush(Mode):
    """1F1B inside windows of ``flush_every`` minibatches; one optimizer step per window."""

    name = "flush"
    asynchronous = False
    tied_updates_together = True

    def __init__(self, flush_every: int, schedule: ScheduleSpec = "1f1b") -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        order = resolve_schedule(schedule)
        if isinstance(order, WindowSchedule):
            order.check_window(flush_every)
        elif order not in SYNCHRONOUS:
            raise ValueError(f"schedule must be one of {SYNCHRONOUS}, a table's path or a mapping, got {order!r}")
        self.flush_every = flush_every
        self.order = order
        """The schedule inside a window: a name of :data:`~pipedream_ft.schedules.replicated.SYNCHRONOUS`, or one
        given as data (:class:`~pipedream_ft.schedules.WindowSchedule`)."""

    def check(self, topo: Topology) -> None:
        lcm = math.lcm(*topo.replicas)
        if self.flush_every % lcm:
            raise PlanError(f"flush_every {self.flush_every} must be a multiple of {lcm}, the least common "
                            f"multiple of the plan's replica counts {list(topo.replicas)}")
        if isinstance(self.order, WindowSchedule):
            why = self.order.check_plan(topo.replicas)
            if why is not None:
                raise PlanError(why)
        elif self.order != "1f1b" and any(r != 1 for r in topo.replicas):
            raise PlanError(f"schedule {self.order!r} runs a straight pipeline; the plan replicates stages "
                            f"{[s for s, r in enumerate(topo.replicas) if r != 1]} (schedule '1f1b' runs it)")

    def identity(self) -> dict[str, object]:
        # the schedule is left out: every one gives the same minibatch SGD, so a run may resume under another
        return {"mode": self.name, "flush_every": self.flush_every}

    def schedule(self, topo: Topology, start: int, stop: int) -> list[Action]:
        return list(self.iter_schedule(topo, start, stop))

    def iter_schedule(self, topo: Topology, start: int, stop: int) -> Iterator[Action]:
        if isinstance(self.order, WindowSchedule):
            return self.order.iter_actions(topo.stage, start, stop)
        return iter_synchronous(self.order, topo.stage, topo.replica, topo.replicas, start, stop, self.flush_every)

    def window(self, topo: Topology) -> int:
        return math.lcm(super().window(topo), self.flush_every)

    def update_unit(self, topo: Topology) -> int:
        return self.flush_every

    def versions_kept(self, topo: Topology) -> int:
        return 0

    def version_for(self, topo: Topology, versions: VersionStore, minibatch: int, tag: int) -> Version:
        return versions.current

    def loss_scale(self) -> float:
        return 1.0 / self.flush_every

    def delay(self, topo: Topology) -> int:
        return 0

    def tied_version(self, topo: Topology, first: int, minibatch: int) -> int | None:
        return None

    def tied_kept(self, topo: Topology, first: int) -> int:
        return 0

    def __repr__(self) -> str:
        return f"flush(every {self.flush_every}, {self.order})"


class TwoBW(Mode):
    """PipeDream-2BW: double-buffered weights, gradients coalesced over windows of ``every`` minibatches.

    The schedule is PipeDream's 1F1B without a flush; a stage takes its update ``k`` — the mean gradient of
    window ``k`` (minibatches ``[k m, (k + 1) m)``) — right after its last backward of that window. Every
    stage runs the forward and the backward of a minibatch of window ``k`` with its weights after
    ``max(0, k - 1)`` updates, so update ``k`` applies a gradient taken one update behind:
    ``W(k + 1) = W(k) - lr * grad(W(k - 1))``. A stage keeps at most two versions (the current one and the one
    before it), whatever its depth; the whole pipeline reads one consistent version per minibatch.

    ``every`` (``m``) defaults to the number of stages (the paper's choice). The pipeline never waits for a
    version as long as ``m`` is at least the in-flight depth of every stage minus one, in minibatches (``S - 1``
    for a straight pipeline of ``S`` stages); :meth:`check` refuses a smaller one, and an ``m`` that is not a
    multiple of every stage's replica count.

    **Checkpoint cuts** fall on window boundaries (:meth:`window` is a multiple of ``m``, like flush's): at a cut
    every update of the windows before it is applied and no gradient is pending; the checkpoint holds the current
    version and the one before it (which the next window's forwards read), so a resumed run continues exactly.
    Gradient clipping takes the window's global norm, as in flush mode (the window's gradient of the whole model
    at one version exists at each update).
    """

    name = "2bw"
    asynchronous = False  # gradients are a window's sum, not one minibatch's

    def __init__(self, every: int | None = None) -> None:
        if every is not None and every < 1:
            raise ValueError(f"the 2bw update interval must be >= 1, got {every}")
        self.every = every
        self._checked: int | None = None
        """The interval of the topology last checked (its loss scale)."""

    def interval(self, topo: Topology) -> int:
        """``m``: minibatches per update (default: the number of stages)."""
        return self.every if self.every is not None else topo.num_stages

    def check(self, topo: Topology) -> None:
        m = self.interval(topo)
        lcm = math.lcm(*topo.replicas)
        if m % lcm:
            raise PlanError(f"the 2bw update interval {m} must be a multiple of {lcm}, the least common multiple "
                            f"of the plan's replica counts {list(topo.replicas)}")
        for s, r in enumerate(topo.replicas):
            depth = in_flight(s, topo.replicas)
            if m // r < depth - 1:
                raise PlanError(f"the 2bw update interval {m} is too short for stage {s}: its {r} replica(s) keep "
                                f"{depth} minibatches each in flight, so the interval must be at least "
                                f"{(depth - 1) * r}")
        self._checked = m

    def schedule(self, topo: Topology, start: int, stop: int) -> list[Action]:
        return double_buffered(topo.stage, topo.replica, topo.replicas, start, stop, self.interval(topo))

    def iter_schedule(self, topo: Topology, start: int, stop: int) -> Iterator[Action]:
        return iter_double_buffered(topo.stage, topo.replica, topo.replicas, start, stop, self.interval(topo))

    def window(self, topo: Topology) -> int:
        return math.lcm(super().window(topo), self.interval(topo))

    def update_unit(self, topo: Topology) -> int:
        return self.interval(topo)

    def versions_kept(self, topo: Topology) -> int:
        return 1

    def version_for(self, topo: Topology, versions: VersionStore, minibatch: int, tag: int) -> Version:
        return versions.get(max(0, minibatch // self.interval(topo) - 1))

    def loss_scale(self) -> float:
        m = self.every if self.every is not None else self._checked
        if m is None:
            raise RuntimeError("2bw's default interval is the number of stages: check(topo) comes first")
        return 1.0 / m

    def delay(self, topo: Topology) -> int:
        return 1

    def tied_version(self, topo: Topology, first: int, minibatch: int) -> int | None:
        return max(0, minibatch // self.interval(topo) - 1)

    def tied_kept(self, topo: Topology, first: int) -> int:
        return 1

    def __repr__(self) -> str:
        return f"2bw(every {self.every if self.every is not None else 'stage count'})"


def make_mode(name: str, flush_every: int = 4, update_every: int | None = None,
              schedule: ScheduleSpec = "1f1b") -> Mode:
    """The mode called ``name`` (one of :data:`MODES`); ``update_every`` is 2bw's update interval (default: the
    number of stages); ``schedule`` the flush mode's schedule inside a window."""
    if name == "stash":
        return Stash()
    if name == "vertical":
        return Vertical()
    if name == "flush":
        return Flush(flush_every, schedule)
    if name == "2bw":
        return TwoBW(update_every)
    raise ValueError(f"mode must be one of {MODES}, got {name!r}")
