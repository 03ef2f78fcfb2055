"""Schedules of a straight pipeline, one stage per rank (stage ``r`` on rank ``r``).

Each function returns rank -> compute actions of one step of ``microbatches`` minibatches (add the updates
with :func:`~pipedream_ft.schedules.updates.add_updates`, the messages with
:func:`~pipedream_ft.schedules.comms.add_communication`). The orders are those of
``torch.distributed.pipelining``'s classes of the same name (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleavedZeroBubble`` with one stage per rank).
"""

from __future__ import annotations

from .actions import Action, Kind
from ._order import one_f_one_b_order
from .placement import check_counts

__all__ = ["gpipe", "one_f_one_b", "zb_h1", "pipedream"]


def gpipe(ranks: int, microbatches: int) -> dict[int, list[Action]]:
    """Fill and drain: every forward, then every backward."""
    check_counts(ranks=ranks, microbatches=microbatches)
    return {r: [Action(r, Kind.F, m) for m in range(microbatches)] + [Action(r, Kind.B, m) for m in range(microbatches)]
            for r in range(ranks)}


def one_f_one_b(ranks: int, microbatches: int) -> dict[int, list[Action]]:
    """1F1B with a flush (this library's ``flush`` mode): rank ``r`` keeps ``ranks - r`` minibatches in flight.

    Bubble ``(S - 1)(F + B)`` per step.
    """
    check_counts(ranks=ranks, microbatches=microbatches)
    return {r: one_f_one_b_order(_f(r, microbatches), _b(r, microbatches, Kind.B), min(ranks - 1 - r, microbatches))
            for r in range(ranks)}


def zb_h1(ranks: int, microbatches: int) -> dict[int, list[Action]]:
    """ZB-H1 (zero bubble, 1F1B's memory): the backward split into ``I`` and ``W``; rank ``r`` defers its
    first ``r`` weight gradients into the cool-down, where 1F1B idles. Bubble ``(S - 1)(F + I - W)``."""
    check_counts(ranks=ranks, microbatches=microbatches)
    return {r: one_f_one_b_order(_f(r, microbatches), _b(r, microbatches, Kind.I), min(ranks - 1 - r, microbatches),
                                 weights_after=r)
            for r in range(ranks)}


def pipedream(ranks: int, microbatches: int) -> dict[int, list[Action]]:
    """PipeDream's asynchronous 1F1B (``stash``/``vertical`` modes): an update right after every backward,
    no flush; update ``k`` of a stage follows its ``k``-th backward."""
    check_counts(ranks=ranks, microbatches=microbatches)

    def update(b: Action) -> list[Action]:
        return [Action(b.stage, Kind.U, b.index)]
    return {r: one_f_one_b_order(_f(r, microbatches), _b(r, microbatches, Kind.B), min(ranks - 1 - r, microbatches),
                                 after_backward=update)
            for r in range(ranks)}


def _f(stage: int, n: int) -> list[Action]:
    return [Action(stage, Kind.F, m) for m in range(n)]


def _b(stage: int, n: int, kind: Kind) -> list[Action]:
    return [Action(stage, kind, m) for m in range(n)]
