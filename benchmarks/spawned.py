"""The benchmarks' worlds of spawned ranks: start them (:func:`run_world`) and collect what each reports
(:func:`gather`; each rank puts ``(rank, ok, payload)`` on a queue)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Sequence

__all__ = ["gather", "run_world"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_world(fn: Callable[..., Any], args: tuple, world: int, timeout_s: float, what: str) -> list[Any]:
    """Spawn ``world`` ranks on this machine (torch.distributed's environment set, one thread each), run
    ``fn(*args)`` in every one (a module-level function, so that it pickles) and return their results in rank
    order (see :func:`gather`)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, args, r, world, port, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return gather(procs, q, timeout_s, what)


def _entry(fn: Callable[..., Any], args: tuple, rank: int, world: int, port: int, q: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1"})
    try:
        q.put((rank, True, fn(*args)))
    except BaseException:  # report everything to the parent, SystemExit included
        q.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def gather(procs: Sequence[Any], q: Any, timeout_s: float, what: str) -> list[Any]:
    """Every rank's payload, in rank order, once all have reported; the processes are joined (killed if they
    outlive the wait). Raises ``TimeoutError`` after ``timeout_s``, ``RuntimeError`` if a rank failed or the
    processes exited without reporting. ``what`` names the job in those messages."""
    world = len(procs)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} timed out after {timeout_s:.0f} s; finished ranks {sorted(results)}")
            try:
                rank, ok, payload = q.get(timeout=1.0)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):
                    raise RuntimeError(f"{what}: ranks exited without reporting: {[p.exitcode for p in procs]}") \
                        from None
                continue
            if not ok:
                raise RuntimeError(f"{what}: rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world)]
