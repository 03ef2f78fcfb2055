"""Process-group start-up that survives torchrun restarts.

Under torchrun's elastic agent the workers share the agent's rendezvous store. Keys a worker group wrote
there outlive it, and with gloo a restarted group can read its predecessor's addresses and fail in
``Gloo connectFullMesh ... Connection refused``. :func:`init_distributed` therefore opens the store itself and
scopes every key by run id and a namespace the group agrees on (:func:`agree_on_round`), so each (re)started
group — after a failure or a change of membership — starts from a clean namespace.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from .env import DistEnv, read_env

__all__ = ["init_distributed", "default_device", "shutdown", "job_store", "agree_on_round"]

log = logging.getLogger(__name__)

_JOB_STORE: dist.Store | None = None


def job_store() -> dist.Store | None:
    """A store shared by every attempt of this job (scoped by run id, not by restart), once joined.

    Under torchrun it lives in the elastic agent and outlives restarts of the worker group, so a restarted
    attempt can read what the failed one recorded (for instance how far it had trained).
    """
    return _JOB_STORE


def default_device(env: DistEnv, backend: str) -> torch.device:
    """``cuda:LOCAL_RANK`` under NCCL, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_distributed(env: DistEnv | None = None, *, backend: str | None = None, timeout_s: float = 120.0) -> DistEnv:
    """Join the default process group (no-op if already joined) and return where this process sits.

    ``backend`` defaults to NCCL when CUDA is available, else gloo. ``timeout_s`` bounds the rendezvous and
    every collective and point-to-point operation of the group.
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
    timeout = timedelta(seconds=timeout_s)
    is_host = env.rank == 0 and not env.use_agent_store
    base = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=is_host, timeout=timeout,
                         wait_for_workers=False)
    global _JOB_STORE
    _JOB_STORE = dist.PrefixStore(f"pipedream_ft/{env.run_id}/job/", base)
    round_id = agree_on_round(dist.PrefixStore(f"pipedream_ft/{env.run_id}/round/", base), env.rank,
                              env.world_size, timeout_s)
    store = dist.PrefixStore(f"pipedream_ft/{env.run_id}/{round_id}/", base)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    log.info("rank %d/%d joined (%s, restart %d)", env.rank, env.world_size, backend, env.restart_count)
    return env


def agree_on_round(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> str:
    """A fresh namespace that every worker of this group, and no earlier group, uses.

    torchrun's restart count cannot serve: it is per agent, and after a membership change the agents' counts
    differ. Instead rank 0 draws a random id and hands it to each rank through a key named after a token that
    rank drew itself, so a key left by an earlier group can never be mistaken for this group's:

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


def shutdown() -> None:
    """Leave the process group if joined."""
    if dist.is_initialized():
        dist.destroy_process_group()
