"""Training modes: each owns its schedule, its weight-version rule and its unit of work.

* :class:`Stash` (PipeDream, the default): asynchronous 1F1B with no flush. Stage ``s`` of an ``S``-stage
  straight pipeline runs the forward and the backward of minibatch ``b`` with its weights after
  ``max(0, b - (S - 1 - s))`` updates (weight stashing) and applies update ``b`` as soon as that backward is
  done. With replicated stages the rule counts update *rounds* (one per ``R`` minibatches on a stage with
  ``R`` replicas) and the in-flight depth ``ceil(sum(R[s:]) / R[s])``.
* :class:`Vertical`: like :class:`Stash`, but every stage uses the version stage 0 used for the minibatch
  (vertical sync); the version number travels with the activations.
* :class:`Flush`: 1F1B inside windows of ``flush_every`` minibatches and one optimizer step on their mean
  gradient per window: synchronous minibatch SGD.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

from partitioner.plan import PlanError

from .schedule import Action, flushing, in_flight, one_f_one_b
from .topology import Topology
from .versions import Version, VersionStore

__all__ = ["MODES", "Mode", "Stash", "Vertical", "Flush", "make_mode"]

MODES = ("stash", "vertical", "flush")


class Mode(ABC):
    """How a pipeline trains: which actions a rank runs and which weights each forward reads."""

    name: ClassVar[str]
    asynchronous: ClassVar[bool] = True
    """Updates follow every backward (no flush): gradients of one minibatch, not a window's sum."""

    def check(self, topo: Topology) -> None:
        """Raise :class:`PlanError` if this mode cannot run ``topo``'s plan."""

    @abstractmethod
    def schedule(self, topo: Topology, start: int, stop: int) -> list[Action]:
        """This rank's actions for minibatches ``[start, stop)``."""

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

    def __repr__(self) -> str:
        return self.name


class Stash(Mode):
    """PipeDream's weight stashing (see the module docstring)."""

    name = "stash"

    def schedule(self, topo: Topology, start: int, stop: int) -> list[Action]:
        return one_f_one_b(topo.stage, topo.replica, topo.replicas, start, stop)

    def versions_kept(self, topo: Topology) -> int:
        return in_flight(topo.stage, topo.replicas) - 1

    def version_for(self, topo: Topology, versions: VersionStore, minibatch: int, tag: int) -> Version:
        round_ = minibatch // topo.replicas[topo.stage]
        return versions.get(max(0, round_ - (in_flight(topo.stage, topo.replicas) - 1)))


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


class Flush(Mode):
    """1F1B inside windows of ``flush_every`` minibatches; one optimizer step per window."""

    name = "flush"
    asynchronous = False

    def __init__(self, flush_every: int) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.flush_every = flush_every

    def check(self, topo: Topology) -> None:
        lcm = math.lcm(*topo.replicas)
        if self.flush_every % lcm:
            raise PlanError(f"flush_every {self.flush_every} must be a multiple of {lcm}, the least common "
                            f"multiple of the plan's replica counts {list(topo.replicas)}")

    def schedule(self, topo: Topology, start: int, stop: int) -> list[Action]:
        return flushing(topo.stage, topo.replica, topo.replicas, start, stop, self.flush_every)

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

    def __repr__(self) -> str:
        return f"flush(every {self.flush_every})"


def make_mode(name: str, flush_every: int = 4) -> Mode:
    """The mode called ``name`` (one of :data:`MODES`)."""
    if name == "stash":
        return Stash()
    if name == "vertical":
        return Vertical()
    if name == "flush":
        return Flush(flush_every)
    raise ValueError(f"mode must be one of {MODES}, got {name!r}")
