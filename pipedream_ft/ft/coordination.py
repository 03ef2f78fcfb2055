"""The job's store: every key the runtime keeps there, and the namespaces its process groups are built in.

Under torchrun every worker connects to the elastic agent's store (``MASTER_ADDR:MASTER_PORT``), which outlives
the workers; without an agent, rank 0 hosts it. Keys a worker group writes there outlive the group, and with
gloo a restarted group could read its predecessor's addresses and fail in ``Gloo connectFullMesh ... Connection
refused``. So nothing is written at the top level:

* ``pipedream_ft/<run>/job/`` — the *job* namespace, shared by every attempt: how far training got
  (``progress``, ``loss``), read by a restarted attempt to say how much work it redoes.
* ``pipedream_ft/<run>/round/`` — the handshake that gives every (re)started group a fresh *epoch* namespace
  (:func:`agree_on_round`); torchrun's restart count cannot serve, since after a membership change the agents'
  counts differ.
* ``pipedream_ft/<run>/<epoch>/`` — one epoch: its process groups (``world/``, ``replica/...``, ``link/...``),
  the preemption notice (``preempted``) and the end-of-run rendezvous (``finished/<position>``).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..env import DistEnv, read_env

__all__ = ["Coordinator", "Epoch", "agree_on_round", "base_store", "init_distributed", "job_store", "shutdown"]

log = logging.getLogger(__name__)

KEY_PROGRESS = "progress"
KEY_LOSS = "loss"
KEY_PREEMPTED = "preempted"
KEY_FINISHED = "finished/{position}"

_BASE: dist.Store | None = None
_BASE_ADDR: tuple[str, int] | None = None


def base_store(env: DistEnv, timeout_s: float) -> dist.Store:
    """This process's connection to the job's store (one per process, reused by every epoch)."""
    global _BASE, _BASE_ADDR
    addr = (env.master_addr, env.master_port)
    if _BASE is None or _BASE_ADDR != addr:
        is_host = env.rank == 0 and not env.use_agent_store
        _BASE = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=is_host,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        _BASE_ADDR = addr
    return _BASE


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

    def new_epoch(self) -> Epoch:
        """Agree with every rank on a fresh namespace for a new group (see :func:`agree_on_round`)."""
        rounds = dist.PrefixStore(f"pipedream_ft/{self.env.run_id}/round/", self.base)
        round_id = agree_on_round(rounds, self.env.rank, self.env.world_size, self.timeout_s)
        self.epoch = Epoch(round_id, dist.PrefixStore(f"pipedream_ft/{self.env.run_id}/{round_id}/", self.base))
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

    def announce_preemption(self) -> None:
        if self.epoch is not None:
            self.epoch.store.set(KEY_PREEMPTED, str(self.env.rank))

    def preemption_announced(self) -> bool:
        if self.epoch is None:
            return False
        try:
            return self.epoch.store.check([KEY_PREEMPTED])
        except Exception:  # a store problem must not stop training
            return False

    # -- leaving together ----------------------------------------------------------------------------------

    def leave_together(self, position: int, timeout_s: float) -> None:
        """Rank 0 says it is done with ``position``; the others wait for that (up to ``timeout_s``)."""
        if self.epoch is None or self.env.world_size == 1:
            return
        key = KEY_FINISHED.format(position=position)
        if self.env.rank == 0:
            self.epoch.store.set(key, "1")
        else:
            self.epoch.store.wait([key], timedelta(seconds=timeout_s))


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
                raise RuntimeError(f"ranks {sorted(pending)} did not join within {timeout_s:.0f}s")
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

