"""A job's progress from its metrics (``PIPEDREAM_FT_METRICS_DIR``): the newest record of each rank's file.

Each rank appends one JSON line per update to ``metrics-rank{R}.jsonl`` with ``minibatches`` (the position
reached) and ``time``; only the tail of each file is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Progress", "read_progress"]

_TAIL = 8192


@dataclass(frozen=True)
class Progress:
    minibatches: int
    time: float | None
    rate: float | None   # minibatches per second over the tail read, None with fewer than two records


def _tail_records(path: Path) -> list[dict]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _TAIL))
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > _TAIL:
        lines = lines[1:]  # the first may be cut
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # an empty or half-written line
        if isinstance(rec, dict) and "minibatches" in rec:
            out.append(rec)
    return out


def read_progress(metrics_dir: Path, since: float | None = None) -> Progress:
    """The highest position any rank reached; the rate from rank files' records after ``since``."""
    best, when, rate = 0, None, None
    for path in sorted(Path(metrics_dir).glob("metrics-rank*.jsonl")):
        recs = _tail_records(path)
        if not recs:
            continue
        last = recs[-1]
        if int(last["minibatches"]) >= best:
            best, when = int(last["minibatches"]), float(last.get("time", 0.0))
        window = [r for r in recs if since is None or float(r.get("time", 0.0)) >= since]
        if len(window) >= 2:
            dt = float(window[-1]["time"]) - float(window[0]["time"])
            if dt > 0:
                r = (int(window[-1]["minibatches"]) - int(window[0]["minibatches"])) / dt
                rate = r if rate is None else max(rate, r)
    return Progress(best, when, rate)
