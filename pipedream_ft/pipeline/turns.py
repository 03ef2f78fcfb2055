"""The order in which the stages one process holds take their actions (virtual stages).

A process that holds several stages of a schedule (interleaved 1F1B, ZBV, DualPipeV: see
:class:`~pipedream_ft.schedules.WindowSchedule`) runs each stage on a thread of its own, each a complete stage
with its own groups, checkpoints and recovery (see :mod:`pipedream_ft.virtual`). :class:`Turns` makes those
threads take their compute and update actions one at a time, in the order the schedule gives the rank
(:meth:`~pipedream_ft.schedules.WindowSchedule.rank_actions`): exactly what one thread running the rank's list
would do, so the bubble is the schedule's and a forward's RNG is never disturbed by another stage's.

The updates that end a window are the exception: a process's stages run them together, in any order, since
they are collectives of every stage (the global gradient norm, the tied weights' gradients) and no forward's RNG
is involved.

The order is armed when every stage of the rank has begun a run over the same minibatches (:meth:`Turns.begin`).
A stage that leaves a run early — its group failed, or it finished — frees the others for the rest of that run
(:meth:`Turns.leave`): nothing ever waits for a stage that no longer runs, and a run after a recovery is ordered
again once every stage has begun it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

from ..schedules.actions import Action, Kind
from ..schedules.window import WindowSchedule
from .group import PeerTimeoutError

__all__ = ["Turns"]


class Turns:
    """The turns of the stages of rank ``rank`` of ``schedule`` (see the module docstring). A stage that waits for
    its turn while no stage of the process runs an action fails after ``timeout_s`` with :class:`PeerTimeoutError`
    naming the action, like any other wait for a peer; while another stage runs one, that stage's own waits are the
    bounded ones (its action may take longer than ``timeout_s`` in all)."""

    def __init__(self, schedule: WindowSchedule, rank: int, timeout_s: float) -> None:
        if not 0 <= rank < schedule.num_ranks:
            raise ValueError(f"rank must be in [0, {schedule.num_ranks}), got {rank}")
        self.schedule = schedule
        self.rank = rank
        self.stages = tuple(schedule.stages_of(rank))
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._begun: dict[int, tuple[int, int]] = {}
        """stage -> the minibatches of the run it is in."""
        self._key: tuple[int, int] | None = None
        """The minibatches of the current run (the newest begun)."""
        self._done: dict[int, int] = {}
        """Actions each stage ran in the current run."""
        self._order: list[set[Action]] = []
        """The current run's actions not yet run, in the rank's order, the next last (when armed): one action per
        step, or a window's updates together."""
        self._armed = False
        self._free = False
        self._inside = 0
        """Stages running an action now."""

    def begin(self, stage: int, start: int, stop: int) -> None:
        """Stage ``stage`` begins running minibatches ``[start, stop)``."""
        self._check(stage)
        key = (start, stop)
        with self._cond:
            if not any(s in self._begun for s in self.stages) or key != self._key:
                self._key, self._done, self._armed, self._free = key, {}, False, False
            self._begun[stage] = key
            if all(self._begun.get(s) == key for s in self.stages):
                skip = dict(self._done)
                self._order = []
                for a in self.schedule.rank_actions(self.rank, start, stop):
                    if skip.get(a.stage, 0) > 0:  # run already, while the order was not armed
                        skip[a.stage] -= 1
                    elif a.kind == Kind.U and self._order and next(iter(self._order[-1])).kind == Kind.U:
                        self._order[-1].add(a)
                    else:
                        self._order.append({a})
                self._order.reverse()  # the next step last
                self._armed, self._free = True, False
            self._cond.notify_all()

    def leave(self, stage: int) -> None:
        """Stage ``stage`` runs no more actions of its run (done, or its group failed): the others go on freely."""
        self._check(stage)
        with self._cond:
            self._begun.pop(stage, None)
            self._free = True
            self._cond.notify_all()

    @contextmanager
    def turn(self, action: Action) -> Iterator[None]:
        """Wait until it is ``action``'s turn, then hold the turn while the caller runs it."""
        self._check(action.stage)
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while not self._ready(action):
                now = time.monotonic()
                if self._inside:
                    deadline = now + self.timeout_s  # another stage is running an action: its waits are bounded
                left = deadline - now
                if left <= 0:
                    waiting = ", ".join(map(str, sorted(self._order[-1]))) if self._armed and self._order else None
                    raise PeerTimeoutError(
                        f"{action} waited {self.timeout_s:g} s for its turn on rank {self.rank}: "
                        + (f"{waiting} comes first" if waiting is not None else
                           f"stages {[s for s in self.stages if self._begun.get(s) != self._key]} have not begun "
                           "the run"))
                self._cond.wait(min(left, 0.5))
            current = self._begun.get(action.stage) == self._key
            ordered = current and self._armed and not self._free
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                if current and self._begun.get(action.stage) == self._key:
                    self._done[action.stage] = self._done.get(action.stage, 0) + 1
                    if ordered and self._armed and self._order and action in self._order[-1]:
                        self._order[-1].discard(action)
                        if not self._order[-1]:
                            self._order.pop()
                self._cond.notify_all()

    def _ready(self, action: Action) -> bool:
        if self._begun.get(action.stage) != self._key or self._free:
            return True  # an older run's tail, or a run a stage has left: nothing to order it with
        if not self._armed:
            return False  # the rank's other stages have not begun this run yet
        if not self._order:
            return True
        return action in self._order[-1]  # a single action holds the turn until it is done; updates run together

    def _check(self, stage: int) -> None:
        if stage not in self.stages:
            raise ValueError(f"stage {stage} does not run on rank {self.rank} (it holds {list(self.stages)})")
