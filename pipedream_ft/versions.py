"""Weight versions for weight stashing.

After every update a stage publishes a new *version* of its weights: an immutable copy the forward passes
read. A minibatch's forward records the version it used and its backward differentiates with respect to that
same version — PipeDream's weight stashing — so the gradient is exact for the weights the forward saw, even
though newer updates have been applied since. A version lives as long as some in-flight minibatch refers to
it: the stash is exactly the set of versions still referenced, never more.

With vertical sync, a stage uses the version stage 0 used for the same minibatch, so versions are also kept
by update number until no later minibatch can ask for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

__all__ = ["Version", "VersionStore"]


@dataclass(frozen=True, slots=True)
class Version:
    """The weights after ``updates`` updates, as leaf tensors that require grad."""

    updates: int
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class VersionStore:
    """The current version of a stage's weights, plus older ones kept for vertical sync."""

    def __init__(self, params: Iterable[torch.Tensor], updates: int = 0, keep_history: bool = False) -> None:
        self._params = list(params)
        self._keep_history = keep_history
        self._history: dict[int, Version] = {}
        self.current = self._snapshot(updates)

    def _snapshot(self, updates: int) -> Version:
        v = Version(updates, tuple(p.detach().clone().requires_grad_(p.requires_grad) for p in self._params))
        if self._keep_history:
            self._history[updates] = v
        return v

    def publish(self) -> Version:
        """Record the live weights (just updated) as the next version."""
        self.current = self._snapshot(self.current.updates + 1)
        return self.current

    def get(self, updates: int) -> Version:
        """The version after ``updates`` updates (vertical sync only)."""
        if updates == self.current.updates:
            return self.current
        try:
            return self._history[updates]
        except KeyError:
            raise KeyError(
                f"weight version {updates} is no longer kept (have {sorted(self._history)}); "
                "vertical sync needs the same replica count on every stage"
            ) from None

    def release_before(self, updates: int) -> None:
        """Forget history versions older than ``updates`` (in-flight minibatches keep their own references)."""
        for k in [k for k in self._history if k < updates]:
            del self._history[k]

    def add(self, version: Version) -> None:
        """Keep an older version (restored from a checkpoint) available to :meth:`get`."""
        self._history[version.updates] = version
