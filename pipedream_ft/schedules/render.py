"""Draw a simulated schedule as text: one row per rank, one column per time unit."""

from __future__ import annotations

from .actions import COMMUNICATION
from .simulate import Timeline

__all__ = ["render"]


def render(timeline: Timeline, unit: float | None = None) -> str:
    """Ranks x time: each action's label in its first column and ``-`` through the rest of its time, ``.`` idle.

    ``unit`` is the time of one column (default: the shortest action); sends and receives take no time and
    are not drawn. Actions that do not start or end on a column boundary are drawn on the nearest.
    """
    drawn = {r: [s for s in lst if s.action.kind not in COMMUNICATION and s.end > s.start]
             for r, lst in sorted(timeline.spans.items())}
    durations = [s.end - s.start for lst in drawn.values() for s in lst]
    if not durations:
        return "\n".join(f"rank {r}:" for r in drawn)
    if unit is None:
        unit = min(durations)
    if unit <= 0:
        raise ValueError(f"unit must be > 0, got {unit}")
    width = max(len(str(s.action)) for lst in drawn.values() for s in lst)
    columns = round(timeline.step_time / unit)
    lines = []
    for r, lst in drawn.items():
        cells = ["."] * columns
        for s in lst:
            first, stop = round(s.start / unit), max(round(s.end / unit), round(s.start / unit) + 1)
            for c in range(first, min(stop, columns)):
                cells[c] = str(s.action) if c == first else "-" * width
        lines.append(f"rank {r}: " + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)
