"""Several stages in one process: how they talk to each other and to the stages of other processes.

A schedule that gives a process several stages (interleaved 1F1B, ZBV, DualPipeV: see
:class:`~pipedream_ft.schedules.WindowSchedule`) runs them all on the process's one rank: one set of process
groups, one thread. What changes for the stages is only who their peers are:

* a stage's **messenger** (:class:`~pipedream_ft.pipeline.comm.Messenger` with a :class:`StageRoute`) names
  its peers by *stage*; the route maps each stage to the rank that holds it, and every message's tag carries
  the stage that sends it, so two stages of one process never mix up their messages to a third (the gradient
  of stage 1 and the activation of stage 1, both to the process holding stages 0 and 2, travel apart). Under
  NCCL each sending stage has communicators of its own (links named ``"act:3"``, ``"grad:2"``, ...).
* between two stages of the same process nothing travels. The schedule's communication pass emits no send or
  receive for them (:func:`~pipedream_ft.schedules.add_communication`), and the executor hands the activation
  and its gradient over in memory (:class:`Handoff`), as ``torch.distributed.pipelining`` does with
  ``set_local_fwd_input`` / ``get_local_bwd_output``. The rarer messages (the pre-flight's, targets, tied
  gradients, evaluation) keep their code path: a messenger's send to a stage of its own process is left in the
  handoff, and the matching receive takes it from there.

A :class:`StageConnection` is one stage's view of the process's
:class:`~pipedream_ft.pipeline.connection.Connection`: the same groups, its own messenger.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Hashable

import torch

from ..errors import PipelineSetupError
from .comm import Messenger
from .connection import Connection
from .group import CommGroup

__all__ = ["Handoff", "StageConnection", "StageRoute"]


@dataclass(frozen=True, slots=True)
class StageRoute:
    """Stage ``stage`` of a job whose stage ``s`` runs on rank ``ranks[s]``."""

    stage: int
    ranks: tuple[int, ...]

    @property
    def lanes(self) -> int:
        """Distinct senders in a tag: every stage, once for activations and once for gradients."""
        return 2 * len(self.ranks)


class Handoff:
    """What the stages of one process hand each other: values by key, taken in the order they were left.

    The executor's activations and gradients are unique per key (a second one is a schedule error); a
    messenger's messages to a stage of its own process queue up under their tag, as messages with one tag
    between two ranks do."""

    def __init__(self) -> None:
        self._items: dict[Hashable, deque[Any]] = {}

    def put(self, key: Hashable, value: Any, what: str, *, unique: bool = True) -> None:
        queue = self._items.setdefault(key, deque())
        if unique and queue:
            raise PipelineSetupError(f"{what} is handed over twice (key {key}): the lowered schedule is out of order")
        queue.append(value)

    def take(self, key: Hashable, what: str) -> Any:
        """The oldest value left under ``key``; :class:`PipelineSetupError` naming ``what`` when none is."""
        queue = self._items.get(key)
        if not queue:
            raise PipelineSetupError(f"{what} runs before its stage on this process produced it: the lowered "
                                     "schedule is out of order")
        value = queue.popleft()
        if not queue:
            del self._items[key]
        return value

    def receive(self, key: Hashable, buf: torch.Tensor, peer: int) -> _LocalReceive:
        """A receive into ``buf`` of the tensor left under ``key`` by stage ``peer``, taken when waited for."""
        return _LocalReceive(self, key, buf, peer)

    def __len__(self) -> int:
        return sum(len(q) for q in self._items.values())

    def clear(self) -> None:
        self._items.clear()


class _LocalReceive:
    """A receive from a stage of the same process: completes when waited for, if its send came first."""

    def __init__(self, handoff: Handoff, key: Hashable, buf: torch.Tensor, peer: int) -> None:
        self.handoff, self.key, self.buf, self.peer = handoff, key, buf, peer

    def wait(self, timeout: timedelta | None = None) -> bool:
        value = self.handoff.take(self.key, f"a receive from stage {self.peer} on this process")
        self.buf.copy_(value)
        return True


class StageConnection:
    """One stage's view of its process's :class:`~pipedream_ft.pipeline.connection.Connection` (see the module
    docstring): the process's groups, and a messenger of the stage's own, made anew for each epoch's group."""

    def __init__(self, connection: Connection, route: StageRoute, handoff: Handoff) -> None:
        self.connection = connection
        self.route = route
        self.handoff = handoff
        self._messenger: Messenger | None = None

    @property
    def configured(self) -> bool:
        return self.connection.configured

    @property
    def group(self) -> CommGroup:
        return self.connection.group

    @property
    def messenger(self) -> Messenger:
        group = self.connection.group
        m = self._messenger
        if m is None or m.group is not group:
            m = self._messenger = Messenger(group, self.connection.timeout_s, route=self.route, handoff=self.handoff)
        return m

    @property
    def device(self) -> torch.device:
        return self.connection.device

    def flush(self) -> None:
        """Wait for this stage's sends to complete."""
        if self.connection.configured and self._messenger is not None:
            self._messenger.flush()

    def forget(self) -> None:
        """Drop the messenger (its group is gone) and anything handed over."""
        self._messenger = None
        self.handoff.clear()
