"""A schedule as a CSV table: one row per rank (row ``r`` is rank ``r``), one action string per cell, an empty
cell an idle slot (torchtitan's and ``torch.distributed.pipelining``'s ``_load_csv`` convention)."""

from __future__ import annotations

import csv
import io
import os
from typing import Union

from .actions import Action, Schedule, parse_action

__all__ = ["to_csv", "from_csv", "save_csv", "load_csv"]

PathLike = Union[str, "os.PathLike[str]"]


def to_csv(schedule: Schedule) -> str:
    """The table of ``schedule``, whose ranks must be 0..R-1."""
    ranks = sorted(schedule)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"a table holds ranks 0..R-1, the schedule has ranks {ranks}")
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for r in ranks:
        writer.writerow(["" if a is None else str(a) for a in schedule[r]])
    return buf.getvalue()


def from_csv(text: str) -> dict[int, list[Action | None]]:
    """Parse a table; ValueError naming the row (rank), the column and the bad cell."""
    out: dict[int, list[Action | None]] = {}
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        cells: list[Action | None] = []
        for c, cell in enumerate(row):
            if not cell.strip():
                cells.append(None)
                continue
            try:
                cells.append(parse_action(cell))
            except ValueError as e:
                raise ValueError(f"row {r} (rank {r}), column {c}: {e}") from None
        out[r] = cells
    return out


def save_csv(schedule: Schedule, path: PathLike) -> None:
    """Write ``schedule``'s table to ``path``."""
    with open(path, "w", newline="") as f:
        f.write(to_csv(schedule))


def load_csv(path: PathLike) -> dict[int, list[Action | None]]:
    """Read a table from ``path``; ValueError naming the file, row, column and bad cell."""
    with open(path, newline="") as f:
        text = f.read()
    try:
        return from_csv(text)
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)}: {e}") from None
