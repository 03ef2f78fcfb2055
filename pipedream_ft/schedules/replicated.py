"""The schedules the runtime's modes run, per rank of a plan whose stages may be replicated, over any range of
minibatches.

Each function returns the compute and update actions one replica of one stage runs for minibatches
``[start, stop)`` (``U j``: the stage's update number ``j``); :meth:`~pipedream_ft.pipeline.modes.Mode.lowered`
adds the sends and receives (:func:`~pipedream_ft.schedules.comms.add_communication` with a
:class:`~pipedream_ft.schedules.placement.Replicated` placement) and :func:`~pipedream_ft.schedules.simulate`
checks and times the result.

Minibatches are dealt round-robin to a stage's replicas: replica ``r`` of a stage with ``R`` replicas runs the
minibatches ``b`` with ``b % R == r``. A replica of stage ``s`` keeps ``ceil(sum(R[s:]) / R[s])`` minibatches in
flight — ``S - s`` in a straight pipeline of ``S`` stages — enough to keep every later stage busy.

* :func:`async_1f1b`: PipeDream's asynchronous 1F1B, no flush, an update after every backward;
* :func:`flushing`: 1F1B inside windows of ``K`` minibatches, then one update for the window (synchronous
  minibatch SGD); :func:`synchronous` also runs GPipe's and ZB-H1's orders that way;
* :func:`double_buffered`: PipeDream-2BW, 1F1B without a flush whose update ``U k`` follows the replica's last
  backward of window ``k``.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

from . import catalog
from .actions import Action, Kind

__all__ = ["in_flight", "replica_minibatches", "async_1f1b", "flushing", "SYNCHRONOUS", "synchronous",
           "double_buffered", "iter_async_1f1b", "iter_flushing", "iter_synchronous", "iter_double_buffered"]

_made = Action.trusted
_F, _B, _U = Kind.F, Kind.B, Kind.U
"""Read once: an enum member read off its class costs a lookup, and a run of many minibatches makes many."""


def in_flight(stage: int, replicas: Sequence[int]) -> int:
    """How many minibatches one replica of ``stage`` keeps in flight in steady state."""
    if not 0 <= stage < len(replicas):
        raise ValueError(f"stage must be in [0, {len(replicas)}), got {stage}")
    return math.ceil(sum(replicas[stage:]) / replicas[stage])


def replica_minibatches(replica: int, num_replicas: int, start: int, stop: int) -> list[int]:
    """The minibatches in ``[start, stop)`` that ``replica`` of a stage with ``num_replicas`` replicas runs."""
    return list(_replica_range(replica, num_replicas, start, stop))


def _replica_range(replica: int, num_replicas: int, start: int, stop: int) -> range:
    if not 0 <= replica < num_replicas:
        raise ValueError(f"replica must be in [0, {num_replicas}), got {replica}")
    first = start + (replica - start) % num_replicas
    return range(first, stop, num_replicas)


def async_1f1b(stage: int, replica: int, replicas: Sequence[int], start: int, stop: int) -> list[Action]:
    """PipeDream's asynchronous 1F1B for minibatches ``[start, stop)``, an update after every backward.

    ``start`` must be a multiple of every stage's replica count, so that every replica starts a round.
    """
    return list(iter_async_1f1b(stage, replica, replicas, start, stop))


def iter_async_1f1b(stage: int, replica: int, replicas: Sequence[int], start: int, stop: int) -> Iterator[Action]:
    """:func:`async_1f1b`, made as it is read (a long run's list is never held whole)."""
    _check_window(start, stop, replicas)
    mine = _replica_range(replica, replicas[stage], start, stop)
    k = min(in_flight(stage, replicas), len(mine))
    return _one_f_one_b(stage, mine, k, start // replicas[stage], None)


def _one_f_one_b(stage: int, mine: range, k: int, first_round: int, window: int | None) -> Iterator[Action]:
    """1F1B without a flush over ``mine``, ``k`` in flight: an update after every backward (``window`` None, the
    ``i``-th numbered ``first_round + i``), or after the replica's last backward of each window of ``window``."""
    step = mine.step
    for b in mine[:k]:
        yield _made(stage, _F, b)
    n = len(mine)
    for i, b in enumerate(mine):
        yield _made(stage, _B, b)
        if window is None:
            yield _made(stage, _U, first_round + i)
        elif (b + step) // window != b // window:  # this replica's last of the window
            yield _made(stage, _U, b // window)
        if i + k < n:
            yield _made(stage, _F, mine[i + k])


def flushing(stage: int, replica: int, replicas: Sequence[int], start: int, stop: int, window: int) -> list[Action]:
    """1F1B inside windows of ``window`` minibatches, one update per window (the pipeline flushes)."""
    return list(iter_flushing(stage, replica, replicas, start, stop, window))


def iter_flushing(stage: int, replica: int, replicas: Sequence[int], start: int, stop: int,
                  window: int) -> Iterator[Action]:
    """:func:`flushing`, made as it is read."""
    _check_windows(start, stop, replicas, window)
    return _flushing(stage, replica, replicas, start, stop, window)


def _flushing(stage: int, replica: int, replicas: Sequence[int], start: int, stop: int,
              window: int) -> Iterator[Action]:
    for w in range(start // window, stop // window):
        mine = _replica_range(replica, replicas[stage], w * window, (w + 1) * window)
        k = min(in_flight(stage, replicas), len(mine))
        for b in mine[:k]:
            yield _made(stage, _F, b)
        for i, b in enumerate(mine):
            yield _made(stage, _B, b)
            if i + k < len(mine):
                yield _made(stage, _F, mine[i + k])
        yield _made(stage, _U, w)


SYNCHRONOUS = ("1f1b", "gpipe", "zb_h1")
"""The schedules ``flush`` mode runs (one stage per rank): 1F1B (:func:`flushing`, replicated stages too),
GPipe's fill and drain, and ZB-H1 (zero bubble with 1F1B's memory: the backward split into ``I`` and ``W``, a
rank's first weight gradients deferred into the drain)."""


def synchronous(name: str, stage: int, replica: int, replicas: Sequence[int], start: int, stop: int,
                window: int) -> list[Action]:
    """Schedule ``name`` (one of :data:`SYNCHRONOUS`) over windows of ``window`` minibatches, one update per window:
    the orders of :mod:`pipedream_ft.schedules`, whose minibatch ``m`` of a window is minibatch ``w + m`` here.
    GPipe and ZB-H1 run straight pipelines (no replicated stage)."""
    return list(iter_synchronous(name, stage, replica, replicas, start, stop, window))


def iter_synchronous(name: str, stage: int, replica: int, replicas: Sequence[int], start: int, stop: int,
                     window: int) -> Iterator[Action]:
    """:func:`synchronous`, made as it is read."""
    if name == "1f1b":
        return iter_flushing(stage, replica, replicas, start, stop, window)
    if name not in SYNCHRONOUS:
        raise ValueError(f"schedule must be one of {SYNCHRONOUS}, got {name!r}")
    if any(r != 1 for r in replicas):
        raise ValueError(f"schedule {name!r} runs a straight pipeline; the plan replicates stages "
                         f"{[s for s, r in enumerate(replicas) if r != 1]} (use '1f1b')")
    _check_window(start, stop, replicas)
    if window < 1 or start % window or stop % window:
        raise ValueError(f"minibatches [{start}, {stop}) are not whole windows of {window}")
    order = [(a.kind, a.index) for a in catalog.build(name, len(replicas), window).schedule[stage]]
    return _windows(stage, order, start // window, stop // window, window)


def _windows(stage: int, order: list[tuple[Kind, int]], first: int, last: int, window: int) -> Iterator[Action]:
    for w in range(first, last):
        base = w * window
        for kind, index in order:
            yield _made(stage, kind, base + index)
        yield _made(stage, _U, w)


def double_buffered(stage: int, replica: int, replicas: Sequence[int], start: int, stop: int,
                    window: int) -> list[Action]:
    """PipeDream-2BW: asynchronous 1F1B (no flush) with one update per window of ``window`` minibatches, right
    after this replica's last backward of the window."""
    return list(iter_double_buffered(stage, replica, replicas, start, stop, window))


def iter_double_buffered(stage: int, replica: int, replicas: Sequence[int], start: int, stop: int,
                         window: int) -> Iterator[Action]:
    """:func:`double_buffered`, made as it is read."""
    _check_windows(start, stop, replicas, window)
    mine = _replica_range(replica, replicas[stage], start, stop)
    k = min(in_flight(stage, replicas), len(mine))
    return _one_f_one_b(stage, mine, k, 0, window)


def _check_windows(start: int, stop: int, replicas: Sequence[int], window: int) -> None:
    """Raise ValueError unless ``[start, stop)`` is whole windows of ``window`` minibatches, a multiple of every
    stage's replica count."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    _check_window(start, stop, replicas)
    if (stop - start) % window or start % window:
        raise ValueError(f"minibatches [{start}, {stop}) are not whole windows of {window}")
    lcm = math.lcm(*replicas)
    if window % lcm:
        raise ValueError(f"window {window} must be a multiple of every stage's replica count (lcm {lcm})")


def _check_window(start: int, stop: int, replicas: Sequence[int]) -> None:
    if not replicas or any(r < 1 for r in replicas):
        raise ValueError(f"replicas must be positive, got {list(replicas)}")
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got start={start} stop={stop}")
    lcm = math.lcm(*replicas)
    if start % lcm or stop % lcm:
        raise ValueError(
            f"minibatch range [{start}, {stop}) must start and end on a multiple of {lcm} "
            f"(the least common multiple of the stages' replica counts {list(replicas)})"
        )
