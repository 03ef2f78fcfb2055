"""Which rank holds each stage: the plan maps stages to ranks many-to-one (virtual stages).

* loop: stage ``s`` on rank ``s % R``, so rank ``r`` holds ``r, r + R, r + 2R, ...`` (interleaved 1F1B,
  looped BFS);
* V: ``2R`` stages, rank ``r`` holds ``r`` and ``2R - 1 - r`` (ZBV, DualPipeV): the first and the last stage
  share rank 0, so the loss is computed where the input enters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from .actions import Action, Kind, Schedule
from .errors import ScheduleError

__all__ = ["loop_placement", "v_placement", "stage_to_rank", "check_counts", "Replicated", "PlacementLike",
           "as_replicated"]


def check_counts(**values: int) -> None:
    """Raise ValueError naming each argument that is not a positive integer."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def loop_placement(ranks: int, stages_per_rank: int = 1) -> dict[int, int]:
    """stage -> rank for ``ranks * stages_per_rank`` stages dealt round-robin."""
    check_counts(ranks=ranks, stages_per_rank=stages_per_rank)
    return {s: s % ranks for s in range(ranks * stages_per_rank)}


def v_placement(ranks: int) -> dict[int, int]:
    """stage -> rank for ``2 * ranks`` stages in a V: rank ``r`` holds ``r`` and ``2 * ranks - 1 - r``."""
    check_counts(ranks=ranks)
    return {s: s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks)}


def stage_to_rank(schedule: Schedule) -> dict[int, int]:
    """stage -> rank read from where a schedule runs each stage's actions (sends and updates included).

    Raises :class:`ScheduleError` if a stage's actions appear on two ranks, or the stages are not ``0..S-1``.
    """
    where: dict[int, int] = {}
    for rank, actions in sorted(schedule.items()):
        for a in actions:
            if a is None or a.kind.value.startswith("RECV"):
                continue  # a receive names the receiving stage: checked against its compute actions below
            if where.setdefault(a.stage, rank) != rank:
                raise ScheduleError(f"stage {a.stage} runs on two ranks: {where[a.stage]} and {rank} ({a})")
    for rank, actions in sorted(schedule.items()):
        for a in actions:
            if a is not None and a.kind.value.startswith("RECV") and where.get(a.stage, rank) != rank:
                raise ScheduleError(f"{a} on rank {rank} receives for stage {a.stage}, which runs on rank "
                                    f"{where[a.stage]}")
    stages = sorted(where)
    if stages != list(range(len(stages))):
        raise ScheduleError(f"stages must be numbered 0..S-1, the schedule has {stages}")
    return where


@dataclass(frozen=True, slots=True)
class Replicated:
    """Where a plan with replicated stages runs each minibatch: ``ranks[s]`` are stage ``s``'s replicas, and
    minibatch ``m`` runs on ``ranks[s][m % len(ranks[s])]`` (PipeDream deals minibatches round-robin). A
    placement of one rank per stage is the case of one replica each."""

    ranks: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.ranks or any(not r for r in self.ranks):
            raise ValueError(f"every stage needs at least one rank, got {self.ranks!r}")

    @staticmethod
    def of(stage_ranks: Sequence[Sequence[int]]) -> "Replicated":
        return Replicated(tuple(tuple(r) for r in stage_ranks))

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    def rank(self, stage: int, minibatch: int) -> int:
        """The rank that runs ``minibatch`` on ``stage``."""
        held = self.ranks[stage]
        return held[minibatch % len(held)]

    def holds(self, rank: int, stage: int) -> bool:
        return 0 <= stage < len(self.ranks) and rank in self.ranks[stage]

    def check(self, action: Action, rank: int) -> None:
        """Raise :class:`ScheduleError` unless ``rank`` runs ``action``: the rank that runs its minibatch on its
        stage, or, for an update, any replica of its stage."""
        if action.stage >= len(self.ranks):
            raise ScheduleError(f"{action} is on rank {rank} but there is no stage {action.stage}")
        held = self.ranks[action.stage]
        if action.kind is Kind.U:
            if rank not in held:
                raise ScheduleError(f"{action} is on rank {rank} but stage {action.stage} is placed on "
                                    + (f"rank {held[0]}" if len(held) == 1 else f"ranks {list(held)}"))
        elif self.rank(action.stage, action.index) != rank:
            raise ScheduleError(
                f"{action} is on rank {rank} but stage {action.stage} is placed on rank {held[0]}" if len(held) == 1
                else f"{action} is on rank {rank} but stage {action.stage} runs minibatch {action.index} on rank "
                     f"{self.rank(action.stage, action.index)}")


PlacementLike = Union[Mapping[int, int], Replicated]
"""stage -> rank, or a :class:`Replicated` placement."""


def as_replicated(placement: PlacementLike) -> Replicated:
    """``placement`` as a :class:`Replicated` one (a mapping: one replica per stage, stages ``0..S-1``)."""
    if isinstance(placement, Replicated):
        return placement
    stages = sorted(placement)
    if stages != list(range(len(stages))):
        raise ScheduleError(f"stages must be numbered 0..S-1, the placement has {stages}")
    return Replicated(tuple((placement[s],) for s in stages))
