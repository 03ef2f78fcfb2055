"""The update of one stage replica, once its gradients are summed over its replicas: unscale, clip, agree,
step (or skip), step the LR scheduler.

* **Gradient clipping** (``PipelineConfig(clip_grad_norm=c)``, the 2-norm). In the asynchronous modes
  (``"stash"``, ``"vertical"``) each stage clips its own gradient to norm ``c`` — stages update at different
  times, on gradients of different minibatches, so there is no global gradient to take the norm of. In
  ``"flush"`` mode the window's gradient of the whole model exists at the common update, and it is clipped
  by its **global** norm, exactly like ``torch.nn.utils.clip_grad_norm_`` over all the model's parameters:
  each stage's squared norm is counted once (by its replica 0; replicas hold the same summed gradient),
  summed over the world by an all-reduce, and every stage scales by ``c / (norm + 1e-6)`` if that is below 1.
* **float16 loss scaling** (flush mode only; see :mod:`pipedream_ft.pipeline.precision`): gradients are
  unscaled first; the found-inf flags ride in the same all-reduce, and all stages skip the update together.
* **Delay compensation** (``PipelineConfig(compensation=...)``, the asynchronous modes; see
  :mod:`pipedream_ft.pipeline.compensation`): the gradient is corrected towards the live weights (error
  feedback, after clipping), the learning rate of the step is scaled by the stage's delay, and the version
  published after it is extrapolated along the step (prediction, look-ahead).
* In ``"2bw"`` mode, as in ``"flush"``, the gradient is a window's, of the whole model at one version: clipping
  takes its global norm.

Replicas of a stage hold identical gradients after their all-reduce, so they take identical decisions. A stage
without parameters has nothing to step but still joins the flush-mode all-reduce.
"""

from __future__ import annotations

import math

import torch

from . import optimstep
from .compensation import Compensation, Compensator, momentum_of
from .connection import Connection
from .precision import LossScaler
from .scheduler import SchedulerComponent
from .state import StageState
from .topology import Topology

__all__ = ["Stepper"]


class Stepper:
    """Applies a stage replica's accumulated gradients (see the module docstring)."""

    def __init__(self, state: StageState, *, topo: Topology, synchronous: bool, connection: Connection,
                 clip_grad_norm: float | None = None, scaler: LossScaler | None = None,
                 scheduler: SchedulerComponent | None = None, compensation: Compensation | None = None,
                 delay: int = 0) -> None:
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0, got {clip_grad_norm}")
        if scaler is not None and not synchronous:
            raise ValueError("loss scaling needs a synchronous (flush) mode")
        self.state = state
        self.topo = topo
        self.synchronous = synchronous
        self.connection = connection
        self.clip = clip_grad_norm
        self.scaler = scaler
        self.scheduler = scheduler
        self.compensator = Compensator(compensation, delay) if compensation is not None and compensation.active \
            else None
        if self.compensator is not None and compensation is not None and compensation.lookahead \
                and state.optimizer is not None:
            for group in state.optimizer.param_groups:
                momentum_of(group, state.optimizer)  # refuses an optimizer without momentum now, not at its step
        self.last_norm: float | None = None
        """The gradient norm of the last update (the global one in flush mode), when clipping."""
        self._terms: torch.Tensor | None = None
        """This update's :meth:`terms`, once taken."""

    @property
    def agrees(self) -> bool:
        """Whether each update all-reduces over the world (flush mode with clipping or loss scaling)."""
        return self.synchronous and (self.clip is not None or self.scaler is not None)

    def terms(self) -> torch.Tensor:
        """This stage's part of the update's all-reduce (flush mode with clipping or loss scaling): its squared
        gradient norm and whether a gradient overflowed, as float64 ``[norm², found]`` on the CPU. Unscales the
        gradients (once per update); :meth:`step` then takes the sum over every stage."""
        grads = [p.grad for p in self.state.live_params if p.grad is not None]
        found = torch.zeros(())
        if self.scaler is not None:
            found = self.scaler.unscale(grads)
        sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
        if self.clip is not None and self.topo.replica == 0 and grads:
            sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).pow(2).sum()
        self._terms = flat = torch.stack([sq.cpu(), found.cpu().double()])
        return flat

    def step(self, total: torch.Tensor | None = None) -> None:
        """The update: called by the executor after the replica all-reduce, on every rank. ``total``: the sum of
        every stage's :meth:`terms`, when the caller reduced them (a process of several stages reduces them once
        for all of its stages); else this stage takes part in the all-reduce itself."""
        state = self.state
        skip = False
        if self.agrees:
            if total is None:
                flat = self.terms()
                messenger = self.connection.messenger
                work = messenger.group.control.allreduce([flat])
                messenger.wait(work, "all-reduce of gradient norms and overflow flags over every stage")
            else:
                if self._terms is None:
                    raise RuntimeError("step(total) before terms(): this stage's gradients are not unscaled")
                flat = total
            self._terms = None
            skip = bool(flat[1] > 0)
            if self.clip is not None and not skip:
                self._scale([p.grad for p in state.live_params if p.grad is not None], math.sqrt(float(flat[0])))
        elif self.clip is not None and any(p.grad is not None for p in state.live_params):
            self.last_norm = float(torch.nn.utils.clip_grad_norm_(state.live_params, self.clip))
        if state.optimizer is not None:
            if not skip:
                self._step(state)
            optimstep.zero_grad(state.optimizer)
        if self.scaler is not None:
            self.scaler.update(skip)
        if self.scheduler is not None:
            self.scheduler.step()

    def _step(self, state: StageState) -> None:
        assert state.optimizer is not None
        comp = self.compensator
        if comp is None:
            optimstep.step(state.optimizer)
            return
        update = state.versions.current.updates
        stale = state.versions.get(max(0, update - comp.delay)).tensors if comp.stale_version else None
        comp.before_step(state.params, state.optimizer, update, stale)
        optimstep.step(state.optimizer)
        state.versions.offset = comp.after_step(state.params, state.optimizer)

    def _scale(self, grads: list[torch.Tensor], norm: float) -> None:
        assert self.clip is not None
        self.last_norm = norm
        coef = self.clip / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
