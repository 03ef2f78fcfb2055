"""What a data source is, whether a run can resume it exactly, and :class:`Epochs` for several passes.

The trainer reads minibatches from one of these (see :mod:`pipedream_ft.pipeline.data` for how):

* a **callable** ``data(b) -> (inputs, targets)``: random access by minibatch number;
* a **stateful iterable**: anything iterable with ``state_dict()`` and ``load_state_dict()``, such as
  torchdata's ``StatefulDataLoader``. Its protocol is the StatefulDataLoader's: ``state_dict()`` describes how
  far the iteration in progress has got, and after ``load_state_dict(s)`` the next ``iter()`` continues from
  ``s``;
* a plain ``torch.utils.data.DataLoader`` or a sequence (list, tuple): read through :class:`Epochs` with one
  pass, which makes it a stateful iterable by *replay*: it records the random generators' states when a pass
  starts and, to resume, sets them back, starts the pass again and skips the minibatches already read;
* any other iterable (a generator, an iterator): read in order; it cannot be resumed.

Minibatch ``b`` of a run is the ``b``-th minibatch the source yields, counting from its start (so a run that
resumes at minibatch ``c`` continues exactly where the interrupted one was). A source is read as **one pass**:
training more minibatches than it has is refused before training starts; for several epochs wrap it,
``Epochs(loader, n)`` (``len`` is ``n`` times the loader's).

**Exact resume.** With checkpointing on, a source is accepted only if it can be resumed exactly: a stateful
iterable (trusted to follow the protocol above), a sequence, or a DataLoader whose order can be replayed — a
map-style dataset with a ``SequentialSampler``, a ``DistributedSampler``, or a random sampler with an explicit
``generator=`` (not the global random generator, which the job does not save). :func:`resume_problem` says
why a source is refused, in one line.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

__all__ = ["Epochs", "describe", "is_stateful", "resume_problem", "source_length", "wrap"]


def describe(source: Any) -> str:
    """A short name for ``source`` in messages: its class name."""
    return type(source).__name__


def is_stateful(source: Any) -> bool:
    """``source`` has ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))


def source_length(source: Any) -> int | None:
    """Minibatches ``source`` yields (``len``), or ``None`` if it cannot tell."""
    try:
        return len(source)
    except TypeError:  # no __len__, or an IterableDataset without one
        return None


def wrap(source: Any) -> Any:
    """The iterable the trainer reads: ``source`` itself if it is stateful, a one-pass :class:`Epochs` for a plain
    DataLoader or a sequence, else ``source`` (read once, not resumable)."""
    if is_stateful(source):
        return source
    if isinstance(source, (DataLoader, collections.abc.Sequence)):
        return Epochs(source, 1)
    return source


def _innermost_sampler(loader: DataLoader) -> Any:
    sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    while isinstance(sampler, BatchSampler):
        sampler = sampler.sampler
    return sampler


def _generators(loader: Any) -> list[torch.Generator]:
    """The random generators a DataLoader's iteration draws from (the loader's and its samplers')."""
    found: list[torch.Generator] = []
    candidates = [getattr(loader, "generator", None)]
    sampler = getattr(loader, "batch_sampler", None) or getattr(loader, "sampler", None)
    while sampler is not None:
        candidates.append(getattr(sampler, "generator", None))
        sampler = getattr(sampler, "sampler", None)
    for g in candidates:
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def _replay_problem(loader: Any) -> str | None:
    """Why the order of ``loader``'s passes cannot be replayed after a restart (``None``: it can)."""
    name = describe(loader)
    if isinstance(loader, collections.abc.Sequence):
        return None
    if not isinstance(loader, DataLoader):
        return (f"data source {name} cannot be resumed exactly: Epochs replays only a DataLoader or a sequence; "
                "use StatefulDataLoader, or an iterable with state_dict() and load_state_dict()")
    if isinstance(loader.dataset, IterableDataset):
        return (f"data source {name} over an IterableDataset ({describe(loader.dataset)}) cannot be resumed exactly; "
                "use StatefulDataLoader with a dataset that has state_dict() and load_state_dict()")
    sampler = _innermost_sampler(loader)
    if isinstance(sampler, (SequentialSampler, DistributedSampler)):
        return None
    if hasattr(sampler, "generator"):
        if sampler.generator is None:
            return (f"data source {name} shuffles with {describe(sampler)} drawing from the global random generator, "
                    "so its order cannot be replayed after a restart: pass generator=torch.Generator().manual_seed(...) "
                    "to the DataLoader, or use torchdata's StatefulDataLoader")
        return None
    return (f"data source {name} uses sampler {describe(sampler)}, which may not repeat its order after a restart; "
            "use torchdata's StatefulDataLoader, or a sampler with an explicit generator=")


def resume_problem(source: Any) -> str | None:
    """Why a run that checkpoints cannot resume ``source`` exactly, in one line (``None``: it can)."""
    if isinstance(source, Epochs):
        return _replay_problem(source.loader)
    if is_stateful(source):
        return None
    if isinstance(source, (DataLoader, collections.abc.Sequence)):
        return _replay_problem(source)
    return (f"data source {describe(source)} cannot be resumed exactly (it has no state_dict() and load_state_dict(), "
            "and is not a DataLoader or a sequence); with checkpointing on, use torchdata's StatefulDataLoader, a "
            "DataLoader, or a callable data(b) -> (inputs, targets)")


class Epochs:
    """``loader`` read ``epochs`` times over, as one stream of minibatches (``len`` = ``epochs * len(loader)``).

    Each pass calls ``set_epoch(e)`` on the loader's sampler if it has one (``DistributedSampler``), then
    ``iter(loader)``. It is a stateful iterable: :meth:`state_dict` holds the pass, the minibatches read in it
    and the states of the loader's random generators when the pass started; after :meth:`load_state_dict` the
    next ``iter()`` sets those generators back, starts that pass again and skips (reads and drops) the
    minibatches already read — exact for a loader whose order depends only on those generators (see
    :func:`resume_problem`), at the cost of re-reading at most one pass.
    """

    def __init__(self, loader: Any, epochs: int) -> None:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {epochs!r}")
        if not isinstance(loader, collections.abc.Iterable) or isinstance(loader, collections.abc.Iterator):
            raise ValueError(f"Epochs needs a loader it can iterate again and again, got {describe(loader)}")
        self.loader = loader
        self.epochs = epochs
        self._epoch = 0
        self._read = 0
        self._starts: list[torch.Tensor] = []
        self._resume: dict[str, Any] | None = None

    def __len__(self) -> int:
        return self.epochs * len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        state, self._resume = self._resume, None
        first = int(state["epoch"]) if state is not None else 0
        for epoch in range(first, self.epochs):
            gens = _generators(self.loader)
            skip = 0
            if state is not None and epoch == first:
                saved = state["generators"]
                if len(saved) != len(gens):
                    raise ValueError(f"the saved state has {len(saved)} random generators, the loader "
                                     f"{describe(self.loader)} has {len(gens)}")
                for g, s in zip(gens, saved):
                    g.set_state(s.clone())
                skip = int(state["read"])
            for sampler in (getattr(self.loader, "sampler", None),
                            getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
                if callable(getattr(sampler, "set_epoch", None)):
                    sampler.set_epoch(epoch)
            self._starts = [g.get_state() for g in gens]
            self._epoch, self._read = epoch, 0
            for batch in self.loader:
                self._read += 1
                if self._read > skip:
                    yield batch
        self._epoch, self._read = self.epochs, 0

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration in progress is: ``{"epoch", "read", "generators"}``."""
        return {"epoch": self._epoch, "read": self._read, "generators": list(self._starts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter()``."""
        missing = {"epoch", "read", "generators"} - set(state)
        if missing:
            raise ValueError(f"not an Epochs state: it lacks {sorted(missing)}")
        self._resume = dict(state)
