"""In-place recovery: the ranks that did not fail keep their processes; the failed rank's replacement joins them.

**Epochs.** A group runs in *epochs*: epoch ``k`` is the group formed after ``k`` failures (the counter lives in
the job's store, see :class:`~pipedream_ft.ft.coordination.LiveGroup`). A rank that sees epoch ``k`` fail —
a peer's connection closing, a wait timing out, or its supervisor reporting that its process died — counts the
failure once (``k -> k + 1``) and *joins* the next epoch with a record of what it can restore: the cuts of
every checkpoint tier that hold its part (its node's shared memory, a peer's copy, the durable storage). A
replacement process, started by the dead rank's supervisor with the torch modules already imported, joins the
same way.

**Forming.** Once every rank has joined epoch ``j`` one of them settles it as *formed* (an atomic
compare-and-set: a failure reported meanwhile settles it *failed* instead, and everybody joins the next one);
all ranks then roll back to the newest cut that *every* rank can restore and build the epoch's process groups.
A rank that does not join and whose heartbeat has stopped (``SIGSTOP``, a deadlock) is *evicted*: its
supervisor kills it and starts a replacement. A replacement started with another plan, model or checkpoint
location (another *fingerprint*) stops the recovery with one line naming it.

**Hangs.** Every rank's heartbeat thread also watches its peers' heartbeats (see :class:`Heartbeat`): a process
whose heartbeat stops for ``hang_s`` (0.8 s) is evicted at once, whatever the operations' ``timeout_s``, so a long
timeout for slow collectives does not slow the recovery from a hang. The thread has a store connection of its
own, and the process's long-lived objects are frozen out of garbage collection (a full collection holds the GIL
for about a second): a healthy rank that waits — in a collective, or connecting an epoch's groups — keeps beating.
Connecting an epoch's groups gives up as soon as the epoch fails (a peer died meanwhile), instead of waiting out
``timeout_s`` for a peer that will never come.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from ..env import DistEnv
from ..errors import EXIT_RECOVERY_FAILED, PipelineError
from .coordination import FAILED, FORMED, KEY_HEARTBEAT, LiveGroup

__all__ = ["Formed", "Heartbeat", "Membership", "RecoveryFailed", "store_connection"]

log = logging.getLogger(__name__)

_KEY_ENDED = KEY_HEARTBEAT + "/ended"
"""The incarnation of ``rank``'s process that closed its heartbeat (it finished)."""


class RecoveryFailed(PipelineError):
    """The group could not be formed again (a rank never came back, nothing every rank can restore, or a
    replacement that does not match); the processes stop and a full restart (torchrun) takes over."""

    exit_code = EXIT_RECOVERY_FAILED


@dataclass(frozen=True, slots=True)
class Formed:
    """An epoch every rank agreed on."""

    epoch: int
    cut: int
    """The newest cut every rank can restore: where training continues."""
    records: dict[int, dict[str, Any]]
    """Every rank's join record (incarnation, cuts, fingerprint, newest durable cut)."""

    @property
    def durable(self) -> bool:
        """Some rank saved :attr:`cut` to the durable tier: the cut is a durable checkpoint of this history, and a
        rank whose part of it is not there (a replacement; a process that died before its write ended) writes it
        from the restored state, or the commit would wait for it in vain."""
        return any(rec.get("durable", -1) == self.cut for rec in self.records.values())


class Heartbeat:
    """This rank's heartbeat, and its watch over its peers' (see the module docstring's *Hangs*).

    A thread writes ``(time, incarnation)`` to the store every ``interval_s``, through a store connection of
    its own (``live`` must not share its connection with the training thread: a thread blocked in a store wait,
    such as the construction of a process group waiting for a dead peer's address, would hold up every other
    request on that connection, and a healthy rank would look silent). The same thread reads the peers'
    heartbeats: a peer whose newest process's heartbeat has not changed for ``hang_s`` (measured on this rank's
    clock, so clocks need not agree) is *evicted*: its supervisor kills it, its connections close, and every rank
    fails over at once instead of waiting for an operation's ``timeout_s``. A slow rank is not hung: its
    heartbeat thread keeps beating during a long computation. ``close`` removes the heartbeat, so a rank that
    finished is not taken for a hung one."""

    def __init__(self, live: LiveGroup, rank: int, incarnation: int, *, world_size: int = 0,
                 interval_s: float = 0.1, hang_s: float = 0.8) -> None:
        if hang_s <= 2 * interval_s:
            raise ValueError(f"hang_s must exceed two heartbeat intervals ({hang_s} <= 2 x {interval_s})")
        self.live = live
        self.rank = rank
        self.incarnation = incarnation
        self.world_size = world_size
        """Watch ranks ``0 .. world_size - 1`` (``0``: beat only)."""
        self.interval_s = interval_s
        self.hang_s = hang_s
        self.evictions: list[tuple[int, int]] = []
        """``(rank, incarnation)`` of every peer this rank evicted."""
        self._seen: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self.live.heartbeat(rank, incarnation)
        self._thread = threading.Thread(target=self._run, name="pipedream-ft-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.live.heartbeat(self.rank, self.incarnation)
                if self.world_size:
                    self._watch()
            except Exception:  # the store went away: the job is ending
                return

    def _watch(self) -> None:
        now = time.monotonic()
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = KEY_HEARTBEAT.format(rank=rank)
            value = self.live.store.get(key).decode() if self.live.store.check([key]) else None
            seen = self._seen.get(rank)
            if value is None or seen is None or seen[0] != value:
                self._seen[rank] = (value or "", now)
                continue
            if now - seen[1] < self.hang_s:
                continue
            incarnation = int(value.split()[1])
            if self.live.replacement(rank)[0] != incarnation or self.live.evicted(rank) == incarnation or \
                    self._ended(rank) == incarnation:
                continue  # a newer process is starting, this one is on its way out, or it finished
            log.warning("rank %d (process %d) stopped beating %.1fs ago; asking its supervisor to replace it",
                        rank, incarnation, now - seen[1])
            self.evictions.append((rank, incarnation))  # recorded first: the record never lags the store
            self.live.evict(rank, incarnation)

    def _ended(self, rank: int) -> int | None:
        key = _KEY_ENDED.format(rank=rank)
        return int(self.live.store.get(key)) if self.live.store.check([key]) else None

    def close(self) -> None:
        """Stop beating, saying so first: the peers must not take a process that finished for a hung one."""
        try:
            self.live.store.set(_KEY_ENDED.format(rank=self.rank), str(self.incarnation))
        except Exception:  # the store is gone: nobody is left to watch
            pass
        self._stop.set()
        self._thread.join(timeout=2)


def store_connection(env: DistEnv, timeout_s: float) -> dist.Store:
    """A new connection to the job's store, for a thread or a wait that must not hold up this process's other
    requests (a store connection serves one request at a time: see :class:`Heartbeat`)."""
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class Membership:
    """This rank's side of forming epochs (see the module docstring)."""

    def __init__(self, live: LiveGroup, *, rank: int, world_size: int, incarnation: int, fingerprint: str,
                 timeout_s: float, stale_s: float = 2.0, startup_grace_s: float = 60.0, poll_s: float = 0.005,
                 on_join: Callable[[int], None] | None = None) -> None:
        self.live = live
        self.rank = rank
        self.world_size = world_size
        self.incarnation = incarnation
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.stale_s = stale_s
        self.startup_grace_s = startup_grace_s
        self.poll_s = poll_s
        self.on_join = on_join
        """Called with the epoch after each join (fault injection uses it)."""
        self.epoch = 0
        """The epoch this rank runs in (or last ran in)."""

    def report_failure(self) -> None:
        """Count the failure of the current epoch (idempotent across ranks)."""
        self.live.report_failure(self.epoch)

    def form(self, cuts: Callable[[], list[int]], durable: Callable[[], int] = lambda: -1) -> Formed:
        """Join the newest epoch and wait until it is formed; returns it with the agreed cut. ``cuts()`` lists
        the cuts this rank can restore (asked again at every attempt); ``durable()`` is the newest cut this rank
        saved to the durable tier (-1: none), so the others learn whether the agreed cut is one the durable tier
        waits for (see :attr:`Formed.durable`). Raises :class:`RecoveryFailed`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            epoch = self.live.failures()
            mine = sorted(set(cuts()))
            self.live.running(self.rank, epoch)  # a death from now on fails this epoch
            self.live.join(epoch, self.rank, {"incarnation": self.incarnation, "cuts": mine,
                                             "fingerprint": self.fingerprint, "durable": durable()})
            if self.on_join is not None:
                self.on_join(epoch)
            formed = self._wait_formed(epoch, deadline)
            if formed is not None:
                self.epoch = epoch
                return formed

    def confirm(self, formed: Formed, ok: bool) -> bool:
        """Tell the others whether this rank restored ``formed.cut``, and wait for theirs: ``True`` if every rank
        did; otherwise the epoch is counted failed (the caller forms the next one, without the bad cut)."""
        epoch = formed.epoch
        self.live.confirm(epoch, self.rank, ok)
        deadline = time.monotonic() + self.timeout_s
        while True:
            got = self.live.confirmations(epoch, self.world_size)
            if not all(got.values()) or self.live.failures() > epoch:
                self.live.report_failure(epoch)
                return False
            if len(got) == self.world_size:
                return True
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in got]
                raise RecoveryFailed(f"ranks {missing} did not restore cut {formed.cut} within {self.timeout_s:.0f}s")
            time.sleep(self.poll_s)

    def _wait_formed(self, epoch: int, deadline: float) -> Formed | None:
        next_eviction_check = 0.0
        while True:
            decision = self.live.decision(epoch)
            if decision == FAILED or self.live.failures() > epoch:
                return None
            records = self.live.joined(epoch, self.world_size)
            if decision is None and len(records) == self.world_size:
                decision = self.live.decide(epoch, FORMED)
            if decision == FORMED:
                records = self.live.joined(epoch, self.world_size)
                return Formed(epoch, self._agree(epoch, records), records)
            if decision == FAILED:
                return None
            now = time.monotonic()
            if now > deadline:
                missing = [r for r in range(self.world_size) if r not in records]
                raise RecoveryFailed(f"the group could not be formed again within {self.timeout_s:.0f}s: "
                                     f"ranks {missing} did not come back (epoch {epoch})")
            if now >= next_eviction_check:
                next_eviction_check = now + 0.1
                self._evict_the_silent(epoch, records)
            time.sleep(self.poll_s)

    def _evict_the_silent(self, epoch: int, records: dict[int, dict[str, Any]]) -> None:
        """Ask the supervisors of ranks that have not joined and have stopped beating to replace them."""
        for rank in range(self.world_size):
            if rank in records:
                continue
            started, since_started = self.live.replacement(rank)
            beat = self.live.last_heartbeat(rank)
            if beat is not None and beat[1] == started:
                silent = beat[0] > self.stale_s
            else:  # the newest process has not beaten yet: give it time to start
                silent = since_started > self.startup_grace_s
            if silent and self.live.evicted(rank) != started:
                log.warning("rank %d (process %d) stopped answering; asking its supervisor to replace it",
                            rank, started)
                self.live.evict(rank, started)

    def _agree(self, epoch: int, records: dict[int, dict[str, Any]]) -> int:
        prints = {r: rec["fingerprint"] for r, rec in records.items()}
        usual = Counter(prints.values()).most_common(1)[0][0]
        odd = sorted(r for r, fp in prints.items() if fp != usual)
        if odd:
            raise RecoveryFailed(f"ranks {odd} run another plan, model or checkpoint location than the others "
                                 f"(fingerprint {prints[odd[0]][:12]} instead of {usual[:12]}); they cannot join "
                                 "this group")
        common = set(records[0]["cuts"])
        for rec in records.values():
            common &= set(rec["cuts"])
        if not common:
            # the start of training is itself a memory-tier cut (see PipelineTrainer.train): only a job without the
            # memory tier and with no committed durable cut yet, or with parts that do not verify, gets here
            raise RecoveryFailed(f"no checkpoint cut that every rank can restore (epoch {epoch}: "
                                 + "; ".join(f"rank {r}: {rec['cuts'][-3:]}" for r, rec in sorted(records.items()))
                                 + "); in-place recovery restores from the memory tier (CheckpointConfig.memory_policy)"
                                 " or a committed durable checkpoint")
        return max(common)
