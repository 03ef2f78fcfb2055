"""Delay compensation for the asynchronous modes: optimizer-side options that work from a stage's delay.

In ``"stash"``, ``"vertical"`` and ``"2bw"`` a stage's update ``u`` applies a gradient taken on older weights:
``delay`` updates older (:meth:`~pipedream_ft.pipeline.modes.Mode.delay`: ``S - 1 - s`` on stage ``s`` of a
straight ``S``-stage pipeline in ``"stash"``, ``S - 1`` on every stage in ``"vertical"``, 1 in ``"2bw"``; in
update rounds on replicated stages). Two remedies, which combine:

* **Weight prediction** (``predict=True``; PipeMare/SpecTrain-style). Each published weight version — the one
  forwards read and backwards differentiate — is the stage's weights extrapolated over its delay along the
  optimizer's own last update: ``w + delay * (w - w_before)``, where ``w_before`` are the weights before the
  update just applied. The forward and the backward of a minibatch both use that predicted version (the
  gradient is exact for the weights the forward saw); the update is applied to the real weights. Version 0
  (nothing applied yet) is not extrapolated. Costs one copy of the stage's weights during each update.
* **Delay-aware learning rate** (``lr_scale=True``). Update ``u`` of a stage with delay ``d`` uses the
  optimizer's learning rate times ``1 / (1 + d)`` — constant, or, with ``lr_warmup=K``, rising from
  ``1 / (1 + d)`` to 1 over the stage's first ``K`` updates: ``(1 + d) ** -(1 - min(u / K, 1))`` (PipeMare's
  rescheduling). The factor multiplies each parameter group's ``lr`` for the step only, so it composes with an
  LR scheduler.

A stage with delay 0 (the last stage in ``"stash"``) is left alone. Tied parameters (shared by several stages)
have their own optimizer and keep the plain rule. A checkpoint keeps the live weights and the predicted
versions, the current one included, so a resumed run continues exactly; a re-planned one starts from the live
weights, not extrapolated (like its versions, which start over).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Compensation", "Compensator", "check_compensation"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Compensation:
    """Which delay compensations a pipeline applies (see the module docstring)."""

    predict: bool = False
    """Forward and backward on the weights extrapolated over the stage's delay along its last update."""
    lr_scale: bool = False
    """Scale each stage's learning rate by ``1 / (1 + delay)``."""
    lr_warmup: int = 0
    """With ``lr_scale``: raise that factor to 1 over this many updates (0: keep it)."""

    def __post_init__(self) -> None:
        if self.lr_warmup < 0:
            raise ValueError(f"lr_warmup must be >= 0, got {self.lr_warmup}")
        if self.lr_warmup and not self.lr_scale:
            raise ValueError(f"lr_warmup={self.lr_warmup} warms up the delay-aware learning rate: it needs "
                             "lr_scale=True")

    @property
    def active(self) -> bool:
        return self.predict or self.lr_scale

    def lr_factor(self, delay: int, update: int) -> float:
        """The learning-rate factor of update ``update`` (0-based) of a stage with delay ``delay``."""
        if not self.lr_scale or delay == 0:
            return 1.0
        if self.lr_warmup:
            return float((1 + delay) ** -(1.0 - min(update / self.lr_warmup, 1.0)))
        return 1.0 / (1 + delay)


def check_compensation(compensation: Compensation | None, mode: str) -> None:
    """Raise ``ValueError`` if ``compensation`` makes no sense in ``mode``."""
    if compensation is not None and compensation.active and mode == "flush":
        raise ValueError(f"delay compensation ({compensation}) is for the asynchronous modes ('stash', "
                         "'vertical', '2bw'); mode 'flush' has no delay")


class Compensator:
    """Applies a :class:`Compensation` around one stage's optimizer steps."""

    def __init__(self, compensation: Compensation, delay: int) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        self.compensation = compensation
        self.delay = delay
        self._before: list[torch.Tensor] | None = None
        self._lrs: list[float] | None = None

    def before_step(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                    update: int) -> None:
        """Called right before update ``update`` is applied to ``params`` by ``optimizer``."""
        comp = self.compensation
        if comp.predict and self.delay:
            self._before = [p.detach().clone() for p in params]
        factor = comp.lr_factor(self.delay, update)
        if optimizer is not None and factor != 1.0:
            self._lrs = [g["lr"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * factor

    def after_step(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> \
            list[torch.Tensor] | None:
        """Called right after the update: restores the learning rates; returns the offset to add to the next
        published version (``delay * (w - w_before)``), or ``None``."""
        if self._lrs is not None and optimizer is not None:
            for g, lr in zip(optimizer.param_groups, self._lrs):
                g["lr"] = lr
        self._lrs = None
        if self._before is None:
            return None
        offset = [(p.detach() - b) * self.delay for p, b in zip(params, self._before)]
        self._before = None
        return offset
