"""The record of the current training call, kept in every checkpoint part so that it survives the process.

A :meth:`~pipedream_ft.trainer.PipelineTrainer.train` call trains minibatches ``[start, stop)``; the last stage
records the loss of each. A process that restores a part cut inside that call (an in-place replacement, or every
process of a restarted attempt that calls ``train``/``fit`` for the same ``stop``) continues the call: its
result starts at the call's ``start`` and holds the losses before the cut too, so every rank reports the same,
complete history whichever processes were replaced. Every stage's part holds the call's range; the last stage's
also its replica's ``(minibatch, loss)`` pairs before the cut, as two tensors (16 bytes a minibatch).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["TrainRecord"]

Losses = list[tuple[int, float]]


class TrainRecord:
    """A :class:`~pipedream_ft.pipeline.components.Component`: the current call's range and the losses recorded
    in it (read through ``losses()``, the executor's list of ``(minibatch, loss)``)."""

    def __init__(self, losses: Callable[[], Losses]) -> None:
        self._losses = losses
        self.call: tuple[int, int] | None = None
        """``(start, stop)`` of the training call under way; ``None`` between calls."""
        self.pending: dict[str, Any] | None = None
        """The record restored with a part, until a training call continues it (or does not)."""

    def capture(self, cut: int) -> Any:
        if self.call is None:
            return None
        start, stop = self.call
        pairs = [(b, loss) for b, loss in self._losses() if start <= b < cut]
        return {"start": start, "stop": stop,
                "minibatches": torch.tensor([b for b, _ in pairs], dtype=torch.int64),
                "losses": torch.tensor([loss for _, loss in pairs], dtype=torch.float64)}

    def restore(self, value: Any) -> None:
        self.pending = value

    def reshard(self, values: list[Any]) -> None:
        self.pending = None  # another plan's attempt: its calls are not this one's

    def begin(self, position: int, stop: int) -> tuple[int, Losses]:
        """A training call from ``position`` to ``stop`` starts: returns its first minibatch and the losses it
        already has — those of the restored call it continues (one with the same ``stop`` that had reached
        ``position``), else ``position`` and none."""
        saved, self.pending = self.pending, None
        start, pairs = position, []
        if saved is not None and int(saved["start"]) <= position <= int(saved["stop"]) == stop:
            start = int(saved["start"])
            pairs = [(int(b), float(loss)) for b, loss in zip(saved["minibatches"].tolist(), saved["losses"].tolist())
                     if b < position]
        self.call = (start, stop)
        return start, pairs

    def end(self) -> None:
        """The call is over: later cuts (and restores) belong to the next one."""
        self.call = None
        self.pending = None
