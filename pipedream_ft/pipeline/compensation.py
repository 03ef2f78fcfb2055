"""Delay compensation for the asynchronous modes: optimizer-side options that work from a stage's delay.

In ``"stash"``, ``"vertical"`` and ``"2bw"`` a stage's update ``u`` applies a gradient taken on older weights:
``delay`` updates older (:meth:`~pipedream_ft.pipeline.modes.Mode.delay`: ``S - 1 - s`` on stage ``s`` of a
straight ``S``-stage pipeline in ``"stash"``, ``S - 1`` on every stage in ``"vertical"``, 1 in ``"2bw"``; in
update rounds on replicated stages). Four remedies; all combine except ``predict`` with ``lookahead``:

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
* **Look-ahead** (``lookahead=True``; Nesterov-style). Like prediction, each published version is the weights
  moved along the optimizer's last update, but by where the optimizer's *momentum* alone would carry them over
  the delay: ``w + c * (w - w_before)`` with ``c = beta + beta**2 + ... + beta**delay``, ``beta`` the momentum
  coefficient of the parameter's group (``momentum`` for SGD, ``betas[0]`` for Adam/AdamW and the like). For SGD
  with momentum (no weight decay) ``w - w_before = -lr * buf``, so this is exactly the point ``delay`` further
  steps with zero gradients would reach — Nesterov's look-ahead point ``w - lr * beta * buf`` for ``delay = 1``;
  for Adam it is the same with the bias corrections and the second moment held fixed. Forward and backward use
  it, the update applies to the real weights. An optimizer without either coefficient is refused (``ValueError``
  naming it); ``momentum=0`` makes it a no-op. It replaces ``predict`` (both set the published version): asking
  for both is refused.
* **Error feedback** (``error_feedback=lam``, ``lam > 0``; DC-ASGD's first-order delay compensation, the
  "one-step delay is not a barrier" line of work). Right before update ``u``, after clipping, each gradient
  ``g`` — taken on ``w_stale``, the version the update's forwards and backwards read (``max(0, u - delay)``,
  predicted or looked-ahead if those are on) — is corrected towards the live weights ``w`` it is applied to::

      g <- g + lam * g * g * (w - w_stale)        (elementwise)

  ``g * g`` is DC-ASGD's diagonal stand-in for the Hessian, so ``lam`` carries the scale of the gradients: a
  minibatch gradient squared underestimates the per-example Fisher by about the number of examples averaged,
  which is the order of a sensible ``lam`` (the benchmark, ``benchmarks/bench_convergence.py``, sweeps it). It
  needs no state of its own: the stale version is one the stage keeps anyway (see
  :mod:`pipedream_ft.pipeline.versions`).

A stage with delay 0 (the last stage in ``"stash"``) is left alone. Tied parameters (shared by several stages)
have their own optimizer and keep the plain rule. A checkpoint keeps the live weights and the predicted (or
looked-ahead) versions, the current one included — which is all that error feedback needs too — so a resumed run
continues exactly; a re-planned one starts from the live weights, not extrapolated (like its versions, which
start over, error feedback's stale version being the one at the restart until the delay has passed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Compensation", "Compensator", "check_compensation", "lookahead_factor", "momentum_of"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Compensation:
    """Which delay compensations a pipeline applies (see the module docstring)."""

    predict: bool = False
    """Forward and backward on the weights extrapolated over the stage's delay along its last update."""
    lr_scale: bool = False
    """Scale each stage's learning rate by ``1 / (1 + delay)``."""
    lr_warmup: int = 0
    """With ``lr_scale``: raise that factor to 1 over this many updates (0: keep it)."""
    lookahead: bool = False
    """Forward and backward on the weights the optimizer's momentum alone would reach over the stage's delay."""
    error_feedback: float = 0.0
    """``lam`` of the correction ``g + lam * g * g * (w - w_stale)`` of each stale gradient (0: off)."""

    def __post_init__(self) -> None:
        if self.lr_warmup < 0:
            raise ValueError(f"lr_warmup must be >= 0, got {self.lr_warmup}")
        if self.lr_warmup and not self.lr_scale:
            raise ValueError(f"lr_warmup={self.lr_warmup} warms up the delay-aware learning rate: it needs "
                             "lr_scale=True")
        if not (self.error_feedback >= 0 and self.error_feedback < float("inf")):
            raise ValueError(f"error_feedback must be a finite lambda >= 0, got {self.error_feedback}")
        if self.predict and self.lookahead:
            raise ValueError("predict=True and lookahead=True both set the published weight version (along the "
                             "last update, over the delay or along the momentum): choose one")

    @property
    def active(self) -> bool:
        return self.predict or self.lr_scale or self.lookahead or self.error_feedback > 0

    def lr_factor(self, delay: int, update: int) -> float:
        """The learning-rate factor of update ``update`` (0-based) of a stage with delay ``delay``."""
        if not self.lr_scale or delay == 0:
            return 1.0
        if self.lr_warmup:
            return float((1 + delay) ** -(1.0 - min(update / self.lr_warmup, 1.0)))
        return 1.0 / (1 + delay)


def momentum_of(group: dict, optimizer: torch.optim.Optimizer) -> float:
    """The momentum coefficient of an optimizer's parameter group: ``momentum`` (SGD, RMSprop) or ``betas[0]``
    (Adam, AdamW, ...)."""
    if "betas" in group:
        return float(group["betas"][0])
    if "momentum" in group:
        return float(group["momentum"])
    raise ValueError(f"lookahead needs a momentum coefficient ('momentum' or 'betas') in the optimizer's parameter "
                     f"groups; {type(optimizer).__name__} has {sorted(k for k in group if k != 'params')}")


def lookahead_factor(beta: float, delay: int) -> float:
    """``beta + beta**2 + ... + beta**delay``: how far momentum ``beta`` carries the last update over ``delay``
    steps without gradients."""
    return float(sum(beta ** k for k in range(1, delay + 1)))


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

    @property
    def stale_version(self) -> bool:
        """Whether :meth:`before_step` needs the version the update's gradients were taken on (error feedback)."""
        return self.compensation.error_feedback > 0 and self.delay > 0

    def before_step(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                    update: int, stale: Sequence[torch.Tensor] | None = None) -> None:
        """Called right before update ``update`` is applied to ``params`` by ``optimizer``; ``stale``: the weights
        the gradients were taken on (one tensor per parameter), which error feedback needs."""
        comp = self.compensation
        if self.stale_version:
            if stale is None or len(stale) != len(params):
                raise ValueError(f"error feedback needs the stale version of each of the {len(params)} parameters, "
                                 f"got {None if stale is None else len(stale)}")
            for p, s in zip(params, stale):
                g = p.grad
                if g is not None:
                    g.add_(g * g * (p.detach() - s.detach()) * comp.error_feedback)
        if (comp.predict or comp.lookahead) and self.delay:
            self._before = [p.detach().clone() for p in params]
        factor = comp.lr_factor(self.delay, update)
        if optimizer is not None and factor != 1.0:
            self._lrs = [g["lr"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * factor

    def after_step(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> \
            list[torch.Tensor] | None:
        """Called right after the update: restores the learning rates; returns the offset to add to the next
        published version (``delay * (w - w_before)``, or ``c * (w - w_before)`` with look-ahead), or ``None``."""
        if self._lrs is not None and optimizer is not None:
            for g, lr in zip(optimizer.param_groups, self._lrs):
                g["lr"] = lr
        self._lrs = None
        if self._before is None:
            return None
        before, self._before = self._before, None
        if self.compensation.predict:
            return [(p.detach() - b) * self.delay for p, b in zip(params, before)]
        factors = self._lookahead_factors(params, optimizer)
        return [(p.detach() - b) * f for p, b, f in zip(params, before, factors)]

    def _lookahead_factors(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> \
            list[float]:
        if optimizer is None:
            return [0.0] * len(params)
        by_id = {id(p): lookahead_factor(momentum_of(g, optimizer), self.delay)
                 for g in optimizer.param_groups for p in g["params"]}
        return [by_id.get(id(p), 0.0) for p in params]
