"""Every schedule by name, with the stage placement it assumes."""

from __future__ import annotations

from typing import Callable, NamedTuple

from .actions import Action
from .looped import interleaved_1f1b, interleaved_zero_bubble, looped_bfs
from .placement import check_counts, loop_placement, v_placement
from .straight import gpipe, one_f_one_b, pipedream, zb_h1
from .vshape import dualpipev, zbv

__all__ = ["SCHEDULES", "Built", "build"]


class Built(NamedTuple):
    schedule: dict[int, list[Action]]
    """rank -> compute actions (``pipedream`` has its updates too)."""
    placement: dict[int, int]
    """stage -> rank."""


_STRAIGHT: dict[str, Callable[[int, int], dict[int, list[Action]]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1, "pipedream": pipedream}
_LOOPED: dict[str, Callable[[int, int, int], dict[int, list[Action]]]] = {
    "interleaved_1f1b": interleaved_1f1b, "interleaved_zero_bubble": interleaved_zero_bubble,
    "looped_bfs": looped_bfs}
_V: dict[str, Callable[[int, int], dict[int, list[Action]]]] = {"zbv": zbv, "dualpipev": dualpipev}

SCHEDULES = (*_STRAIGHT, *_LOOPED, *_V)
"""The names :func:`build` knows."""


def build(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Built:
    """Schedule ``name`` for ``ranks`` ranks and ``microbatches`` microbatches per step.

    ``stages_per_rank`` defaults to what the schedule needs (1 straight, 2 for the V schedules, 2 for the
    looped ones); a value the schedule cannot use raises ValueError.
    """
    check_counts(ranks=ranks, microbatches=microbatches)
    if name in _STRAIGHT:
        _need(name, stages_per_rank, 1)
        return Built(_STRAIGHT[name](ranks, microbatches), loop_placement(ranks))
    if name in _V:
        _need(name, stages_per_rank, 2)
        return Built(_V[name](ranks, microbatches), v_placement(ranks))
    if name in _LOOPED:
        v = 2 if stages_per_rank is None else stages_per_rank
        return Built(_LOOPED[name](ranks, v, microbatches), loop_placement(ranks, v))
    raise ValueError(f"unknown schedule {name!r}: expected one of {', '.join(SCHEDULES)}")


def _need(name: str, given: int | None, needed: int) -> None:
    if given is not None and given != needed:
        raise ValueError(f"schedule {name!r} runs {needed} stage(s) per rank, got stages_per_rank={given}")
