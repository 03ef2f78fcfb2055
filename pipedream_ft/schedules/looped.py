"""Schedules with ``v`` stages per rank dealt round-robin (stage ``s`` on rank ``s % R``).

The orders are those of ``torch.distributed.pipelining``'s ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble`` and ``ScheduleLoopedBFS``: microbatches go through a rank's stages in
rounds of ``microbatches // max(1, microbatches // R)`` (so ``microbatches`` needn't be a multiple of ``R``).
"""

from __future__ import annotations

from .actions import Action, Kind
from ._order import numbered, one_f_one_b_order
from .placement import check_counts

__all__ = ["interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs"]


def interleaved_1f1b(ranks: int, stages_per_rank: int, microbatches: int) -> dict[int, list[Action]]:
    """Interleaved (depth-first) 1F1B (Megatron-LM): bubble ``(S - 1)(F + B) / v`` for ``v`` stages per rank."""
    return _looped(ranks, stages_per_rank, microbatches, zero_bubble=False)


def interleaved_zero_bubble(ranks: int, stages_per_rank: int, microbatches: int) -> dict[int, list[Action]]:
    """Interleaved 1F1B with the backward split into ``I`` and ``W`` (ZB-1P); rank ``r`` defers ``r`` ``W``."""
    return _looped(ranks, stages_per_rank, microbatches, zero_bubble=True)


def looped_bfs(ranks: int, stages_per_rank: int, microbatches: int) -> dict[int, list[Action]]:
    """Breadth-first: each local stage forwards every microbatch, then backwards in reverse (stages last to
    first, microbatches last to first)."""
    check_counts(ranks=ranks, stages_per_rank=stages_per_rank, microbatches=microbatches)
    out = {}
    for r in range(ranks):
        local = [r + k * ranks for k in range(stages_per_rank)]
        out[r] = ([Action(s, Kind.F, m) for s in local for m in range(microbatches)]
                  + [Action(s, Kind.B, m) for s in reversed(local) for m in reversed(range(microbatches))])
    return out


def _looped(ranks: int, v: int, n: int, zero_bubble: bool) -> dict[int, list[Action]]:
    check_counts(ranks=ranks, stages_per_rank=v, microbatches=n)
    rounds = max(1, n // ranks)
    if n % rounds:
        raise ValueError(f"microbatches must be a multiple of the rounds max(1, microbatches // ranks) = {rounds}, "
                         f"got microbatches={n} ranks={ranks}")
    per_round = n // rounds
    out = {}
    for r in range(ranks):
        # the k-th forward of the rank runs local stage (k // per_round) % v; backwards run them in reverse
        forward_stages = [((k // per_round) % v) * ranks + r for k in range(v * n)]
        backward_stages = [(v - 1 - (k // per_round) % v) * ranks + r for k in range(v * n)]
        warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (ranks - 1 - r), v * n)
        out[r] = one_f_one_b_order(numbered(Kind.F, forward_stages),
                                   numbered(Kind.I if zero_bubble else Kind.B, backward_stages), warmup,
                                   weights_after=r if zero_bubble else None)
    return out
