"""Schedules with two stages per rank in a V: rank ``r`` holds stages ``r`` and ``2R - 1 - r``.

The orders are those of ``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV``; DualPipeV's overlapped forward+backward pairs are written as the forward followed by
the backward (overlapping them is the runtime's business).
"""

from __future__ import annotations

from collections import defaultdict

from .actions import Action, Kind
from .placement import check_counts

__all__ = ["zbv", "dualpipev"]


def zbv(ranks: int, microbatches: int) -> dict[int, list[Action]]:
    """ZB-V: zero-bubble with ``I``/``W`` split, bubble-free when F, I and W cost the same and there are at
    least ``2R - 1`` microbatches (fewer run the same order with the missing ones left out)."""
    check_counts(ranks=ranks, microbatches=microbatches)
    return {r: [a for a in _zbv_rank(ranks, r, max(2 * ranks - 1, microbatches)) if a.index < microbatches]
            for r in range(ranks)}


def _zbv_rank(ranks: int, r: int, n: int) -> list[Action]:
    down, up = r, 2 * ranks - 1 - r  # the rank's stage on the way down and on the way up
    count: dict[tuple[int, Kind], int] = defaultdict(int)
    out: list[Action] = []

    def put(stage: int, kind: Kind) -> None:
        out.append(Action(stage, kind, count[stage, kind]))
        count[stage, kind] += 1

    for _ in range(2 * (ranks - r) - 1):
        put(down, Kind.F)
    for _ in range(r):
        put(up, Kind.F)
        put(down, Kind.F)
    for _ in range(ranks - r):
        put(up, Kind.F)
        put(up, Kind.I)
        put(up, Kind.W)
    while count[up, Kind.F] < count[down, Kind.F] or count[down, Kind.F] < n:
        if count[down, Kind.F] < n:
            put(down, Kind.F)
        put(down, Kind.I)
        put(down, Kind.W)
        put(up, Kind.F)
        put(up, Kind.I)
        put(up, Kind.W)
    for _ in range(r):
        put(down, Kind.I)
        put(up, Kind.I)
    for _ in range(ranks - r):
        put(down, Kind.I)
        put(down, Kind.W)
    for stage in (up, down):
        while count[stage, Kind.W] < count[stage, Kind.I]:
            put(stage, Kind.W)
    return out


def dualpipev(ranks: int, microbatches: int) -> dict[int, list[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V): needs at least ``2R`` microbatches."""
    check_counts(ranks=ranks, microbatches=microbatches)
    if microbatches < 2 * ranks:
        raise ValueError(f"DualPipeV needs at least as many microbatches as stages (2 * ranks = {2 * ranks}), "
                         f"got microbatches={microbatches} ranks={ranks}")
    return {r: _dualpipev_rank(ranks, r, microbatches) for r in range(ranks)}


def _dualpipev_rank(ranks: int, r: int, n: int) -> list[Action]:
    down, up = r, 2 * ranks - 1 - r
    fwd: dict[int, int] = defaultdict(int)
    bwd: dict[int, int] = defaultdict(int)  # B and I share the numbering
    weights: list[Action] = []  # W owed for each I, oldest first
    out: list[Action] = []

    def forward(stage: int) -> None:
        out.append(Action(stage, Kind.F, fwd[stage]))
        fwd[stage] += 1

    def backward(stage: int, split: bool = False) -> None:
        a = Action(stage, Kind.I if split else Kind.B, bwd[stage])
        out.append(a)
        bwd[stage] += 1
        if split:
            weights.append(Action(stage, Kind.W, a.index))

    def weight() -> None:
        if weights:
            out.append(weights.pop(0))

    for _ in range(2 * (ranks - r - 1)):
        forward(down)
    for _ in range(r + 1):
        forward(down)
        forward(up)
    for _ in range(ranks - r - 1):
        backward(up, split=True)
        weight()
        forward(up)
    for _ in range(n - 2 * ranks + r + 1):  # the steady state: F0 with B1, then F1 with B0
        forward(down)
        backward(up)
        forward(up)
        backward(down)
    for _ in range(ranks - r - 1):
        backward(up)
        forward(up)
        backward(down)
    split = False
    for i in range(r + 1):  # from the middle on, the backwards are split and their W fill the tail
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(up, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(down, split)
    for _ in range(ranks - r - 1):
        weight()
        backward(down, split)
    for _ in range(r + 1):
        weight()
    return out
