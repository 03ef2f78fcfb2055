"""Where a rank sits in a plan: its stage, its replica, and the ranks it exchanges minibatches with.

Pure data, built from a :class:`~partitioner.plan.Plan` and a rank, rebuilt whenever the plan changes (an
elastic resize). Minibatch ``b`` runs on replica ``b % R`` of a stage with ``R`` replicas, so two neighbouring
stages with ``R`` and ``R'`` replicas pair their replicas modulo ``gcd(R, R')``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from partitioner.plan import Plan

__all__ = ["Topology"]


@dataclass(frozen=True, slots=True)
class Topology:
    """This rank's place in ``plan``."""

    plan: Plan
    rank: int
    stage: int
    """Index of this rank's stage."""
    replica: int
    """Index of this rank among its stage's replicas."""
    _replicas: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """The replica counts, read once: the executor asks for them several times per minibatch."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_replicas", tuple(s.replicas for s in self.plan.stages))

    @staticmethod
    def of(plan: Plan, rank: int) -> Topology:
        my = plan.stage_of_rank(rank)
        return Topology(plan, rank, my.index, my.ranks.index(rank))

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages

    @property
    def replicas(self) -> tuple[int, ...]:
        """Replica count of every stage."""
        return self._replicas

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == len(self._replicas) - 1

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's stage (its replicas)."""
        return self.plan.stages[self.stage].ranks

    @property
    def layers(self) -> tuple[int, ...]:
        return self.plan.stages[self.stage].layers

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def peer(self, stage: int, minibatch: int) -> int:
        """The rank of ``stage`` that runs ``minibatch``."""
        s = self.plan.stages[stage]
        return s.ranks[minibatch % s.replicas]

    def peers(self, stage: int) -> list[int]:
        """Ranks of ``stage`` that exchange minibatches with this rank."""
        here, there = self.replicas[self.stage], self.replicas[stage]
        g = math.gcd(here, there)
        return [r for i, r in enumerate(self.plan.stages[stage].ranks) if i % g == self.replica % g]

    def links(self) -> list[tuple[int, str]]:
        """``(peer, channel)`` for every neighbour this rank exchanges activations and gradients with."""
        out = []
        for stage in (self.stage - 1, self.stage + 1):
            if 0 <= stage < self.num_stages:
                out += [(peer, channel) for peer in self.peers(stage) for channel in ("act", "grad")]
        return out
