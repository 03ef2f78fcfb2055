"""Mixed precision: forwards under ``torch.autocast``, and a loss scale the stages agree on (float16).

``PipelineConfig(autocast_dtype=torch.bfloat16)`` runs every forward (and the loss) under
``torch.autocast(<the rank's device type>, dtype=...)``; backwards run outside it, as PyTorch recommends.
Parameters, gradients and optimizer state stay float32; activations cross stages in whatever dtype autocast
gave them (bfloat16 or float16: the messenger carries both), and their gradients come back in that dtype.
The pre-flight check runs under the same autocast, so links learn the dtypes training will send.

**float16** has too few exponent bits for small gradients, so it needs *loss scaling*: the last stage
multiplies each loss by the scale ``S`` before its backward, every stage divides its parameter gradients by
``S`` before its update, and if any gradient anywhere overflowed, the update is skipped and ``S`` halves
(``S`` grows by ``growth_factor`` after ``growth_interval`` good updates) — ``torch.amp.GradScaler``'s rule.
The decision must be the same on every stage, or the stages would train different models. That is possible in
``"flush"`` mode: every stage updates at the end of the same window, so each stage all-reduces a found-inf
flag over the world at that update and all skip (or step) together, with one ``S`` in force for the whole
window. In the asynchronous modes (``"stash"``, ``"vertical"``) there is no such common point — each stage
updates after its own backward of a different minibatch, so a minibatch's gradient would be scaled by the
``S`` in force when the last stage ran it and unscaled by whatever ``S`` another stage holds when it updates —
so float16 is refused there (:func:`check_autocast`); use bfloat16, which needs no scaling.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from ..errors import PipelineSetupError

__all__ = ["LossScale", "LossScaler", "autocast_context", "check_autocast"]

_DTYPES = (torch.bfloat16, torch.float16)


def check_autocast(dtype: torch.dtype | None, mode: str) -> None:
    """Raise :class:`PipelineSetupError` if ``dtype`` cannot train in ``mode`` (see the module docstring)."""
    if dtype is None:
        return
    if dtype not in _DTYPES:
        raise PipelineSetupError(f"autocast_dtype must be torch.bfloat16, torch.float16 or None, got {dtype!r}")
    if dtype == torch.float16 and mode != "flush":
        raise PipelineSetupError(
            f"autocast_dtype float16 needs a loss scale that every stage agrees on at each update, which only "
            f"mode 'flush' has (mode {mode!r} updates each stage at a different time); use torch.bfloat16, or "
            "mode='flush'")


def autocast_context(dtype: torch.dtype | None, device: torch.device) -> Callable[[], ContextManager[Any]]:
    """A factory of the forward's context: ``torch.autocast`` of ``device``'s type, or nothing."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


@dataclass(frozen=True, slots=True)
class LossScale:
    """How the float16 loss scale moves (``torch.amp.GradScaler``'s parameters and defaults)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and math.isfinite(self.init_scale)):
            raise ValueError(f"init_scale must be a positive finite number, got {self.init_scale}")
        if self.growth_factor <= 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {self.growth_factor}, "
                             f"{self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")


class LossScaler:
    """The loss scale of one rank; every rank holds the same one, moved by the same agreed decisions.

    A checkpoint component (:mod:`pipedream_ft.pipeline.components`): its state is in every stage's part.
    """

    def __init__(self, config: LossScale) -> None:
        self.config = config
        self.scale = float(config.init_scale)
        self.growth_tracker = 0
        self.skipped = 0
        """Updates skipped for overflow in this process."""

    def unscale(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` by the scale in place (as GradScaler does: times the float32 reciprocal); returns a
        0-dim float tensor, 1 if any of them is not finite."""
        inv = torch.tensor(1.0 / self.scale, dtype=torch.float64).float().item()
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(inv)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        return found

    def update(self, found_inf: bool) -> None:
        """After an update: back off (``found_inf``: the update was skipped) or count towards growth."""
        c = self.config
        if found_inf:
            self.scale *= c.backoff_factor
            self.growth_tracker = 0
            self.skipped += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker == c.growth_interval:
                self.scale *= c.growth_factor
                self.growth_tracker = 0

    def capture(self, cut: int) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def restore(self, value: Any) -> None:
        if value is not None:
            self.scale = float(value["scale"])
            self.growth_tracker = int(value["growth_tracker"])

    def reshard(self, values: list[Any]) -> None:
        self.restore(next((v for v in values if v is not None), None))
