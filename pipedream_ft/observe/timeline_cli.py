"""``pipedream-timeline``: draw what every rank did as a PNG, from the trace files of a run.

Usage::

    pipedream-timeline TRACE_DIR_OR_FILE -o timeline.png [--trace merged.json] [--title TEXT] [--width PX]
                       [--last SECONDS]

``TRACE_DIR_OR_FILE`` is a directory of per-rank files ``trace-attempt{A}-rank{R}.json`` (as written with
``PIPEDREAM_FT_TRACE_DIR``), which are merged, or one trace file (a merged ``{"traceEvents": [...]}`` or a
single rank's array). ``--trace`` also writes the merged trace, for https://ui.perfetto.dev. Errors print one
line ``pipedream-timeline: error: ...`` and exit with status 2; the output files are then left untouched.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from profiler.cliutil import CliError, OneLineParser, check_writable, number, run_cli

from .plot import clip_trace, draw_timeline, summarize
from .timeline import load_trace_file, merge_traces, trace_files

__all__ = ["check_events", "main", "load_trace"]

PROG = "pipedream-timeline"


_WIDTH = number("width", integer=True, low=200, high=20000, unit=" of pixels")
_SECONDS = number("--last", low=0, unit=" of seconds")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Draw a pipeline timeline (one row per rank) from pipedream-ft trace files.")
    p.add_argument("source", metavar="TRACE_DIR_OR_FILE", help="directory of per-rank trace files, or one trace file")
    p.add_argument("-o", "--output", default="timeline.png", metavar="PNG", help="image to write (default timeline.png)")
    p.add_argument("--trace", metavar="JSON", help="also write the merged trace here")
    p.add_argument("--title", help="title above the figure")
    p.add_argument("--width", type=_WIDTH, default=1600, metavar="PX", help="image width in pixels (default 1600)")
    p.add_argument("--last", type=_SECONDS, metavar="SECONDS", help="draw only the last SECONDS of the run")
    return p




def _check_file(path: Path) -> None:
    """Raise :class:`CliError` unless ``path`` reads as a (possibly truncated) trace."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CliError(f"{str(path)!r} is not a trace file: not UTF-8 text") from None
    except OSError as exc:
        raise CliError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    head = text.lstrip()
    if head.startswith("["):
        return  # a rank's array, perhaps without its closing bracket: load_trace_file copes
    if not head.startswith("{"):
        raise CliError(f"{str(path)!r} is not a trace file: invalid JSON")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{str(path)!r} is not a trace file: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data.get("traceEvents"), list):
        raise CliError(f"{str(path)!r} is not a trace file: no \"traceEvents\" list")


def load_trace(source: str | os.PathLike[str]) -> dict[str, Any]:
    """The merged trace of a directory of per-rank files, or of one trace file; :class:`CliError` if none."""
    src = Path(source)
    if src.is_dir():
        paths = trace_files(src)
        if not paths:
            raise CliError(f"no trace files (trace-attempt*-rank*.json) in {str(src)!r}")
    elif src.exists():
        paths = [src]
    else:
        raise CliError(f"{str(src)!r} does not exist")
    for p in paths:
        _check_file(p)
        try:
            check_events({"traceEvents": load_trace_file(p)}, str(p), empty_ok=len(paths) > 1)
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read the trace in {str(p)!r}: {exc}") from None
    try:
        trace = merge_traces(paths)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"cannot read the trace in {str(src)!r}: {exc}") from None
    check_events(trace, str(src))
    return trace


def _event_problem(event: Any) -> str | None:
    """What is wrong with one trace event (as this package writes them), or ``None``."""
    if not isinstance(event, dict):
        return f"not an object: {json.dumps(event)[:60]}"
    ph = event.get("ph")
    if not isinstance(ph, str) or not ph:
        return "no \"ph\" (phase)"
    if ph == "M":
        return None
    if not isinstance(event.get("name"), str):
        return "no \"name\""
    if not isinstance(event.get("pid"), int) or isinstance(event.get("pid"), bool):
        return f"\"pid\" must be an integer, got {json.dumps(event.get('pid'))}"
    for key in ("ts", "dur") if ph == "X" else ("ts",):
        value = event.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (key == "dur" and value < 0):
            return f"\"{key}\" must be a finite number{' >= 0' if key == 'dur' else ''}, got {json.dumps(value)}"
    return None


def check_events(trace: dict[str, Any], source: str, *, empty_ok: bool = False) -> None:
    """Raise :class:`CliError` (one line) if ``trace`` has no timed event, or any malformed one: naming how many,
    the first and what is wrong with it. (A rank killed mid-write leaves a cut-off last line, which the loader
    drops: that is not malformed.)"""
    events = trace.get("traceEvents", [])
    bad = [(i, problem) for i, e in enumerate(events) if (problem := _event_problem(e)) is not None]
    if bad:
        i, problem = bad[0]
        name = events[i].get("name") if isinstance(events[i], dict) else None
        raise CliError(f"{len(bad)} of {len(events)} trace events in {source!r} are malformed; the first, "
                       f"event {i}{f' ({name!r})' if isinstance(name, str) else ''}: {problem}")
    if not empty_ok and not any(e.get("ph") != "M" for e in events):
        raise CliError(f"no trace events in {source!r} (0 events to draw)")


def _stage_json(trace: dict[str, Any], path: Path) -> Path:
    """Write ``trace`` next to ``path`` under a temporary name (renamed into place once the PNG is drawn)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise CliError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    return Path(tmp)


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    output = Path(args.output)
    merged_path = Path(args.trace) if args.trace else None
    if merged_path is not None and merged_path.resolve() == output.resolve():
        raise CliError("--trace and -o name the same file")
    trace = load_trace(args.source)
    for p in (output, merged_path):
        if p is not None:
            check_writable(p)
    drawn = clip_trace(trace, args.last) if args.last else trace
    staged = _stage_json(trace, merged_path) if merged_path is not None else None
    try:
        try:
            width, height = draw_timeline(drawn, output, width_px=args.width, title=args.title)
        except OSError as exc:
            raise CliError(f"cannot write {str(output)!r}: {exc.strerror or exc}") from None
        except (ValueError, TypeError) as exc:
            raise CliError(f"cannot draw the trace: {exc}") from None
        if staged is not None and merged_path is not None:
            os.replace(staged, merged_path)
            staged = None
    finally:
        if staged is not None:
            staged.unlink(missing_ok=True)
    if merged_path is not None:
        print(f"wrote {merged_path} ({len(trace['traceEvents'])} events)")
    print(f"wrote {output} ({width}x{height} px)" + (f", the last {args.last:g} s" if args.last else ""))
    print(summarize(trace).line())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 on an error)."""
    return run_cli(PROG, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
