"""Weight versions for weight stashing.

After every update a stage publishes a new *version* of its weights: an immutable copy the forward passes
read. A minibatch's forward records the version it used and its backward differentiates with respect to that
same version — PipeDream's weight stashing — so the gradient is exact for the weights the forward saw, even
though newer updates have been applied since. A version lives as long as some in-flight minibatch refers to
it: the stash is exactly the set of versions still referenced, never more.

With vertical sync, a stage uses the version stage 0 used for the same minibatch, so versions are also kept
by update number until no later minibatch can ask for them.

A version need not equal the live weights: with weight prediction or look-ahead
(:mod:`pipedream_ft.pipeline.compensation`) the next :meth:`VersionStore.publish` adds an offset to them. Error
feedback reads the version an update's gradients were taken on (``delay`` updates old), which the stage keeps
anyway for its in-flight forwards.
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
    """The current version of a stage's weights and the ``keep`` before it.

    A forward asks for the version its position in the schedule calls for (:meth:`get`). In steady state that
    is the current one; at the start of a schedule — after a resume, or a new ``train`` call — the warm-up
    forwards of the first minibatches need older ones, exactly as if the pipeline had never stopped. Keeping
    the last ``keep`` versions (``S - s - 1`` on stage ``s`` of a straight pipeline) covers that; in steady
    state the in-flight minibatches hold those same versions anyway, so this costs no extra memory.
    """

    def __init__(self, params: Iterable[torch.Tensor], updates: int = 0, keep: int = 0, *, alias: bool = False
                 ) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        if alias and keep:
            raise ValueError(f"a version store that keeps {keep} older versions cannot alias the live weights")
        self._params = list(params)
        self.keep = keep
        self.alias = alias
        """The current version *is* the live weights (no copy) unless published with an offset: for a stage whose
        every forward's backward runs before the next update (``keep == 0``: flush mode, a last stage), so nothing
        reads a version after the optimizer has changed it. Saves a copy of the weights and one per update."""
        self.floor = 0
        """Versions older than this were never kept (the pipeline was re-planned here): asking for one gives the
        version at the floor."""
        self.history: dict[int, Version] = {}
        self.offset: list[torch.Tensor] | None = None
        """Added to the live weights by the next :meth:`publish` only (weight prediction, look-ahead), then cleared."""
        self.predicted = False
        """Whether the current version differs from the live weights (it was published with an offset)."""
        self.current = self._snapshot(updates)

    @property
    def live(self) -> bool:
        """Whether the current version is the live weights themselves (see :attr:`alias`)."""
        return self.alias and not self.predicted

    def _snapshot(self, updates: int, offset: list[torch.Tensor] | None = None) -> Version:
        if offset is None and self.alias:
            return Version(updates, tuple(self._params))
        if offset is None:
            return Version(updates, tuple(p.detach().clone().requires_grad_(p.requires_grad) for p in self._params))
        if len(offset) != len(self._params):
            raise ValueError(f"a version offset needs one tensor per parameter ({len(self._params)}), "
                             f"got {len(offset)}")
        return Version(updates, tuple(p.detach().clone().add_(o).requires_grad_(p.requires_grad)
                                      for p, o in zip(self._params, offset)))

    def publish(self) -> Version:
        """Record the live weights (just updated), plus :attr:`offset` if set, as the next version."""
        old = self.current
        offset, self.offset = self.offset, None
        if not self.keep:  # let the old version go before the new one is made (unless a minibatch still holds it)
            updates = old.updates
            del old, self.current
            self.current = self._snapshot(updates + 1, offset)
            self.predicted = offset is not None
            return self.current
        self.current = self._snapshot(old.updates + 1, offset)
        self.predicted = offset is not None
        self.history[old.updates] = old
        for k in [k for k in self.history if k < self.current.updates - self.keep]:
            del self.history[k]
        return self.current

    def get(self, updates: int) -> Version:
        """The version after ``updates`` updates."""
        updates = max(updates, self.floor)
        if updates == self.current.updates:
            return self.current
        try:
            return self.history[updates]
        except KeyError:
            raise KeyError(
                f"weight version {updates} is not kept (current {self.current.updates}, kept {sorted(self.history)})"
            ) from None

    def saved(self) -> dict[int, Version]:
        """The versions a checkpoint keeps: the older ones, and the current one when it is not the live weights."""
        out = dict(self.history)
        if self.predicted:
            out[self.current.updates] = self.current
        return out

    def add(self, version: Version) -> None:
        """Keep an older version (restored from a checkpoint); one numbered as the current version replaces it
        (a predicted current version)."""
        if version.updates == self.current.updates:
            self.current = version
            self.predicted = True
            return
        self.history[version.updates] = version
