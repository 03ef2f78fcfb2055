"""The pool's domain error."""

from __future__ import annotations

__all__ = ["PoolError"]


class PoolError(ValueError):
    """Bad input to the pool (a workload row, a profile, a policy, a setting); the message names the culprit."""
