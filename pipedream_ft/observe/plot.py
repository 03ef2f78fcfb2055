"""Draw a merged timeline (see :mod:`pipedream_ft.observe.timeline`) as a PNG, like the PipeDream paper's pipeline figures.

One row per rank, time running to the right in seconds from the first event: forward passes in blue, backward
passes in green (the input half of a split backward too; its weight half in purple), each labelled with its
minibatch number where the box is wide enough, weight updates as
small dark boxes, checkpoints as an orange hatched band at the foot of the row, receive waits in light grey
behind everything, and a red dashed line across all rows at the start of every restarted attempt.

:func:`summarize` and :func:`clip_trace` work on the trace alone and need no matplotlib.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import replace_atomically

__all__ = [
    "FORWARD_COLOR",
    "BACKWARD_COLOR",
    "WEIGHT_COLOR",
    "UPDATE_COLOR",
    "CHECKPOINT_COLOR",
    "WAIT_COLOR",
    "RESTART_COLOR",
    "Restart",
    "TraceSummary",
    "summarize",
    "clip_trace",
    "draw_timeline",
]

FORWARD_COLOR = "#4c72b0"
BACKWARD_COLOR = "#55a868"
WEIGHT_COLOR = "#8172b2"
UPDATE_COLOR = "#2f2f2f"
CHECKPOINT_COLOR = "#f28e2b"
WAIT_COLOR = "#d9d9d9"
RESTART_COLOR = "#d62728"

_DPI = 100
_ROW_PX = 46
_LABEL_PT = 7.0


@dataclass(frozen=True)
class Restart:
    """The start of an attempt that did not begin from scratch at attempt 0, or an in-place recovery (the
    group formed again without restarting its processes: ``attempt`` is then the recovery's epoch)."""

    attempt: int
    resumed_from: int | None
    time_us: float
    in_place: bool = False

    def label(self) -> str:
        origin = f"from checkpoint {self.resumed_from}" if self.resumed_from is not None else "from scratch"
        if self.in_place:
            return f"in-place recovery (epoch {self.attempt}, {origin})"
        return f"restart (attempt {self.attempt}, {origin})"


@dataclass
class TraceSummary:
    """What a trace holds, in a few numbers."""

    ranks: list[int] = field(default_factory=list)
    stages: list[int] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    minibatches: set[int] = field(default_factory=set)
    restarts: list[Restart] = field(default_factory=list)
    events: int = 0
    span_s: float = 0.0

    def line(self) -> str:
        """One line: ranks, stages, attempts, minibatches seen, restarts and time span."""
        mb = sorted(self.minibatches)
        seen = f"{len(mb)} minibatches seen" + (f" ({mb[0]}-{mb[-1]})" if mb else "")
        if self.restarts:
            rs = "; ".join(("in place, epoch " if r.in_place else "attempt ") + f"{r.attempt} from "
                           + (f"checkpoint {r.resumed_from}" if r.resumed_from is not None else "scratch")
                           for r in self.restarts)
            restarts = f"{len(self.restarts)} restart{'s' if len(self.restarts) != 1 else ''} ({rs})"
        else:
            restarts = "0 restarts"
        return (f"{_plural(len(self.ranks), 'rank')} ({_plural(len(self.stages), 'stage')}), "
                f"{_plural(len(self.attempts), 'attempt')}, {seen}, {restarts}, "
                f"{self.events} events over {self.span_s:.3f} s")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _timed(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace's events that have a time (everything but metadata)."""
    return [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") != "M"
            and isinstance(e.get("ts"), (int, float))]


def _first_stages(events: list[dict[str, Any]]) -> dict[int, int]:
    """For each rank whose compute events name several stages (virtual stages): the lowest of them."""
    stages: dict[int, set[int]] = defaultdict(set)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("forward", "backward", "weight"):
            pid, stage = _int(e.get("pid")), _int((e.get("args") or {}).get("stage"))
            if pid is not None and stage is not None:
                stages[pid].add(stage)
    return {pid: min(s) for pid, s in stages.items() if len(s) > 1}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _restarts(events: list[dict[str, Any]]) -> list[Restart]:
    first: dict[int, tuple[float, int | None]] = {}
    recovered: dict[int, tuple[float, int | None]] = {}
    for e in events:
        if e.get("ph") == "i" and e.get("name") == "recovered":
            args = e.get("args") or {}
            epoch = _int(args.get("epoch")) or 0
            ts = float(e["ts"])
            if epoch not in recovered or ts < recovered[epoch][0]:
                recovered[epoch] = (ts, _int(args.get("cut")))
            continue
        if e.get("ph") != "i" or e.get("name") != "start":
            continue
        args = e.get("args") or {}
        attempt = _int(args.get("attempt"))
        if attempt is None:
            attempt = _int(e.get("tid")) or 0
        ts = float(e["ts"])
        if attempt not in first or ts < first[attempt][0]:
            first[attempt] = (ts, _int(args.get("resumed_from")))
    marks = [Restart(a, rf, ts) for a, (ts, rf) in sorted(first.items()) if a > 0 or rf is not None]
    marks += [Restart(epoch, cut, ts, in_place=True) for epoch, (ts, cut) in sorted(recovered.items())]
    return sorted(marks, key=lambda r: r.time_us)


def _span(events: list[dict[str, Any]]) -> tuple[float, float]:
    if not events:
        return 0.0, 0.0
    lo = min(float(e["ts"]) for e in events)
    hi = max(float(e["ts"]) + float(e.get("dur") or 0.0) for e in events)
    return lo, hi


def summarize(trace: dict[str, Any]) -> TraceSummary:
    """Ranks, stages, attempts, minibatches and restarts found in a merged trace."""
    events = _timed(trace)
    s = TraceSummary(events=len(events))
    ranks, stages, attempts = set(), set(), set()
    for e in events:
        args = e.get("args") or {}
        if (pid := _int(e.get("pid"))) is not None:
            ranks.add(pid)
        if (stage := _int(args.get("stage"))) is not None:
            stages.add(stage)
        attempt = _int(args.get("attempt"))
        attempts.add(attempt if attempt is not None else _int(e.get("tid")) or 0)
        if e.get("cat") in ("forward", "backward", "weight") and (b := _int(args.get("minibatch"))) is not None:
            s.minibatches.add(b)
    s.ranks, s.stages, s.attempts = sorted(ranks), sorted(stages), sorted(attempts)
    s.restarts = _restarts(events)
    lo, hi = _span(events)
    s.span_s = (hi - lo) / 1e6
    return s


def clip_trace(trace: dict[str, Any], last_s: float) -> dict[str, Any]:
    """The trace cut to its last ``last_s`` seconds: events that end in that window (metadata kept).

    The first event's time of the whole trace is kept as ``otherData.t0_us``, so that :func:`draw_timeline`
    still counts seconds from the start of the run.
    """
    if not last_s > 0:
        raise ValueError(f"last_s must be positive, got {last_s}")
    events = _timed(trace)
    lo, hi = _span(events)
    cut = hi - last_s * 1e6
    meta = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "M"]
    kept = [e for e in events if float(e["ts"]) + float(e.get("dur") or 0.0) >= cut]
    other = dict(trace.get("otherData") or {})
    other.setdefault("t0_us", lo)
    return {**trace, "traceEvents": meta + kept, "otherData": other}


def _row_labels(trace: dict[str, Any], events: list[dict[str, Any]]) -> dict[int, str]:
    """``"rank R · stage S"`` for every rank, from the events' args, else from the metadata's process name."""
    stages: dict[int, Counter[int]] = defaultdict(Counter)
    replicas: dict[int, set[int]] = defaultdict(set)
    for e in events:
        pid = _int(e.get("pid"))
        if pid is None:
            continue
        args = e.get("args") or {}
        stages[pid]  # every rank gets a row, even one with no stage in its args
        if (st := _int(args.get("stage"))) is not None:
            stages[pid][st] += 1
        if (rp := _int(args.get("replica"))) is not None:
            replicas[pid].add(rp)
    names = {e.get("pid"): (e.get("args") or {}).get("name") for e in trace.get("traceEvents", [])
             if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "process_name"}
    labels = {}
    for pid, counts in stages.items():
        if counts:
            label = f"rank {pid} · stage " + "/".join(str(s) for s in sorted(counts))
            if replicas[pid] - {0}:
                label += " · replica " + "/".join(str(r) for r in sorted(replicas[pid]))
        elif isinstance(names.get(pid), str):
            label = names[pid]
        else:
            label = f"rank {pid}"
        labels[pid] = label
    return labels


def _origin(trace: dict[str, Any], first_us: float) -> float:
    """Time zero of the x axis: ``otherData.t0_us`` (set by :func:`clip_trace`) if valid, else the first event."""
    t0 = (trace.get("otherData") or {}).get("t0_us") if isinstance(trace.get("otherData"), dict) else None
    return float(t0) if isinstance(t0, (int, float)) and not isinstance(t0, bool) and t0 <= first_us else first_us


def _png_size(path: str | os.PathLike[str]) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def draw_timeline(trace: dict[str, Any], path: str | os.PathLike[str], *, width_px: int = 1600,
                  height_px: int | None = None, title: str | None = None) -> tuple[int, int]:
    """Draw ``trace`` (a merged trace, ``{"traceEvents": [...]}``) into the PNG ``path``; return its pixel size.

    The file is written atomically: on any error ``path`` is left as it was. The height defaults to one
    ``_ROW_PX``-pixel row per rank plus room for the title, axis and legend.
    """
    if width_px < 200:
        raise ValueError(f"width_px must be at least 200, got {width_px}")
    if height_px is not None and height_px < 150:
        raise ValueError(f"height_px must be at least 150, got {height_px}")
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:  # leave an interactive session's backend alone
        matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    events = _timed(trace)
    labels = _row_labels(trace, events)
    ranks = sorted(labels)
    row = {r: i for i, r in enumerate(ranks)}
    n = max(1, len(ranks))
    if height_px is None:
        height_px = max(240, 150 + (40 if title else 0) + _ROW_PX * n)
    first, t1 = _span(events)
    t0 = _origin(trace, first)
    x0 = (first - t0) / 1e6  # where the drawn events begin, in seconds from the origin
    span = max((t1 - first) / 1e6, 1e-6)

    # a rank that runs several stages (virtual stages): its first stage's boxes plain, the later ones' hatched
    first_stage = _first_stages(events)
    # boxes[(rank, cat)] = [(x, w), ...] in seconds (later[...] for a rank's later stages); texts for the
    # forward/backward minibatch labels
    boxes: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    later: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    texts: list[tuple[float, float, int, str]] = []  # x, w, row, label
    for e in events:
        if e.get("ph") != "X" or (pid := _int(e.get("pid"))) not in row:
            continue
        cat = e.get("cat")
        if cat not in ("forward", "backward", "weight", "update", "checkpoint", "wait"):
            continue
        x, w = (float(e["ts"]) - t0) / 1e6, float(e.get("dur") or 0.0) / 1e6
        stage = _int((e.get("args") or {}).get("stage"))
        hatched = pid in first_stage and stage is not None and stage != first_stage[pid]
        (later if hatched and cat in ("forward", "backward", "weight") else boxes)[(pid, cat)].append((x, w))
        if cat in ("forward", "backward", "weight"):
            b = _int((e.get("args") or {}).get("minibatch"))
            texts.append((x, w, row[pid], str(b) if b is not None else str(e.get("name", ""))))

    fig = Figure(figsize=(width_px / _DPI, height_px / _DPI), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # y bands inside a row (row i spans [i, i + 1], drawn top to bottom)
    bands = {"wait": (0.38, 0.24), "forward": (0.08, 0.72), "backward": (0.08, 0.72), "weight": (0.08, 0.72),
             "update": (0.26, 0.36), "checkpoint": (0.82, 0.16)}
    style: dict[str, dict[str, Any]] = {
        "wait": {"facecolors": WAIT_COLOR, "linewidth": 0, "zorder": 1},
        "forward": {"facecolors": FORWARD_COLOR, "zorder": 2},
        "backward": {"facecolors": BACKWARD_COLOR, "zorder": 2},
        "weight": {"facecolors": WEIGHT_COLOR, "zorder": 2},
        "update": {"facecolors": UPDATE_COLOR, "linewidth": 0, "zorder": 3},
        "checkpoint": {"facecolors": CHECKPOINT_COLOR, "edgecolors": "#8a4b0f", "hatch": "////", "linewidth": 0.5,
                       "zorder": 4},
    }
    ax.set_xlim(x0 - 0.01 * span, x0 + span * 1.01)
    ax.set_ylim(n, 0)
    fig.draw_without_rendering()  # lay out once to learn the axes' width in pixels
    axes_px = ax.get_window_extent().width
    px_per_s = axes_px / (span * 1.02)
    # rows whose boxes average under ~4 px: no white edges and no widened updates, which would drown them
    dense = {pid for pid in ranks
             if 4 * sum(len(boxes.get((pid, c), ())) + len(later.get((pid, c), ()))
                        for c in ("forward", "backward", "weight", "update")) > axes_px}
    for (pid, cat), spans in boxes.items():
        kw = dict(style[cat])
        if cat in ("forward", "backward", "weight"):
            kw.update(edgecolors="white", linewidth=0 if pid in dense else 0.6)
        if cat == "update" and pid not in dense:
            # at least ~2 px wide, so that every update shows as a tick however short it was
            spans = [(x, max(w, 2.0 / px_per_s)) for x, w in spans]
        y, h = bands[cat]
        ax.broken_barh(spans, (row[pid] + y, h), **kw)
    for (pid, cat), spans in later.items():
        y, h = bands[cat]
        ax.broken_barh(spans, (row[pid] + y, h), **{**style[cat], "edgecolors": "white", "hatch": "///",
                                                     "linewidth": 0 if pid in dense else 0.6})

    char_px = 0.62 * _LABEL_PT * _DPI / 72
    for x, w, r, text in texts:
        if w * px_per_s >= len(text) * char_px + 4:
            ax.text(x + w / 2, r + 0.44, text, ha="center", va="center", fontsize=_LABEL_PT, color="white",
                    zorder=5, clip_on=True)

    restarts = _restarts(events)
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for rs in restarts:
        x = (rs.time_us - t0) / 1e6
        ax.axvline(x, color=RESTART_COLOR, linestyle="--", linewidth=1.5, zorder=6)
        right = x > x0 + 0.6 * span  # late restarts label to the left of their line, to stay inside the axes
        ax.text(x, 0.995, rs.label() + " " if right else " " + rs.label(), transform=top,
                ha="right" if right else "left", va="top", fontsize=8, color=RESTART_COLOR, zorder=7, clip_on=True,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.0})

    ax.set_yticks([i + 0.5 for i in range(len(ranks))], [labels[r] for r in ranks])
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("time (s) since the first event" if t0 == first else "time (s) since the start of the trace")
    ax.grid(axis="x", color="#eeeeee", linewidth=0.8, zorder=0)
    ax.set_axisbelow(True)
    for i in range(1, n):
        ax.axhline(i, color="#bbbbbb", linewidth=0.5, zorder=0)
    if not ranks:
        ax.text(0.5, 0.5, "no events", transform=ax.transAxes, ha="center", va="center", color="#888888")
    present = {cat for _, cat in boxes} | {cat for _, cat in later}
    handles = [Patch(facecolor=FORWARD_COLOR, label="forward (minibatch)"),
               Patch(facecolor=BACKWARD_COLOR, label="backward (minibatch)"),
               Patch(facecolor=UPDATE_COLOR, label="weight update")]
    if "weight" in present:
        handles.insert(2, Patch(facecolor=WEIGHT_COLOR, label="weight gradient (split backward)"))
    if later:
        handles.append(Patch(facecolor="#999999", edgecolor="white", hatch="///",
                             label="hatched: a rank's later stage (virtual stages)"))
    if "checkpoint" in present:
        handles.append(Patch(facecolor=CHECKPOINT_COLOR, edgecolor="#8a4b0f", hatch="////", label="checkpoint"))
    if "wait" in present:
        handles.append(Patch(facecolor=WAIT_COLOR, label="waiting to receive"))
    if restarts:
        handles.append(Line2D([], [], color=RESTART_COLOR, linestyle="--", linewidth=1.5, label="restart"))
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles), frameon=False,
              fontsize=8, borderaxespad=0.2)
    if title:
        fig.suptitle(title)

    out = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)

    def write(tmp: str) -> tuple[int, int]:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=_DPI)
        return _png_size(tmp)

    return replace_atomically(str(out), write, tmp=tmp)
