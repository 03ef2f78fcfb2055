"""The end of a ``fit``, where every wait gives way to a peer's failure (in-place recovery).

After the last minibatch each rank finishes its part of the last checkpoint: it waits for its own writes, rank 0
for every rank's report and the commit record, and the others for rank 0's word that it is done
(:meth:`Checkpointer.finish <pipedream_ft.ft.checkpointer.Checkpointer.finish>`). No collective runs then, so a
peer that dies meanwhile (its background writer was still writing the last part) fails nothing at once: the
others would wait out the commit timeout, fail, and be replaced in turn.

With in-place recovery an :class:`Ending` cuts each of those waits into short slices and asks between them
whether a failure was counted in the group. If one was, the group settles, once for every rank, through one store
key (:meth:`Coordinator.settle_end <pipedream_ft.ft.coordination.Coordinator.settle_end>`): either rank 0 had
already finished (then nothing is lost, and the ranks leave) or the group recovers, and the wait raises
:class:`~pipedream_ft.pipeline.group.GroupError` for the trainer to recover from, as from a failure while training.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..pipeline.group import GroupError

__all__ = ["Ending", "FINISHED", "RECOVER", "keys_set"]

FINISHED = "finished"
"""The settled end: rank 0 finished the position (the last checkpoint committed or given up)."""
RECOVER = "recover"
"""The settled end: a peer failed before rank 0 finished; every rank recovers in place."""


class Ending:
    """The waits of one rank's end of a ``fit`` at ``position``.

    ``failed()`` says whether a peer failed since this rank's epoch formed (``None``: nothing can be recovered;
    each wait only runs to its timeout); ``settle(proposal)`` settles the group's end with ``proposal`` unless
    it is settled already, and returns the settled value (:data:`FINISHED` or :data:`RECOVER`).
    """

    def __init__(self, position: int, failed: Callable[[], bool] | None, settle: Callable[[str], str], *,
                 slice_s: float = 0.1) -> None:
        if slice_s <= 0:
            raise ValueError(f"slice_s must be positive, got {slice_s}")
        self.position = position
        self.failed = failed
        self.settle = settle
        self.slice_s = slice_s

    def wait(self, step: Callable[[float], bool], timeout: float) -> bool:
        """Call ``step(seconds)`` — a wait of at most that long, returning whether it is done — until it is done
        (``True``) or ``timeout`` seconds have passed (``False``). Raises :class:`GroupError` once a peer's
        failure settles the end as :data:`RECOVER`."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if step(max(0.0, left if self.failed is None else min(left, self.slice_s))):
                return True
            self.check()
            if time.monotonic() >= deadline:
                return False

    def check(self) -> None:
        """Raise :class:`GroupError` if a peer failed and the group settles on recovering; once it settled on
        :data:`FINISHED`, failures are no longer this end's to recover from."""
        if self.failed is None or not self.failed():
            return
        if self.settle(RECOVER) == FINISHED:
            self.failed = None  # rank 0 finished first: a later failure is the next collective's to meet
            return
        raise GroupError(f"a peer failed while checkpoint {self.position} was being finished")

    def finish(self) -> None:
        """Rank 0: settle the end as :data:`FINISHED`; raises :class:`GroupError` if a peer's failure settled it
        as :data:`RECOVER` first."""
        if self.settle(FINISHED) != FINISHED:
            raise GroupError(f"a peer failed while checkpoint {self.position} was being finished")


def keys_set(store: Any, keys: list[str]) -> Callable[[float], bool]:
    """A step for :meth:`Ending.wait`: whether every key of ``keys`` is set in ``store``, looking again after at
    most ``seconds`` (a store's own timed wait would log a warning each time it runs out)."""

    def step(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not store.check(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, 0.05))
        return True

    return step
