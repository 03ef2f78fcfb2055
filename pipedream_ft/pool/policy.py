"""The policy interface, the built-in policies by name, and user policies by import path.

A policy is a plain object with ``allocate(now, jobs, devices) -> {name: workers}``: given the time, every job
in the pool (waiting or running, as :class:`~pipedream_ft.pool.job.JobView`) and the pool's size, it returns
the allocation it wants (a name left out gets 0). It must be deterministic and may keep no state that the views
do not give back, so that a policy switched in between two rounds starts from the current allocation.
"""

from __future__ import annotations

import importlib
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

from .errors import PoolError
from .job import JobView

__all__ = ["Policy", "POLICIES", "make_policy", "check_allocation", "order_key"]


@runtime_checkable
class Policy(Protocol):
    """``allocate(now, jobs, devices)``: the desired ``{job name: workers}`` (each 0 or one of the job's
    ``sizes``; at most ``devices`` in all)."""

    def allocate(self, now: float, jobs: Sequence[JobView], devices: int) -> dict[str, int]: ...


def order_key(j: JobView) -> tuple[int, float, str]:
    """Higher priority first, then arrival, then name (deterministic ties)."""
    return (-j.priority, j.arrival, j.name)


def _builtins() -> dict[str, Callable[..., Policy]]:
    from .policies.elastic_fifo import ElasticFifo
    from .policies.fifo import Fifo
    from .policies.goodput import Goodput
    from .policies.round_robin import RoundRobin
    from .policies.tiresias import Tiresias

    return {"fifo": Fifo, "elastic-fifo": ElasticFifo, "round-robin": RoundRobin, "tiresias": Tiresias,
            "goodput": Goodput}


POLICIES = ("fifo", "elastic-fifo", "round-robin", "tiresias", "goodput")


def make_policy(spec: str, **options: object) -> Policy:
    """A built-in policy by name (``options`` that its constructor takes are passed), or ``package.module:Class``
    (constructed with no arguments)."""
    if ":" in spec:
        mod_name, _, cls_name = spec.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except Exception as exc:  # noqa: BLE001 - any import failure is the user's module's
            raise PoolError(f"policy {spec!r}: cannot import {mod_name!r}: {exc}") from None
        cls = getattr(mod, cls_name, None)
        if cls is None:
            raise PoolError(f"policy {spec!r}: module {mod_name!r} has no {cls_name!r}")
        try:
            obj = cls()
        except Exception as exc:  # noqa: BLE001
            raise PoolError(f"policy {spec!r}: cannot construct {cls_name}(): {exc}") from None
        if not callable(getattr(obj, "allocate", None)):
            raise PoolError(f"policy {spec!r}: {cls_name} has no allocate(now, jobs, devices) method")
        return obj
    table = _builtins()
    if spec not in table:
        raise PoolError(f"unknown policy {spec!r} (known: {', '.join(POLICIES)}, or package.module:Class)")
    import inspect

    params = inspect.signature(table[spec]).parameters
    return table[spec](**{k: v for k, v in options.items() if k in params and v is not None})


def check_allocation(policy: str, alloc: Mapping[str, int], jobs: Sequence[JobView], devices: int) -> dict[str, int]:
    """The policy's answer checked: known names, sizes the jobs allow, at most ``devices``."""
    if not isinstance(alloc, Mapping):
        raise PoolError(f"policy {policy}: allocate returned {type(alloc).__name__}, not a dict")
    by_name = {j.name: j for j in jobs}
    out: dict[str, int] = {}
    for name, n in alloc.items():
        if name not in by_name:
            raise PoolError(f"policy {policy}: allocated {n} to unknown job {name!r}")
        if isinstance(n, bool) or not isinstance(n, int) or (n != 0 and n not in by_name[name].throughput):
            raise PoolError(f"policy {policy}: job {name}: size {n!r} is not allowed (sizes "
                            f"{list(by_name[name].sizes)})")
        if n:
            out[name] = n
    if sum(out.values()) > devices:
        raise PoolError(f"policy {policy}: allocated {sum(out.values())} devices of {devices}")
    return out
