"""The job's store: every key the runtime keeps there, and the namespaces its process groups are built in.

Under torchrun every worker connects to the elastic agent's store (``MASTER_ADDR:MASTER_PORT``), which outlives
the workers; without an agent, rank 0 hosts it. Keys a worker group writes there outlive the group, and with
gloo a restarted group could read its predecessor's addresses and fail in ``Gloo connectFullMesh ... Connection
refused``. So nothing is written at the top level:

* ``pipedream_ft/<run>/job/`` — the *job* namespace, shared by every attempt: how far training got
  (``progress``, ``loss``), read by a restarted attempt to say how much work it redoes; the signature of each
  rank's last unexpected error (``crash/<rank>``) and the line of an error that stopped the job (``stopped``),
  which ends every later attempt at once (see :mod:`pipedream_ft.crashlog`).
* ``pipedream_ft/<run>/round/`` — the handshake that gives every (re)started group a fresh *epoch* namespace
  (:func:`agree_on_round`); torchrun's restart count cannot serve, since after a membership change the agents'
  counts differ.
* ``pipedream_ft/<run>/<epoch>/`` — one epoch: its process groups (``world/``, ``replica/...``, ``link/...``),
  the preemption notice (``preempted``) and the end-of-run rendezvous (``finished/<position>``).
* ``pipedream_ft/<run>/<round>/live/`` — in-place recovery within the group started in ``<round>``
  (:class:`LiveGroup`): the failure counter ``failures`` (epoch ``k`` of the group is the one formed after
  ``k`` failures), each epoch's join records ``e<k>/join/<rank>`` and its decision ``e<k>/decision``, the
  ranks' heartbeats ``hb/<rank>``, and the supervisors' keys ``replacing/<rank>`` and ``evict/<rank>``. Each
  rank's process publishes its group's round in the job namespace for its supervisor, under the supervisor's
  own id (``round/<rank>/<supervisor>``): a supervisor of a later torchrun attempt — or on another node, where
  torchrun's restart counts differ — never reads the round (nor, through it, the ``evict/`` keys) of an
  earlier one.

The store has no authentication: any process that reaches its port can read and write every key. The keys
whose forgery would kill or mislead the job are signed with the job's secret (:mod:`pipedream_ft.ft.secret`;
HMAC-SHA256 over the run, the round or epoch, the rank and the value, so that a record can be neither forged nor
replayed elsewhere): ``evict/<rank>`` (with the evicted incarnation), ``preempted`` and ``job-error``. A record
that does not verify is ignored and logged once. The other keys are not signed: an outsider can still disturb a
job by writing them (a forged ``decision`` or ``failures``, join records, heartbeats), or read them.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ..checkpoint.private import mac
from ..env import DistEnv, read_env
from .ending import FINISHED, Ending, keys_set
from .secret import job_secret
from ..errors import PipelineError
from ..pipeline.group import GroupError, PeerTimeoutError

__all__ = ["Coordinator", "Epoch", "LiveGroup", "agree_on_round", "base_store", "init_distributed", "job_store",
           "previous_crash", "record_crash", "round_owner", "shutdown", "stop_job", "stopped_job"]

log = logging.getLogger(__name__)

KEY_PROGRESS = "progress"
KEY_LOSS = "loss"
KEY_PREEMPTED = "preempted"
KEY_JOB_ERROR = "job-error"
KEY_FINISHED = "finished/{position}"
KEY_ROUND = "round/{rank}/{owner}"
KEY_CRASH = "crash/{rank}"
KEY_STOPPED = "stopped"
KEY_JOB_ID = "id"
KEY_MEMORY_DONE = "memory/{plan}/{rank}"
KEY_MEASURE = "measure/{plan}/{rank}"
KEY_PEER = "peer/{rank}"
KEY_AT = "at/{rank}"
KEY_FAILURES = "failures"
KEY_JOIN = "e{epoch}/join/{rank}"
KEY_DECISION = "e{epoch}/decision"
KEY_LOADED = "e{epoch}/loaded/{rank}"
KEY_HEARTBEAT = "hb/{rank}"
KEY_REPLACING = "replacing/{rank}"
KEY_EVICT = "evict/{rank}"
FORMED = "formed"
FAILED = "failed"

_BASE: dist.Store | None = None
_BASES: dict[tuple[str, int, int, int], dist.Store] = {}


def base_store(env: DistEnv, timeout_s: float) -> dist.Store:
    """This rank's connection to the job's store (one per rank of a process, reused by every epoch; a forked
    process opens its own: two processes must never share one connection). The stages of one process (virtual
    stages, see :mod:`pipedream_ft.virtual`) are ranks of their own, each with its own connection: one that
    waits for a key holds its connection meanwhile."""
    global _BASE
    addr = (env.master_addr, env.master_port, os.getpid(), env.rank)
    if addr not in _BASES:
        if _BASES and next(iter(_BASES))[2] != os.getpid():
            _BASES.clear()  # the parent's, before a fork
        is_host = env.rank == 0 and not env.use_agent_store
        _BASES[addr] = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=is_host,
                                     timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        if len(_BASES) == 1:
            _BASE = _BASES[addr]  # the process's first
    return _BASES[addr]


def job_store(env: DistEnv | None = None, timeout_s: float = 60.0) -> dist.Store | None:
    """The job namespace (shared by every attempt), or ``None`` if this process has not joined a job."""
    if _BASE is None and env is None:
        return None
    env = env or read_env()
    return dist.PrefixStore(f"pipedream_ft/{env.run_id}/job/", base_store(env, timeout_s))


@dataclass(frozen=True, slots=True)
class Epoch:
    """One incarnation of the group: its id and its store namespace."""

    id: str
    store: dist.Store


class Coordinator:
    """This rank's view of the job's store: epochs, progress reports, preemption notices, leaving together."""

    def __init__(self, env: DistEnv, timeout_s: float) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.base = base_store(env, timeout_s)
        self.job = dist.PrefixStore(f"pipedream_ft/{env.run_id}/job/", self.base)
        self.epoch: Epoch | None = None
        self._secret: bytes | None = None
        self._forgeries: set[bytes] = set()

    def new_epoch(self) -> Epoch:
        """Agree with every rank on a fresh namespace for a new group (see :func:`agree_on_round`)."""
        rounds = dist.PrefixStore(f"pipedream_ft/{self.env.run_id}/round/", self.base)
        round_id = agree_on_round(rounds, self.env.rank, self.env.world_size, self.timeout_s)
        self.epoch = Epoch(round_id, dist.PrefixStore(f"pipedream_ft/{self.env.run_id}/{round_id}/", self.base))
        return self.epoch

    def secret(self) -> bytes:
        """The job's key, the same in every process of the job (see :mod:`pipedream_ft.ft.secret`)."""
        if self._secret is None:
            self._secret = job_secret(job_id=self.job_id(), store=self.job,
                                      single_node=self.env.ranks_per_node >= self.env.world_size,
                                      store_outlives_attempts=self.env.use_agent_store)
        return self._secret

    def job_id(self) -> str | None:
        """An id of this job, the same for every process of every attempt: it scopes what the job keeps on its
        nodes (the memory tier). Under torchrun's agent store, a random id kept in that store (it lives as long
        as the job); otherwise torchrun's ``--rdzv-id`` if one was given (a later job with the same id and plan
        finds what a crashed one left); otherwise ``None`` (no store outlives an attempt: no memory tier)."""
        if self.env.use_agent_store:
            return self.job.compare_set(KEY_JOB_ID, "", uuid.uuid4().hex[:16]).decode()
        if self.env.run_id not in ("", "none"):
            return "run-" + self.env.run_id
        return None

    def memory_done(self, plan: str, cut: int) -> None:
        """This rank's memory-tier part of ``cut`` (of plan ``plan``) is stored: older cuts may go once every
        rank has said so for a newer one."""
        self.job.set(KEY_MEMORY_DONE.format(plan=plan[:16], rank=self.env.rank), str(cut))

    def memory_floor(self, plan: str) -> int | None:
        """The newest cut every rank has stored in the memory tier (``None`` until every rank has one)."""
        keys = [KEY_MEMORY_DONE.format(plan=plan[:16], rank=r) for r in range(self.env.world_size)]
        if not self.job.check(keys):
            return None
        return min(int(self.job.get(k)) for k in keys)

    def publish_peer_server(self, host: str, port: int) -> None:
        """Where this rank's process serves its node's memory tier to its peers (see :mod:`pipedream_ft.checkpoint.peer`)."""
        self.job.set(KEY_PEER.format(rank=self.env.rank), f"{host}:{port}")

    def peer_server(self, rank: int) -> tuple[str, int] | None:
        """Where ``rank``'s process serves its node's memory tier, once it has said so."""
        key = KEY_PEER.format(rank=rank)
        if not self.job.check([key]):
            return None
        host, _, port = self.job.get(key).decode().rpartition(":")
        return host, int(port)

    def publish_measurement(self, plan: str, value: str, slot: int | None = None) -> None:
        """This rank's latest measured costs under plan ``plan`` (see :mod:`pipedream_ft.ft.replan`); ``slot``:
        where to file them instead of under the rank (a process of several stages files each under its stage)."""
        self.job.set(KEY_MEASURE.format(plan=plan[:16], rank=self.env.rank if slot is None else slot), value)

    def measurements(self, plan: str, slots: Iterable[int] | None = None) -> dict[int, str]:
        """Every rank's (or ``slots``') latest published measurement under plan ``plan``, by rank (ranks without
        one left out)."""
        out = {}
        for r in (range(self.env.world_size) if slots is None else slots):
            key = KEY_MEASURE.format(plan=plan[:16], rank=r)
            if self.job.check([key]):
                out[r] = self.job.get(key).decode()
        return out

    def live_group(self, round_id: str) -> LiveGroup:
        """The in-place recovery keys of the group started in ``round_id``; published for this rank's supervisor."""
        self.job.set(KEY_ROUND.format(rank=self.env.rank, owner=round_owner(self.env)), round_id)
        return LiveGroup(self.base, self.env.run_id, round_id, key=self.secret())

    def live_epoch(self, round_id: str, epoch: int, connection: dist.Store | None = None) -> Epoch:
        """The namespace of epoch ``epoch`` of the group started in ``round_id`` (its process groups live there),
        through ``connection`` (a store connection of its own, default: this process's)."""
        self.epoch = Epoch(f"{round_id}-e{epoch}",
                           dist.PrefixStore(f"pipedream_ft/{self.env.run_id}/{round_id}/live/e{epoch}/",
                                            connection or self.base))
        return self.epoch

    # -- progress (job namespace) ----------------------------------------------------------------------------

    def report_progress(self, done: int, loss: float | None) -> None:
        self.job.set(KEY_PROGRESS, str(done))
        if loss is not None:
            self.job.set(KEY_LOSS, repr(loss))

    def progress(self) -> int | None:
        """How far the job got (the last report of any attempt), or ``None``."""
        try:
            return int(self.job.get(KEY_PROGRESS)) if self.job.check([KEY_PROGRESS]) else None
        except Exception:  # the store is informational here
            return None

    def last_loss(self) -> float | None:
        try:
            return float(self.job.get(KEY_LOSS)) if self.job.check([KEY_LOSS]) else None
        except Exception:  # the display must not stop training
            return None

    # -- preemption (epoch namespace) ----------------------------------------------------------------------

    def _signed(self, what: str, text: str) -> str:
        """``text`` signed for this epoch with the job's secret (see :meth:`_verified`)."""
        assert self.epoch is not None
        return f"{mac(self.secret(), 'pipedream-ft', what, self.env.run_id, self.epoch.id, text)} {text}"

    def _verified(self, what: str, raw: bytes) -> str | None:
        """The text of a record :meth:`_signed` for this epoch; ``None`` (logged once) if it was forged by
        someone without the job's secret, or replayed from another epoch or job."""
        sig, _, text = raw.decode(errors="replace").partition(" ")
        if hmac.compare_digest(self._signed(what, text).partition(" ")[0].encode(), sig.encode()):
            return text
        if raw not in self._forgeries:
            self._forgeries.add(raw)
            log.warning("rank %d: ignoring a %s record not signed with the job's secret (%r): forged, or from "
                        "another job", self.env.rank, what, raw[:80])
        return None

    def announce_preemption(self) -> None:
        if self.epoch is not None:
            self.epoch.store.set(KEY_PREEMPTED, self._signed(KEY_PREEMPTED, str(self.env.rank)))

    def preemption_announced(self) -> bool:
        if self.epoch is None:
            return False
        try:
            if not self.epoch.store.check([KEY_PREEMPTED]):
                return False
            return self._verified(KEY_PREEMPTED, self.epoch.store.get(KEY_PREEMPTED)) is not None
        except Exception:  # a store problem must not stop training
            return False

    # -- an error that ends the job (epoch namespace) --------------------------------------------------------

    def publish_job_error(self, message: str) -> None:
        """Tell the group that this rank stops on ``message`` (see :class:`~pipedream_ft.errors.JobError`);
        the first one published wins."""
        if self.epoch is not None:
            try:
                self.epoch.store.compare_set(KEY_JOB_ERROR, "",
                                             self._signed(KEY_JOB_ERROR, f"rank {self.env.rank}: {message}"))
            except Exception as exc:  # the store is gone: the peers stop on their own timeouts
                log.warning("could not publish the error to the group: %s", exc)

    def job_error(self) -> str | None:
        """The error a rank of this epoch stopped on, if any."""
        if self.epoch is None:
            return None
        try:
            if self.epoch.store.check([KEY_JOB_ERROR]):
                return self._verified(KEY_JOB_ERROR, self.epoch.store.get(KEY_JOB_ERROR))
        except Exception:
            return None
        return None

    # -- leaving together ----------------------------------------------------------------------------------

    def settle_end(self, position: int, proposal: str) -> str:
        """Settle how this epoch's ranks end ``position`` (see :mod:`pipedream_ft.ft.ending`): ``proposal``, unless
        it is settled already; returns the settled value."""
        if self.epoch is None or self.env.world_size == 1:
            return proposal
        return self.epoch.store.compare_set(KEY_FINISHED.format(position=position), "", proposal).decode()

    def leave_together(self, position: int, ending: Ending, timeout_s: float) -> None:
        """Rank 0 says it is done with ``position``; the others wait for that (up to ``timeout_s``, then
        :class:`PeerTimeoutError`). A peer's failure meanwhile raises :class:`GroupError` (see ``ending``)."""
        if self.epoch is None or self.env.world_size == 1:
            return
        if self.env.rank == 0:
            ending.finish()
            return
        store, key = self.epoch.store, KEY_FINISHED.format(position=position)
        set_ = keys_set(store, [key])

        def settled(seconds: float) -> bool:
            if not set_(seconds):
                return False
            if store.get(key).decode() != FINISHED:  # a peer failed, and another rank settled the end first
                raise GroupError(f"a peer failed while checkpoint {position} was being finished")
            return True

        if not ending.wait(settled, timeout_s):
            raise PeerTimeoutError(f"rank 0 did not finish position {position} within {timeout_s:.0f}s")


class LiveGroup:
    """The store keys of in-place recovery in one group (see the module docstring); shared by the ranks'
    processes and their supervisors. Every method is one or two store operations.

    ``key`` is the job's secret (:mod:`pipedream_ft.ft.secret`): eviction records are signed with it (over the
    run, the round, the rank and the incarnation, so a record cannot be forged without it nor replayed for
    another process or group), and one that does not verify is ignored (logged once)."""

    def __init__(self, base: dist.Store, run_id: str, round_id: str, *, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("key must be the job's secret (at least 16 bytes)")
        self.run_id = run_id
        self.round_id = round_id
        self.key = key
        self.store = dist.PrefixStore(f"pipedream_ft/{run_id}/{round_id}/live/", base)
        self._forgeries: set[bytes] = set()

    @staticmethod
    def published_round(base: dist.Store, run_id: str, rank: int, owner: str) -> str | None:
        """The round that the processes of ``rank`` started by supervisor ``owner`` last published (``None`` if
        none got that far)."""
        job = dist.PrefixStore(f"pipedream_ft/{run_id}/job/", base)
        key = KEY_ROUND.format(rank=rank, owner=owner)
        return job.get(key).decode() if job.check([key]) else None

    # failures and epochs ------------------------------------------------------------------------------------

    def start(self) -> None:
        """At the group's start (every rank; idempotent): no failure so far."""
        self.store.compare_set(KEY_FAILURES, "", "0")

    def failures(self) -> int:
        """Failures noticed so far in this group: the number of the epoch being formed or running."""
        return int(self.store.get(KEY_FAILURES))

    def report_failure(self, seen: int) -> int:
        """Count a failure of epoch ``seen`` (once, however many ranks report it) and settle ``seen`` as
        :data:`FAILED` if it was still forming; returns the new count."""
        self.store.compare_set(KEY_DECISION.format(epoch=seen), "", FAILED)
        return int(self.store.compare_set(KEY_FAILURES, str(seen), str(seen + 1)))

    def running(self, rank: int, epoch: int) -> None:
        """``rank``'s process joins or runs in ``epoch`` (its supervisor reports its death as a failure of that
        epoch)."""
        self.store.set(KEY_AT.format(rank=rank), str(epoch))

    def epoch_of(self, rank: int) -> int:
        key = KEY_AT.format(rank=rank)
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def join(self, epoch: int, rank: int, record: dict[str, Any]) -> None:
        self.store.set(KEY_JOIN.format(epoch=epoch, rank=rank), json.dumps(record))

    def joined(self, epoch: int, world_size: int) -> dict[int, dict[str, Any]]:
        """The join records of ``epoch`` written so far, by rank."""
        out = {}
        keys = [KEY_JOIN.format(epoch=epoch, rank=r) for r in range(world_size)]
        for r, key in enumerate(keys):
            if self.store.check([key]):
                out[r] = json.loads(self.store.get(key))
        return out

    def decide(self, epoch: int, decision: str) -> str:
        """Settle ``epoch`` as :data:`FORMED` or :data:`FAILED` (the first call wins); returns the decision."""
        return self.store.compare_set(KEY_DECISION.format(epoch=epoch), "", decision).decode() or decision

    def decision(self, epoch: int) -> str | None:
        key = KEY_DECISION.format(epoch=epoch)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def confirm(self, epoch: int, rank: int, ok: bool) -> None:
        """Whether ``rank`` restored the agreed cut of ``epoch``."""
        self.store.set(KEY_LOADED.format(epoch=epoch, rank=rank), "1" if ok else "0")

    def confirmations(self, epoch: int, world_size: int) -> dict[int, bool]:
        out = {}
        for r in range(world_size):
            key = KEY_LOADED.format(epoch=epoch, rank=r)
            if self.store.check([key]):
                out[r] = self.store.get(key) == b"1"
        return out

    # liveness ---------------------------------------------------------------------------------------------

    def heartbeat(self, rank: int, incarnation: int) -> None:
        self.store.set(KEY_HEARTBEAT.format(rank=rank), f"{time.time()!r} {incarnation}")

    def last_heartbeat(self, rank: int) -> tuple[float, int] | None:
        """``(seconds since, incarnation)`` of ``rank``'s last heartbeat, or ``None`` if it never beat."""
        key = KEY_HEARTBEAT.format(rank=rank)
        if not self.store.check([key]):
            return None
        when, incarnation = self.store.get(key).decode().split()
        return time.time() - float(when), int(incarnation)

    # supervisors ------------------------------------------------------------------------------------------

    def announce_replacement(self, rank: int, incarnation: int) -> None:
        self.store.set(KEY_REPLACING.format(rank=rank), f"{incarnation} {time.time()!r}")

    def replacement(self, rank: int) -> tuple[int, float]:
        """``(incarnation, seconds since it was started)`` of the newest process a supervisor started for
        ``rank`` (``(0, inf)``: the first one, started with the group)."""
        key = KEY_REPLACING.format(rank=rank)
        if not self.store.check([key]):
            return 0, float("inf")
        incarnation, when = self.store.get(key).decode().split()
        return int(incarnation), time.time() - float(when)

    def _eviction_mac(self, rank: int, incarnation: int) -> str:
        return mac(self.key, "pipedream-ft eviction", self.run_id, self.round_id, rank, incarnation)

    def evict(self, rank: int, incarnation: int) -> None:
        """Ask ``rank``'s supervisor to kill incarnation ``incarnation`` (it stopped answering) and replace it
        (a signed record: ``"<incarnation> <mac>"``)."""
        self.store.set(KEY_EVICT.format(rank=rank), f"{incarnation} {self._eviction_mac(rank, incarnation)}")

    def evicted(self, rank: int) -> int | None:
        """The incarnation of ``rank`` the group evicted, if a genuine record says so; a forged, unsigned or
        replayed record is ignored (and logged once)."""
        key = KEY_EVICT.format(rank=rank)
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        incarnation, _, sig = raw.decode(errors="replace").partition(" ")
        if incarnation.isdigit() and hmac.compare_digest(sig.encode(),
                                                         self._eviction_mac(rank, int(incarnation)).encode()):
            return int(incarnation)
        if raw not in self._forgeries:
            self._forgeries.add(raw)
            log.warning("rank %d: ignoring an eviction record not signed with the job's secret (%r): forged, "
                        "or from another job", rank, raw[:80])
        return None


def round_owner(env: DistEnv) -> str:
    """Whose processes a published round belongs to: the supervisor that started this process, else torchrun's
    attempt (see the module docstring)."""
    return env.supervisor or f"attempt{env.restart_count}"


def _job_keys(env: DistEnv) -> dist.Store | None:
    """The job namespace, when a store outlives the attempt (torchrun's agent hosts it); else ``None``. A
    connection of its own, with a short timeout, so that the process's own (:func:`base_store`) keeps the
    timeout its trainer asks for."""
    if not env.use_agent_store:
        return None
    client = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                           timeout=timedelta(seconds=10), wait_for_workers=False)
    return dist.PrefixStore(f"pipedream_ft/{env.run_id}/job/", client)


def stop_job(env: DistEnv, line: str) -> None:
    """Record that the job stops on ``line`` (an error that any attempt would meet again): every process of a
    later attempt with the same world size exits at once (:func:`stopped_job`). The first record wins."""
    try:
        store = _job_keys(env)
        if store is not None:
            store.compare_set(KEY_STOPPED, "", json.dumps({"world_size": env.world_size, "line": line}))
    except Exception as exc:  # the store is gone: torchrun is ending the job anyway
        log.warning("could not record the error that stops the job: %s", exc)


def stopped_job(env: DistEnv) -> str | None:
    """The line of the error that stopped this job in an earlier attempt of the same world size, if any."""
    try:
        store = _job_keys(env)
        if store is None or not store.check([KEY_STOPPED]):
            return None
        record = json.loads(store.get(KEY_STOPPED))
    except Exception:  # no store: nothing was recorded
        return None
    return record["line"] if record.get("world_size") == env.world_size else None


def previous_crash(env: DistEnv) -> str | None:
    """The signature of the last unexpected error of a process of this rank (:mod:`pipedream_ft.crashlog`)."""
    try:
        store = _job_keys(env)
        key = KEY_CRASH.format(rank=env.rank)
        return store.get(key).decode() if store is not None and store.check([key]) else None
    except Exception:
        return None


def record_crash(env: DistEnv, signature: str) -> None:
    """Keep ``signature`` as this rank's last unexpected error (:mod:`pipedream_ft.crashlog`)."""
    try:
        store = _job_keys(env)
        if store is not None:
            store.set(KEY_CRASH.format(rank=env.rank), signature)
    except Exception as exc:
        log.warning("could not record the crash: %s", exc)


def agree_on_round(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> str:
    """A fresh namespace that every worker of this group, and no earlier group, uses.

    Rank 0 draws a random id and hands it to each rank through a key named after a token that rank drew
    itself, so a key left by an earlier group can never be mistaken for this group's:

    * rank ``r`` writes its token to ``hello/r`` and waits for ``ack/<token>``;
    * rank 0 reads ``hello/r``; a token whose ``done/<token>`` already exists is a finished handshake of an
      earlier group and is cleared (only if unchanged); otherwise it writes ``ack/<token>`` = its id, and
      waits for rank ``r`` to confirm with ``done/<token>``, acknowledging a newer token if ``hello/r`` changes.
    """
    if world_size == 1:
        return uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"hello/{rank}", token)
        store.wait([f"ack/{token}"], timedelta(seconds=timeout_s))
        round_id = store.get(f"ack/{token}").decode()
        store.set(f"done/{token}", "1")
        return round_id
    round_id = uuid.uuid4().hex
    acked: dict[int, str] = {}
    pending = set(range(1, world_size))
    while pending:
        for r in sorted(pending):
            if not store.check([f"hello/{r}"]):
                continue
            token = store.get(f"hello/{r}").decode()
            if not token:
                continue
            if acked.get(r) != token:
                if store.check([f"done/{token}"]):  # an earlier group's finished handshake
                    store.compare_set(f"hello/{r}", token, "")
                    continue
                store.set(f"ack/{token}", round_id)
                acked[r] = token
            if store.check([f"done/{acked[r]}"]):
                pending.discard(r)
        if pending:
            if time.monotonic() > deadline:
                raise PipelineError(f"ranks {sorted(pending)} did not join the group within {timeout_s:.0f}s")
            time.sleep(0.005)
    return round_id


def init_distributed(env: DistEnv | None = None, *, backend: str | None = None, timeout_s: float = 120.0) -> DistEnv:
    """Join torch.distributed's default process group (no-op if already joined); return where this process sits.

    The trainer does not need it (it builds its own groups per epoch); it is for scripts that also use
    ``torch.distributed`` directly. It uses the same store and a fresh epoch namespace, so it works across
    torchrun restarts. ``backend`` defaults to NCCL when CUDA is available, else gloo.
    """
    env = env or read_env()
    if dist.is_initialized():
        return env
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False")
        if env.local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {env.local_rank} has no GPU ({torch.cuda.device_count()} visible)")
        torch.cuda.set_device(env.local_rank)
    coordinator = Coordinator(env, timeout_s)
    epoch = coordinator.new_epoch()
    dist.init_process_group(backend, store=dist.PrefixStore("default/", epoch.store), rank=env.rank,
                            world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    log.info("rank %d/%d joined (%s, restart %d)", env.rank, env.world_size, backend, env.restart_count)
    return env


def shutdown() -> None:
    """Leave torch.distributed's default process group if joined (the trainer's own groups close with it)."""
    if dist.is_initialized():
        dist.destroy_process_group()

