"""In-place recovery, orchestrated: what a rank does when a peer fails, and what a replacement does to join.

:mod:`~pipedream_ft.ft.recovery` forms epochs (who is in, which cut); this module drives one rank through a
recovery, over the pipeline's side of it — a narrow protocol (:class:`Rebuildable`) the trainer implements:

1. ``release()``: let go of the failed epoch's groups and of every pending operation on them;
2. form the next epoch with every rank and load the cut it agrees on from the fastest checkpoint tier (a cut
   this rank cannot load is reported, and the next epoch is formed without it);
3. ``rebuild(store, cancelled)``: build and attach the new epoch's groups (given up, and the next epoch
   formed, when a peer fails meanwhile);
4. ``restore(part)``: put the cut's state in place; the checkpointer then goes on from that cut;
5. ``rewind(cut)``: training goes on from the cut (losses after it forgotten, stage 0's source read again).

A replacement process runs steps 2 to 4 when it starts (:meth:`InPlace.join`).
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from typing import Any, Callable, Protocol

from ..env import DistEnv
from ..checkpoint import CheckpointError
from ..errors import say
from ..pipeline.group import GroupError
from ..pipeline.hooks import Hooks
from .coordination import Coordinator, LiveGroup
from .faults import FaultInjector
from .recovery import Formed, Heartbeat, Membership, store_connection

__all__ = ["InPlace", "Rebuildable"]

log = logging.getLogger(__name__)


class Rebuildable(Protocol):
    """The pipeline's side of a recovery (see the module docstring)."""

    def release(self) -> None: ...

    def rebuild(self, store: Any, cancelled: Callable[[], bool]) -> None: ...

    def restore(self, part: dict[str, Any]) -> None: ...

    def rewind(self, cut: int) -> None: ...


class InPlace:
    """This rank's part in in-place recovery: its membership of the epochs, its heartbeat, and its records."""

    def __init__(self, env: DistEnv, *, coordinator: Coordinator, checkpointer: Any, faults: FaultInjector,
                 hooks: Hooks, fingerprint: str, timeout_s: float, recovery_timeout_s: float, hang_s: float) -> None:
        self.env = env
        self.coordinator = coordinator
        self.ckpt = checkpointer
        self.faults = faults
        self.hooks = hooks
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.recovery_timeout_s = recovery_timeout_s
        self.hang_s = hang_s
        self.membership: Membership | None = None
        self.heartbeat: Heartbeat | None = None
        self.bad_cuts: set[int] = set()
        """Cuts this rank failed to load: left out of the epochs it joins from then on."""
        self.records: list[dict[str, Any]] = []
        """One per recovery this process took part in: wall-clock times of the failure, the group formed again,
        the state restored (and, set by the trainer's hooks, the first update after it); the epoch and the cut."""

    def enter(self, round_id: str) -> LiveGroup:
        """Take part in the live round ``round_id``: membership of its epochs, and a heartbeat."""
        env = self.env
        live = self.coordinator.live_group(round_id)
        self.membership = Membership(live, rank=env.rank, world_size=env.world_size, incarnation=env.incarnation,
                                     fingerprint=self.fingerprint, timeout_s=self.recovery_timeout_s,
                                     on_join=lambda epoch: self.faults.at_join(env.restart_count + epoch))
        # what exists now lives as long as the process: set it aside from garbage collection, so that a recovery's
        # gc.collect() (and Python's own full collections), which hold the GIL and with it the heartbeat thread, only
        # look at what came later (a full collection over torch's objects takes about a second)
        gc.freeze()
        # the heartbeat thread has a store connection of its own: a wait of the training thread's (a process group
        # being connected) must not hold up its beats or its watch over the peers'
        beats = LiveGroup(store_connection(env, self.recovery_timeout_s), env.run_id, round_id,
                          key=self.coordinator.secret())
        self.heartbeat = Heartbeat(beats, env.rank, env.incarnation, world_size=env.world_size, hang_s=self.hang_s)
        return live

    def join(self, pipeline: Rebuildable, round_id: str, record: dict[str, Any]) -> Formed:
        """A replacement process: join the running group's next epoch and restore the cut it agrees on."""
        self.enter(round_id)
        formed = self.form_and_restore(pipeline, record)
        log.warning("rank %d: replacement process %d joined epoch %d at cut %d", self.env.rank, self.env.incarnation,
                    formed.epoch, formed.cut)
        return formed

    @property
    def epoch(self) -> int:
        return self.membership.epoch if self.membership is not None else 0

    def form_and_restore(self, pipeline: Rebuildable, record: dict[str, Any]) -> Formed:
        """Form the next epoch with every rank, restore the cut it agrees on, and build its groups. The times the
        group was formed and the state restored go to ``record``."""
        assert self.membership is not None and self.heartbeat is not None
        ckpt, membership = self.ckpt, self.membership
        while True:
            record.setdefault("joining", time.time())
            formed = membership.form(lambda: [c for c in ckpt.restorable_cuts() if c not in self.bad_cuts],
                                     lambda: ckpt.last_saved)
            record["formed"] = time.time()
            part: dict[str, Any] | None = None
            try:
                part = ckpt.load(formed.cut)
            except CheckpointError as exc:
                log.warning("rank %d: cannot restore cut %d: %s", self.env.rank, formed.cut, exc)
                self.bad_cuts.add(formed.cut)
            if not membership.confirm(formed, part is not None):
                continue
            assert part is not None
            # the groups connect through a store connection of their own: a connection given up (a peer failed
            # meanwhile) may wait out timeout_s in the store, and must not hold up this process's other requests
            epoch = self.coordinator.live_epoch(membership.live.round_id, formed.epoch,
                                                store_connection(self.env, self.timeout_s))
            beats = self.heartbeat.live  # not the connection the groups are being connected through
            self.faults.at_join(self.env.restart_count + formed.epoch, "connect")
            try:
                pipeline.rebuild(epoch.store, lambda: beats.failures() > formed.epoch)
            except GroupError as exc:  # a peer failed meanwhile: form the next epoch
                log.warning("rank %d: epoch %d failed while connecting: %s", self.env.rank, formed.epoch, exc)
                membership.live.report_failure(formed.epoch)
                continue
            pipeline.restore(part)
            self.faults.set_attempt(self.env.restart_count + formed.epoch)  # before restored() may write a part
            ckpt.restored(formed.cut, durable=formed.durable)
            return formed

    def peer_failed(self) -> bool:
        """Whether a failure was counted in the group since this rank's epoch formed (one store read, on the
        heartbeat's connection)."""
        assert self.membership is not None and self.heartbeat is not None
        return self.heartbeat.live.failures() > self.membership.epoch

    def recover(self, pipeline: Rebuildable, failure: str) -> tuple[Formed, dict[str, Any]]:
        """A peer failed: fall back to the newest cut every rank can restore and go on, in place. Returns the epoch
        formed and this recovery's record."""
        assert self.membership is not None
        record: dict[str, Any] = {"failed": time.time(), "epoch": self.membership.epoch}
        self.records.append(record)
        say(f"pipedream-ft: rank {self.env.rank}: {failure}; recovering in place")
        self.hooks.on_event("failure", reason=failure, epoch=self.membership.epoch)
        self.membership.report_failure()
        pipeline.release()
        formed = self.form_and_restore(pipeline, record)
        record.update(epoch=formed.epoch, cut=formed.cut)
        pipeline.rewind(formed.cut)
        record["restored"] = time.time()
        seconds = record["restored"] - record["failed"]
        self.hooks.on_event("recovered", epoch=formed.epoch, cut=formed.cut, seconds=seconds)
        log.warning("rank %d: recovered in place in %.2fs: epoch %d, continuing from minibatch %d", self.env.rank,
                    seconds, formed.epoch, formed.cut)
        if self.env.rank == 0:
            replaced = sorted(r for r, rec in formed.records.items() if rec["incarnation"] > 0)
            say(f"pipedream-ft: recovered in place in {seconds:.2f}s (epoch {formed.epoch}; processes replaced so "
                f"far: ranks {replaced}); continuing from checkpoint {formed.cut}", sys.stdout)
        return formed, record

    def close(self) -> None:
        """Stop beating (saying so first: a finished process is not a hung one)."""
        if self.heartbeat is not None:
            self.heartbeat.close()
