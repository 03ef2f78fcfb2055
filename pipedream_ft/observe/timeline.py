"""A timeline of what every rank did, in Chrome/Perfetto trace format.

Each rank appends events to its own file, ``trace-attempt{A}-rank{R}.json`` (``...-p{N}.json`` for the ``N``-th
process that replaced the rank's in an in-place recovery), as it goes (a JSON array whose
closing bracket may be missing: trace viewers accept that, and a rank killed mid-run leaves a readable file).
:func:`merge_traces` joins the files of every rank and attempt into one trace.

Events (``ph: "X"`` complete events, times in microseconds since the epoch so attempts line up):

=============  =========  ==============================================================
name           cat        args
=============  =========  ==============================================================
``F{b}``       forward    minibatch, stage, replica, attempt
``B{b}``       backward   minibatch, stage, replica, attempt (a split backward: its input half ``I``)
``W{b}``       weight     minibatch, stage, replica, attempt (a split backward's weight half)
``U{j}``       update     round, stage, replica, attempt
``recv``       wait       minibatch, what ("activation" / "gradient"), peer
``SEND_F{b}``  message    instant as the lowered schedule's send or receive is posted (also ``RECV_F``,
                         ``SEND_B``, ``RECV_B``); minibatch, stage
``checkpoint`` checkpoint cut, snapshot_s
``start``      restart    instant (``ph: "i"``) at the start of every attempt; args attempt, resumed_from
=============  =========  ==============================================================

``pid`` is the global rank and ``tid`` the attempt, with metadata events naming them
("rank 2 · stage 1", "attempt 0").
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

__all__ = ["TimelineRecorder", "load_trace_file", "merge_traces", "trace_files"]


class TimelineRecorder:
    """Appends this rank's events to its trace file; cheap enough to leave on."""

    def __init__(self, directory: str | os.PathLike[str], *, rank: int, stage: int, replica: int, attempt: int,
                 flush_every_s: float = 0.5, process: int = 0, row: tuple[int, str] | None = None) -> None:
        """``process``: the incarnation of the rank's process (in-place recovery replaces processes): a
        replacement writes a file of its own, ``trace-attempt{A}-rank{R}-p{process}.json``. ``row``: the row (its
        number and name) the events go to, when it is not the rank's own: the process of a stage that shares it
        with others (virtual stages), drawn as one row."""
        suffix = f"-p{process}" if process else ""
        self.path = Path(directory) / f"trace-attempt{attempt}-rank{rank}{suffix}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stage, self.replica, self.attempt = stage, replica, attempt
        self.rank = row[0] if row is not None else rank
        """The row (``pid``) of every event: the rank, or the process of a virtual stage."""
        self._buf: list[str] = []
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._flush_every = flush_every_s
        self._file = open(self.path, "w")
        self._file.write("[\n")
        name = row[1] if row is not None else f"rank {rank} · stage {stage}" + (f" replica {replica}" if replica else "")
        self._meta("process_name", {"name": name})
        self._meta("process_sort_index", {"sort_index": self.rank})
        self._meta("thread_name", {"name": f"attempt {attempt}"}, tid=attempt)

    def _meta(self, name: str, args: dict[str, Any], tid: int = 0) -> None:
        self._emit({"name": name, "ph": "M", "pid": self.rank, "tid": tid, "args": args})

    def _emit(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":")) + ",\n"
        with self._lock:
            self._buf.append(line)
            now = time.monotonic()
            if now - self._last_flush > self._flush_every:
                self._flush_locked(now)

    def _flush_locked(self, now: float) -> None:
        if self._file.closed:
            return
        self._file.write("".join(self._buf))
        self._file.flush()
        self._buf.clear()
        self._last_flush = now

    def complete(self, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        """An event that ran from ``start`` to ``end`` (``time.time()`` seconds)."""
        args.setdefault("stage", self.stage)
        args.setdefault("attempt", self.attempt)
        self._emit({"name": name, "cat": cat, "ph": "X", "ts": round(start * 1e6, 1),
                    "dur": round(max(0.0, end - start) * 1e6, 1), "pid": self.rank, "tid": self.attempt, "args": args})

    def instant(self, name: str, cat: str, **args: Any) -> None:
        self._emit({"name": name, "cat": cat, "ph": "i", "s": "g", "ts": round(time.time() * 1e6, 1),
                    "pid": self.rank, "tid": self.attempt, "args": args})

    def flush(self) -> None:
        with self._lock:
            self._flush_locked(time.monotonic())

    def close(self) -> None:
        with self._lock:
            self._flush_locked(time.monotonic())
            if not self._file.closed:
                self._file.write("{}]\n")
                self._file.close()


def load_trace_file(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Events of one trace file, tolerating a missing closing bracket or a cut-off last line."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
        events = data["traceEvents"] if isinstance(data, dict) else data
    except json.JSONDecodeError:
        events = []
        for line in text.splitlines():
            line = line.strip().rstrip(",")
            if line in ("", "[", "]", "{}]"):
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                break  # the rank died while writing this line
    return [e for e in events if e != {}]  # ``{}``: the closing sentinel; anything else is kept, to be checked


def trace_files(directory: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(directory).glob("trace-attempt*-rank*.json"))


def merge_traces(paths: Iterable[str | os.PathLike[str]]) -> dict[str, Any]:
    """One Chrome trace (``{"traceEvents": [...]}``) from several rank/attempt files, sorted by time."""
    events: list[dict[str, Any]] = []
    for p in paths:
        events.extend(e for e in load_trace_file(p) if isinstance(e, dict))
    meta = [e for e in events if e.get("ph") == "M"]
    timed = sorted((e for e in events if e.get("ph") != "M"), key=lambda e: e.get("ts", 0))
    return {"traceEvents": meta + timed, "displayTimeUnit": "ms"}
