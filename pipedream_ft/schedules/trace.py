"""A simulated schedule as a trace file that ``pipedream-timeline`` draws, like a run's own trace.

Events are Chrome/Perfetto complete events in the layout of :mod:`pipedream_ft.observe.timeline`: ``pid`` the
rank, ``cat`` ``forward`` (``F``), ``backward`` (``B`` and ``I``), ``weight`` (``W``, as a run's trace records a split
backward's weight half) or ``update`` (``U``), ``args``
minibatch (the update number for ``U``), stage and kind; sends and receives are left out.
"""

from __future__ import annotations

import json
import os
from typing import Any, Union

from .actions import Kind
from .simulate import Timeline

__all__ = ["to_trace", "save_trace"]

_CATEGORY = {Kind.F: "forward", Kind.B: "backward", Kind.I: "backward", Kind.W: "weight", Kind.U: "update"}


def to_trace(timeline: Timeline, seconds_per_unit: float = 1e-3) -> dict[str, Any]:
    """``{"traceEvents": [...]}`` for ``timeline``, whose costs are read as ``seconds_per_unit`` seconds each."""
    if not seconds_per_unit > 0:
        raise ValueError(f"seconds_per_unit must be > 0, got {seconds_per_unit}")
    us = seconds_per_unit * 1e6
    events: list[dict[str, Any]] = []
    for rank, spans in sorted(timeline.spans.items()):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for s in spans:
            cat = _CATEGORY.get(s.action.kind)
            if cat is None:
                continue
            events.append({"name": str(s.action), "cat": cat, "ph": "X", "pid": rank, "tid": 0,
                           "ts": round(s.start * us, 3), "dur": round((s.end - s.start) * us, 3),
                           "args": {"minibatch": s.action.index, "stage": s.action.stage,
                                    "kind": s.action.kind.value}})
    return {"traceEvents": events}


def save_trace(timeline: Timeline, path: Union[str, "os.PathLike[str]"], seconds_per_unit: float = 1e-3) -> None:
    """Write :func:`to_trace` of ``timeline`` to ``path`` (JSON)."""
    with open(path, "w") as f:
        json.dump(to_trace(timeline, seconds_per_unit), f)
