"""The 1F1B skeleton shared by the generators: warm-up forwards, then forward/backward pairs, then backwards."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

from .actions import Action, Kind

__all__: list[str] = []


def numbered(kind: Kind, stages: Sequence[int]) -> list[Action]:
    """``kind`` actions on ``stages`` in that order, each stage's minibatches numbered 0, 1, 2, ..."""
    count: dict[int, int] = defaultdict(int)
    out = []
    for s in stages:
        out.append(Action(s, kind, count[s]))
        count[s] += 1
    return out


def one_f_one_b_order(forwards: Sequence[Action], backwards: Sequence[Action], warmup: int,
                      weights_after: int | None = None, after_backward: Callable[[Action], list[Action]] | None = None
                      ) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward while forwards remain, then the backwards.

    With ``weights_after`` (zero-bubble), ``backwards`` are ``I`` actions; from the ``weights_after``-th
    backward on, each is followed by the oldest pending ``W``, and the rest close the list. ``after_backward``
    returns actions to run right after each backward (PipeDream's update).
    """
    out = list(forwards[:warmup])
    pending: list[Action] = []
    for j, b in enumerate(backwards):
        if warmup + j < len(forwards):
            out.append(forwards[warmup + j])
        out.append(b)
        if after_backward is not None:
            out += after_backward(b)
        if weights_after is not None:
            pending.append(Action(b.stage, Kind.W, b.index))
            if j >= weights_after:
                out.append(pending.pop(0))
    return out + pending
