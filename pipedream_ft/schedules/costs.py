"""What each action costs in a simulation: per-stage forward, input-gradient and weight-gradient times."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .actions import Action, Kind

__all__ = ["Costs"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Costs:
    """Per-stage times in any one unit (seconds, milliseconds, ticks); ``B`` costs ``I + W``, and every compute
    action (``F``, ``B``, ``I``, ``W``) ``overhead`` more."""

    forward: Sequence[float]
    """``F`` of each stage."""
    input_backward: Sequence[float]
    """``I`` of each stage: the gradient with respect to the stage's input."""
    weight_backward: Sequence[float]
    """``W`` of each stage: the gradient with respect to the stage's weights."""
    update: float = 0.0
    """``U`` (any stage)."""
    latency: float = 0.0
    """From the end of a producer on one rank to its consumer on another (a send to its receive); sends
    and receives themselves take no time on the ranks."""
    overhead: float = 0.0
    """The runtime's own cost per compute action, beside its layers' (dispatch, posting and completing its
    messages): ``pipedream-probe`` measures it per minibatch per stage, a forward and a backward."""

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n == 0 or len(self.input_backward) != n or len(self.weight_backward) != n:
            raise ValueError(f"forward, input_backward and weight_backward need one cost per stage, got lengths "
                             f"{len(self.forward)}, {len(self.input_backward)}, {len(self.weight_backward)}")
        for name in ("forward", "input_backward", "weight_backward"):
            for s, c in enumerate(getattr(self, name)):
                if not (math.isfinite(c) and c >= 0):
                    raise ValueError(f"{name}[{s}] must be a finite cost >= 0, got {c!r}")
        for name in ("update", "latency", "overhead"):
            c = getattr(self, name)
            if not (math.isfinite(c) and c >= 0):
                raise ValueError(f"{name} must be a finite cost >= 0, got {c!r}")

    @classmethod
    def uniform(cls, stages: int, forward: float = 1.0, input_backward: float = 1.0, weight_backward: float = 1.0,
                update: float = 0.0, latency: float = 0.0, overhead: float = 0.0) -> "Costs":
        """The same costs on every one of ``stages`` stages."""
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}")
        return cls(forward=[forward] * stages, input_backward=[input_backward] * stages,
                   weight_backward=[weight_backward] * stages, update=update, latency=latency, overhead=overhead)

    @property
    def stages(self) -> int:
        return len(self.forward)

    def of(self, action: Action) -> float:
        """How long ``action`` keeps its rank busy."""
        if action.kind == Kind.U:
            return self.update
        if action.kind not in (Kind.F, Kind.B, Kind.I, Kind.W):
            return 0.0
        if action.stage >= self.stages:
            raise ValueError(f"no costs for stage {action.stage} ({action}): costs cover {self.stages} stages")
        s = action.stage
        if action.kind == Kind.F:
            return self.forward[s] + self.overhead
        if action.kind == Kind.I:
            return self.input_backward[s] + self.overhead
        if action.kind == Kind.W:
            return self.weight_backward[s] + self.overhead
        return self.input_backward[s] + self.weight_backward[s] + self.overhead
