"""One action of a pipeline schedule: a stage, a kind and a minibatch, printed compactly as ``2F5``.

Kinds (``torch.distributed.pipelining``'s spelling, plus ``U``):

* ``F`` forward; ``B`` whole backward; ``I`` backward for the input gradient only; ``W`` backward for the
  weight gradient only (``B`` = ``I`` then ``W``);
* ``U`` the optimizer update of the stage (its index counts the stage's updates);
* ``SEND_F``/``RECV_F`` the activation of ``F``, ``SEND_B``/``RECV_B`` the gradient of ``B``/``I``. A send
  names the sender's stage, a receive the receiver's: ``1SEND_F3`` meets ``2RECV_F3``, ``2SEND_B3`` meets
  ``1RECV_B3``.

A schedule maps each rank to the list of actions it runs in order; ``None`` in a list is an idle slot (tables
keep them; every other pass skips them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Sequence, Union

__all__ = [
    "Kind",
    "Action",
    "Schedule",
    "COMPUTE",
    "BACKWARD",
    "COMMUNICATION",
    "parse_action",
    "compute_only",
]


class Kind(str, Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 -- pipelining's name for the input-gradient backward
    W = "W"
    U = "U"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value


COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
"""Kinds that run the stage's module."""
BACKWARD = frozenset({Kind.B, Kind.I})
"""Kinds that produce the gradient sent to the previous stage."""
COMMUNICATION = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """``kind`` of minibatch ``index`` on ``stage`` (for ``U``: the stage's update number ``index``)."""

    stage: int
    kind: Kind
    index: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                raise ValueError(f"unknown action kind {self.kind!r}: expected one of "
                                 f"{', '.join(k.value for k in Kind)}") from None
        for name in ("stage", "index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"action {name} must be an integer >= 0, got {value!r}")

    @staticmethod
    def trusted(stage: int, kind: Kind, index: int) -> "Action":
        """The action of values known to be valid (a pass deriving it from a checked one), made without checking
        them again: the generators and passes make thousands."""
        action = _new(Action)
        _set_stage(action, stage)  # the slots' own setters: a frozen dataclass refuses setattr
        _set_kind(action, kind)
        _set_index(action, index)
        return action

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.index}"

    def __repr__(self) -> str:
        return str(self)

    @staticmethod
    def parse(text: str) -> "Action":
        """The action ``text`` spells (``str(action)`` parsed back)."""
        return parse_action(text)


_new = object.__new__
_set_stage = Action.stage.__set__  # type: ignore[attr-defined]
_set_kind = Action.kind.__set__  # type: ignore[attr-defined]
_set_index = Action.index.__set__  # type: ignore[attr-defined]

Schedule = Mapping[int, Sequence[Union[Action, None]]]
"""rank -> the actions it runs in order (``None``: an idle slot, skipped when running)."""

# longest kinds first, so that SEND_F is not read as S + ...
_PATTERN = re.compile(r"(\d+)(" + "|".join(sorted((k.value for k in Kind), key=len, reverse=True)) + r")(\d+)")


def parse_action(text: str) -> Action:
    """Parse ``<stage><kind><index>`` (``2F5``, ``1I0``, ``0W3``, ``1SEND_F2``); ValueError naming ``text``."""
    if not isinstance(text, str):
        raise ValueError(f"an action is a string such as '2F5', got {text!r}")
    match = _PATTERN.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"bad action {text!r}: expected <stage><kind><minibatch> such as '2F5' or '1SEND_F2', "
                         f"kind one of {', '.join(k.value for k in Kind)}")
    stage, kind, index = match.groups()
    return Action(int(stage), Kind(kind), int(index))


def compute_only(schedule: Schedule) -> dict[int, list[Action]]:
    """``schedule`` without idle slots, updates and communication: the compute actions per rank, in order."""
    return {rank: [a for a in actions if a is not None and a.kind in COMPUTE]
            for rank, actions in sorted(schedule.items())}
