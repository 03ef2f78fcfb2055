"""Collecting what the benchmarks' spawned ranks report (each puts ``(rank, ok, payload)`` on a queue)."""

from __future__ import annotations

import queue
import time
from typing import Any, Sequence

__all__ = ["gather"]


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
