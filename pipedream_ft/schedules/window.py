"""A synchronous schedule given as data: a table (CSV) or a Python mapping, checked once, run by ``flush`` mode.

A :class:`WindowSchedule` holds what each rank runs in one window of ``M`` microbatches, in
:mod:`pipedream_ft.schedules`' spelling: ``2F5``, ``1I0``, ``0W3``, ``3B1``. The table's convention is
torchtitan's: one row per rank, one action per cell, an empty cell an idle slot (``python -m
pipedream_ft.schedules zb_h1 --ranks 4 --microbatches 8 --csv zb.csv`` writes one to start from). A rank may hold
several stages (*virtual stages*: interleaved 1F1B, ZBV, DualPipeV); where each stage runs is read from the rows
(:attr:`WindowSchedule.placement`), and :func:`virtual_schedule` builds a named one.

The runtime runs each row window after window (minibatch ``m`` of window ``w`` is minibatch ``w M + m``), then
one update per stage per window: minibatch SGD, whatever the order inside the window, so a run may resume under
another schedule. Sends and receives in the table are allowed and skipped: the compute actions imply them (``F``
receives its input and sends its output, ``B``/``I`` receive and send the gradient). A ``U`` may only end a row.

Checked when the schedule is made, each failure a :class:`ValueError` naming the rank, the action or the
minibatch: ranks are ``0..R-1`` and stages ``0..S-1``; each stage runs on one rank; every stage runs, for each
minibatch ``0..M-1``, one ``F`` and either one ``B`` or one ``I`` then one ``W``, after its ``F``; forwards run in
minibatch order; and the whole table runs to the end (:func:`~pipedream_ft.schedules.simulate` names the actions
that would wait for ever, and checks the table's sends and receives where it has them). Whether it fits a plan
(``S`` stages, none replicated) is checked against the plan (:meth:`WindowSchedule.check_plan`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence, Union

from .actions import COMMUNICATION, Action, Kind, parse_action
from .costs import Costs
from .errors import ScheduleError
from .placement import stage_to_rank
from .simulate import simulate
from .tables import load_csv

__all__ = ["WindowSchedule", "resolve_schedule", "virtual_schedule", "VIRTUAL"]

VIRTUAL = ("interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs", "zbv", "dualpipev")
"""The named schedules that give a rank several stages (see :func:`virtual_schedule`)."""

_BACKWARD_KINDS = (Kind.B, Kind.I, Kind.W)


@dataclass(frozen=True, slots=True)
class WindowSchedule:
    """One window's compute actions per stage (see the module docstring); build it with :meth:`of` or
    :meth:`load`."""

    orders: tuple[tuple[Action, ...], ...]
    """``orders[s]``: stage ``s``'s compute actions in one window (minibatches ``0..M-1``)."""
    microbatches: int
    """``M``: minibatches per window (the ``flush_every`` it runs with)."""
    source: str
    """Where it came from: the table's path, or ``"python"``."""
    rows: tuple[tuple[Action, ...], ...] = ()
    """``rows[r]``: rank ``r``'s compute actions in one window, in the order it runs them (its stages'
    interleaved; one stage per rank: ``orders[r]``)."""
    placement: tuple[int, ...] = ()
    """``placement[s]``: the rank that runs stage ``s``."""

    @staticmethod
    def of(schedule: Mapping[int, Sequence[Action | str | None]], source: str = "python") -> WindowSchedule:
        """Check ``schedule`` (rank -> actions or their strings, ``None`` idle) and hold it."""
        if not isinstance(schedule, Mapping) or not schedule:
            raise ValueError(f"a schedule maps each rank to its actions, got {schedule!r:.80}")
        ranks = sorted(schedule)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"schedule {source}: ranks must be 0..S-1, got {ranks}")
        rows: dict[int, list[Action]] = {}
        for rank in ranks:
            try:
                rows[rank] = [parse_action(a) if isinstance(a, str) else a for a in schedule[rank] if a is not None]
            except ValueError as exc:
                raise ValueError(f"schedule {source}, rank {rank}: {exc}") from None
        try:
            where = stage_to_rank(rows)
        except ScheduleError as exc:
            raise ValueError(f"schedule {source}: {exc}") from None
        merged = [tuple(_row(source, rank, rows[rank])) for rank in ranks]
        orders = [tuple(a for a in merged[where[s]] if a.stage == s) for s in range(len(where))]
        microbatches = _check_minibatches(source, orders)
        try:  # the table as given (its sends and receives too, where it has them), every action one tick
            simulate(rows, Costs.uniform(len(where)))
        except ScheduleError as exc:
            raise ValueError(f"schedule {source} cannot run to its end: {exc}") from None
        return WindowSchedule(tuple(orders), microbatches, source, tuple(merged),
                              tuple(where[s] for s in range(len(where))))

    @staticmethod
    def load(path: str | os.PathLike[str]) -> WindowSchedule:
        """Read and check the table at ``path``."""
        try:
            table = load_csv(path)
        except OSError as exc:
            raise ValueError(f"cannot read the schedule table {os.fspath(path)}: {exc.strerror or exc}") from None
        return WindowSchedule.of(table, os.fspath(path))

    @property
    def num_stages(self) -> int:
        return len(self.orders)

    @property
    def num_ranks(self) -> int:
        return len(self.rows)

    @property
    def virtual(self) -> bool:
        """Whether a rank holds several stages."""
        return self.num_ranks < self.num_stages

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank ``rank`` runs, in order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    def rank_actions(self, rank: int, start: int, stop: int) -> list[Action]:
        """Rank ``rank``'s actions for minibatches ``[start, stop)`` (whole windows), all its stages' together in
        the order it runs them: each window's row, then the window's update of each of its stages. Its
        projection on a stage is :meth:`actions` of that stage."""
        return list(self.iter_rank_actions(rank, start, stop))

    def iter_rank_actions(self, rank: int, start: int, stop: int) -> Iterator[Action]:
        """:meth:`rank_actions`, made as they are read (a long run's list is never held whole)."""
        m = self._windows(start, stop)
        row = [(a.stage, a.kind, a.index) for a in self.rows[rank]]
        return _shifted(row, self.stages_of(rank), start // m, stop // m, m)

    def actions(self, stage: int, start: int, stop: int) -> list[Action]:
        """Stage ``stage``'s actions for minibatches ``[start, stop)`` (whole windows): each window's row, its
        minibatches shifted into place, then the window's update."""
        return list(self.iter_actions(stage, start, stop))

    def iter_actions(self, stage: int, start: int, stop: int) -> Iterator[Action]:
        """:meth:`actions`, made as they are read."""
        m = self._windows(start, stop)
        return _shifted([(stage, a.kind, a.index) for a in self.orders[stage]], [stage], start // m, stop // m, m)

    def _windows(self, start: int, stop: int) -> int:
        m = self.microbatches
        if start % m or stop % m or not 0 <= start <= stop:
            raise ValueError(f"minibatches [{start}, {stop}) are not whole windows of {m}")
        return m

    def check_window(self, flush_every: int) -> None:
        """Raise ValueError unless this schedule's window is ``flush_every`` minibatches."""
        if flush_every != self.microbatches:
            raise ValueError(f"the schedule {self} runs windows of {self.microbatches} minibatches; flush_every is "
                             f"{flush_every} (make them equal)")

    def check_plan(self, replicas: Sequence[int]) -> str | None:
        """Why a plan whose stages have ``replicas`` replicas cannot run this schedule (``None``: it can)."""
        if len(replicas) != self.num_stages:
            per_rank = "one per rank" if not self.virtual else f"on {self.num_ranks} ranks"
            return f"the schedule {self.source} has {self.num_stages} stages ({per_rank}), the plan {len(replicas)}"
        if any(r != 1 for r in replicas):
            return (f"the schedule {self.source} runs a straight pipeline; the plan replicates stages "
                    f"{[s for s, r in enumerate(replicas) if r != 1]} (schedule '1f1b' runs it)")
        return None

    def digest(self) -> str:
        """A short hash of the actions (two tables that run alike have the same one)."""
        text = ";".join(",".join(str(a) for a in order) for order in self.orders)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def __str__(self) -> str:
        return self.source if self.source != "python" else f"python schedule {self.digest()}"


def _row(source: str, rank: int, row: list[Action]) -> list[Action]:
    """Rank ``rank``'s compute actions: its sends and receives skipped, a closing ``U`` dropped (the runtime
    adds one per window), anything else refused."""
    out: list[Action] = []
    for i, a in enumerate(row):
        if not isinstance(a, Action):
            raise ValueError(f"schedule {source}, rank {rank}: {a!r} is not an action")
        if a.kind in COMMUNICATION:
            continue
        if a.kind == Kind.U:
            if any(b.kind != Kind.U and b.kind not in COMMUNICATION for b in row[i + 1:]):
                raise ValueError(f"schedule {source}, rank {rank}: {a} comes before the end of the window; mode "
                                 "'flush' updates once, after the window's last backward")
            continue
        out.append(a)
    return out


def _check_minibatches(source: str, orders: list[tuple[Action, ...]]) -> int:
    """``M``, after checking that every stage runs the same minibatches ``0..M-1`` completely and in order."""
    forwards = [sorted(a.index for a in order if a.kind == Kind.F) for order in orders]
    m = len(forwards[0])
    if m == 0:
        raise ValueError(f"schedule {source}: rank 0 runs no forward")
    for stage, order in enumerate(orders):
        if forwards[stage] != list(range(m)):
            raise ValueError(f"schedule {source}: stage {stage} runs the forwards of minibatches "
                             f"{forwards[stage]}, expected each of 0..{m - 1} once (as stage 0)")
        ran = [a.index for a in order if a.kind == Kind.F]
        if ran != sorted(ran):
            raise ValueError(f"schedule {source}: stage {stage} runs its forwards in the order {ran}; forwards "
                             "run in minibatch order")
        seen: dict[int, list[Kind]] = {}
        for a in order:
            kinds = seen.setdefault(a.index, [])
            if a.kind in _BACKWARD_KINDS and Kind.F not in kinds:
                raise ValueError(f"schedule {source}: {a} comes before {stage}F{a.index}")
            if a.kind == Kind.W and Kind.I not in kinds:
                raise ValueError(f"schedule {source}: {a} comes before {stage}I{a.index} (the weight gradient "
                                 "needs the input gradient's backward first)")
            kinds.append(a.kind)
        for b in range(m):
            kinds = sorted(k.value for k in seen.get(b, []))
            if kinds not in (["B", "F"], ["F", "I", "W"]):
                got = ", ".join(f"{stage}{k}{b}" for k in kinds) or "nothing"
                raise ValueError(f"schedule {source}: stage {stage} runs {got} for minibatch {b}; expected "
                                 f"{stage}F{b} and either {stage}B{b} or {stage}I{b} then {stage}W{b}, once each")
    return m


ScheduleSpec = Union[str, "os.PathLike[str]", WindowSchedule, Mapping[int, Sequence[Union[Action, str, None]]]]
"""What ``PipelineConfig.schedule`` takes: a built-in schedule's name, a table's path (``*.csv``), a
:class:`WindowSchedule`, or a mapping rank -> actions."""


def resolve_schedule(value: ScheduleSpec) -> str | WindowSchedule:
    """A built-in schedule's name as is; a table's path (``*.csv``, or any ``os.PathLike``) or a mapping as the
    checked :class:`WindowSchedule`."""
    if isinstance(value, WindowSchedule):
        return value
    if isinstance(value, Mapping):
        return WindowSchedule.of(value)
    if isinstance(value, os.PathLike) or (isinstance(value, str) and value.lower().endswith(".csv")):
        return WindowSchedule.load(value)
    if isinstance(value, str):
        return value
    raise TypeError(f"schedule must be a name, a table's path (.csv) or a mapping rank -> actions, got "
                    f"{type(value).__name__}")


def virtual_schedule(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None) -> WindowSchedule:
    """The named schedule of several stages per rank (one of :data:`VIRTUAL`) for ``ranks`` ranks and windows of
    ``microbatches`` minibatches, as a checked :class:`WindowSchedule` (``stages_per_rank``: the looped schedules'
    ``v``, default 2; the V schedules hold 2)."""
    from .catalog import build

    if name not in VIRTUAL:
        raise ValueError(f"schedule {name!r} is not one of several stages per rank ({', '.join(VIRTUAL)})")
    built = build(name, ranks, microbatches, stages_per_rank)
    return WindowSchedule.of(built.schedule, name)


def _shifted(row: list[tuple[int, Kind, int]], stages: list[int], first: int, last: int, m: int) -> Iterator[Action]:
    """Windows ``first .. last - 1`` of ``row`` (``(stage, kind, index)`` of a window's checked actions), each
    shifted by its first minibatch and followed by its update of each of ``stages``."""
    made, update = Action.trusted, Kind.U  # shifts of checked actions: a run of many windows makes many
    for w in range(first, last):
        base = w * m
        for s, k, i in row:
            yield made(s, k, base + i)
        for s in stages:
            yield made(s, update, w)
