"""The last stage's record of each minibatch's loss, read from the device only when asked.

Turning a loss into a Python number as it is computed (``float(loss)``) makes the host wait for the device to
finish that minibatch's forward before it may queue the backward: once per minibatch, on the last stage, which is
on every schedule's critical path. :class:`LossLog` keeps each loss as the detached tensor the loss function
returned and reads them all at once when the values are needed (the gather at the end of a training call, a
checkpoint's record, a rewind). Between those, :meth:`LossLog.latest` gives the newest loss the device has already
finished, without waiting: on CUDA an event recorded after each loss says whether it is ready.

On the CPU a loss is ready when the loss function returns, so it is read at once, as before.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

__all__ = ["LossLog", "Pairs", "cuda_marker"]

Pairs = list[tuple[int, float]]

Marker = Callable[[], Callable[[], bool]]
"""Called after a loss is computed: returns a test that says, without waiting, whether that loss is ready."""


def cuda_marker() -> Callable[[], bool]:
    """A CUDA event recorded on the current stream; its ``query``."""
    event = torch.cuda.Event()
    event.record()
    return event.query


class LossLog:
    """``(minibatch, loss)`` of every minibatch this stage computed in the current training call, in the order
    computed. ``marker``: how a loss on the device says it is ready (:func:`cuda_marker` on CUDA); ``None`` reads
    each loss as it is added (the CPU)."""

    def __init__(self, pairs: Iterable[tuple[int, float]] = (), *, marker: Marker | None = None) -> None:
        self._read: Pairs = list(pairs)
        self._pending: list[tuple[int, torch.Tensor, Callable[[], bool]]] = []
        self._marker = marker

    def add(self, minibatch: int, loss: torch.Tensor) -> None:
        """Record ``loss``, a one-element tensor (raises as ``float`` does for any other)."""
        value = loss.detach()
        if self._marker is None:
            self._read.append((minibatch, float(value)))
            return
        if value.numel() != 1:
            raise ValueError(f"the loss of minibatch {minibatch} has {value.numel()} elements (shape "
                               f"{tuple(value.shape)}): a loss function must return one number")
        self._pending.append((minibatch, value.reshape(()), self._marker()))

    def _read_through(self, k: int) -> None:
        """Read the first ``k`` pending losses in one transfer."""
        if k <= 0:
            return
        head, self._pending = self._pending[:k], self._pending[k:]
        values = torch.stack([t.to(torch.float64) for _, t, _ in head]).tolist()  # exact for every float dtype
        self._read.extend((b, v) for (b, _, _), v in zip(head, values))

    def pairs(self) -> Pairs:
        """Every ``(minibatch, loss)`` recorded, as numbers (waits for the device if a loss is still computing)."""
        self._read_through(len(self._pending))
        return self._read

    def latest(self) -> float | None:
        """The newest loss the device has finished, without waiting; ``None`` before the first."""
        for k in range(len(self._pending), 0, -1):
            if self._pending[k - 1][2]():
                self._read_through(k)
                break
        return self._read[-1][1] if self._read else None

    def last_minibatch(self) -> int | None:
        """The newest minibatch recorded (its loss need not be ready)."""
        if self._pending:
            return self._pending[-1][0]
        return self._read[-1][0] if self._read else None

    def reset(self, pairs: Iterable[tuple[int, float]] = ()) -> None:
        """Start over from ``pairs`` (a training call that continues a restored one brings its losses back)."""
        self._read = list(pairs)
        self._pending = []

    def keep_before(self, position: int) -> None:
        """Forget the losses of minibatches ``position`` and later (they will be computed again)."""
        self._read = [(b, v) for b, v in self._read if b < position]
        self._pending = [p for p in self._pending if p[0] < position]

    def __len__(self) -> int:
        return len(self._read) + len(self._pending)
