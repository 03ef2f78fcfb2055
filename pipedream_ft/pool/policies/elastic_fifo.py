"""``elastic-fifo`` (Schedulearn's Elastic FIFO): admit in arrival order at ``min_workers``, keep every device
busy by growing elastic jobs up to ``max_workers``, shrink them toward ``min_workers`` to admit a waiting job."""

from __future__ import annotations

from typing import Sequence

from ..job import JobView
from ..policy import order_key

__all__ = ["ElasticFifo"]


def _next_size(j: JobView, n: int) -> int | None:
    for s in j.sizes:
        if s > n:
            return s
    return None


class ElasticFifo:
    """Running jobs stay admitted; waiting jobs are admitted in arrival order while the admitted jobs' minimum
    sizes fit (stopping at the first that does not). The devices left are then dealt one step at a time to the
    admitted job holding the fewest (ties: earlier arrival), up to each job's largest size."""

    def allocate(self, now: float, jobs: Sequence[JobView], devices: int) -> dict[str, int]:
        admitted = sorted((j for j in jobs if j.allocation), key=order_key)
        need = sum(j.sizes[0] for j in admitted)
        for j in sorted((j for j in jobs if not j.allocation), key=order_key):
            if need + j.sizes[0] > devices:
                break
            admitted.append(j)
            need += j.sizes[0]
        alloc = {j.name: j.sizes[0] for j in admitted}
        free = devices - need
        rank = {j.name: k for k, j in enumerate(admitted)}
        growable = list(admitted)
        while free > 0 and growable:
            growable.sort(key=lambda j: (alloc[j.name], rank[j.name]))
            for j in growable:
                nxt = _next_size(j, alloc[j.name])
                if nxt is None or nxt - alloc[j.name] > free:
                    growable.remove(j)
                    break
                free -= nxt - alloc[j.name]
                alloc[j.name] = nxt
                break
        return alloc
