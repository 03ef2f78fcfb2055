"""Timelines: traces written by TimelineRecorder follow the 1F1B schedule, and draw as a pipeline figure."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

import pipedream_ft.observe.timeline as timeline
from pipedream_ft.observe.plot import BACKWARD_COLOR, FORWARD_COLOR, clip_trace, draw_timeline, summarize
from pipedream_ft.schedules.replicated import async_1f1b
from schedule_helpers import grid as unit_grid, run_replicated
from pipedream_ft.observe.timeline import TimelineRecorder, merge_traces, trace_files
from pipedream_ft.observe.timeline_cli import main
from png_helpers import hex_rgb, png_colours, png_size

pytestmark = pytest.mark.timeout(120)


CATS = {"F": "forward", "B": "backward", "U": "update"}


class FakeClock:
    """Stands in for the ``time`` module inside :mod:`pipedream_ft.observe.timeline`: ``time()`` is set by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    @staticmethod
    def monotonic() -> float:
        return time.monotonic()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock(1_700_000_000.0)
    monkeypatch.setattr(timeline, "time", fake)
    return fake


def write_attempt(directory: Path, clock: FakeClock, *, stages: int, start: int, stop: int, attempt: int = 0,
                  resumed_from: int | None = None, tick: float = 0.01, checkpoint_every: int | None = None,
                  killed: int | None = None) -> None:
    """One attempt of a straight pipeline, on the unit-time grid of the simulator, one recorder per rank.

    Every action takes 80% of a tick. ``killed`` names a rank whose file is cut off mid-line, without its
    closing bracket, as if the rank died while writing.
    """
    replicas = [1] * stages
    grid = unit_grid(run_replicated([[async_1f1b(s, 0, replicas, start, stop)] for s in range(stages)], replicas))
    recs = [TimelineRecorder(directory, rank=s, stage=s, replica=0, attempt=attempt) for s in range(stages)]
    for rec in recs:
        rec.instant("start", "restart", attempt=attempt, resumed_from=resumed_from)
    t0 = clock.now + tick
    for step, row in enumerate(grid):
        for rank, action in enumerate(row):
            if action is None:
                continue
            begin, end = t0 + step * tick, t0 + (step + 0.8) * tick
            key = "round" if action.kind == "U" else "minibatch"
            recs[rank].complete(f"{action.kind}{action.index}", CATS[action.kind], begin, end, replica=0, **{key: action.index})
            if action.kind == "U" and checkpoint_every and (action.index + 1) % checkpoint_every == 0:
                recs[rank].complete("checkpoint", "checkpoint", end, end + 0.6 * tick, cut=action.index + 1,
                                    snapshot_s=1e-4)
    clock.now = t0 + len(grid) * tick
    for rec in recs:
        rec.close()
    if killed is not None:
        path = recs[killed].path
        text = path.read_text()
        assert text.endswith("{}]\n")
        body = text[: -len("{}]\n")]
        path.write_text(body + body.splitlines()[-1][:17])  # half of the last line again, no closing bracket


def events_of(trace: dict[str, Any], rank: int, attempt: int, cats: tuple[str, ...]) -> list[dict[str, Any]]:
    return sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") == rank
                   and e.get("tid") == attempt and e.get("cat") in cats), key=lambda e: e["ts"])


def check_schedule(trace: dict[str, Any], *, stages: int, start: int, stop: int, attempt: int = 0,
                   strict: bool = True) -> None:
    """Every rank ran exactly its 1F1B actions in order, and every data dependency held in time.

    ``strict``: a consumer starts after its producer's event ended (simulated traces). A real rank records an
    event's end only after posting its send, so its consumer may start a little earlier: then the consumer
    must still start after the producer started.
    """
    replicas = [1] * stages
    first: dict[tuple[str, int, int], dict[str, Any]] = {}  # (kind, minibatch, stage) -> event
    for s in range(stages):
        got = events_of(trace, s, attempt, ("forward", "backward", "update"))
        assert [e["name"] for e in got] == [f"{a.kind}{a.index}" for a in async_1f1b(s, 0, replicas, start, stop)], f"rank {s}"
        for e in got:
            assert e["args"]["stage"] == s and e["args"]["attempt"] == attempt
            if e["cat"] != "update":
                first[(e["name"][0], e["args"]["minibatch"], s)] = e

    def after(later: dict[str, Any], earlier: dict[str, Any]) -> bool:
        return later["ts"] >= earlier["ts"] + (earlier["dur"] if strict else 0.0)

    for b in range(start, stop):
        for s in range(stages):
            f, bw = first[("F", b, s)], first[("B", b, s)]
            assert bw["ts"] >= f["ts"] + f["dur"], f"B{b} before F{b} ended on stage {s}"
            if s > 0:
                assert after(f, first[("F", b, s - 1)]), f"F{b} on stage {s} before stage {s - 1}"
            if s < stages - 1:
                assert after(bw, first[("B", b, s + 1)]), f"B{b} on stage {s} before stage {s + 1}"


# -- simulated traces -------------------------------------------------------------------------------------------


def test_simulated_trace_follows_the_schedule(tmp_path: Path, clock: FakeClock) -> None:
    write_attempt(tmp_path, clock, stages=4, start=0, stop=8, checkpoint_every=4)
    files = trace_files(tmp_path)
    assert [p.name for p in files] == [f"trace-attempt0-rank{r}.json" for r in range(4)]
    trace = merge_traces(files)
    check_schedule(trace, stages=4, start=0, stop=8)
    s = summarize(trace)
    assert (s.ranks, s.stages, s.attempts, s.minibatches, s.restarts) == ([0, 1, 2, 3], [0, 1, 2, 3], [0],
                                                                          set(range(8)), [])


def test_png_has_the_requested_size_and_both_colours(tmp_path: Path, clock: FakeClock) -> None:
    write_attempt(tmp_path, clock, stages=4, start=0, stop=8, checkpoint_every=4)
    trace = merge_traces(trace_files(tmp_path))
    out = tmp_path / "timeline.png"
    size = draw_timeline(trace, out, width_px=1234, title="4 stages, 8 minibatches")
    assert png_size(out) == size
    assert size[0] == 1234 and 200 < size[1] < 1000
    colours = png_colours(out)
    assert len(colours) > 10
    assert hex_rgb(FORWARD_COLOR) in colours and hex_rgb(BACKWARD_COLOR) in colours
    # a taller pipeline gives a taller figure
    many = tmp_path / "eight"
    write_attempt(many, clock, stages=8, start=0, stop=16)
    assert draw_timeline(merge_traces(trace_files(many)), tmp_path / "eight.png")[1] > size[1]


def test_thousands_of_events_draw_quickly(tmp_path: Path, clock: FakeClock) -> None:
    write_attempt(tmp_path, clock, stages=8, start=0, stop=400, tick=0.001)
    trace = merge_traces(trace_files(tmp_path))
    assert len(trace["traceEvents"]) > 9000
    t = time.perf_counter()
    assert draw_timeline(trace, tmp_path / "big.png", width_px=800)[0] == 800
    assert time.perf_counter() - t < 60
    assert hex_rgb(FORWARD_COLOR) in png_colours(tmp_path / "big.png")


def test_restart_merges_draws_and_is_summarised(tmp_path: Path, clock: FakeClock, capsys) -> None:
    write_attempt(tmp_path, clock, stages=4, start=0, stop=8, checkpoint_every=4, killed=3)
    clock.now += 0.5  # detection and relaunch
    write_attempt(tmp_path, clock, stages=4, start=4, stop=12, attempt=1, resumed_from=4, checkpoint_every=4)
    killed = tmp_path / "trace-attempt0-rank3.json"
    with pytest.raises(json.JSONDecodeError):
        json.loads(killed.read_text())
    trace = merge_traces(trace_files(tmp_path))
    check_schedule(trace, stages=4, start=0, stop=8, attempt=0)
    check_schedule(trace, stages=4, start=4, stop=12, attempt=1)
    s = summarize(trace)
    assert s.attempts == [0, 1] and s.minibatches == set(range(12))
    assert [(r.attempt, r.resumed_from) for r in s.restarts] == [(1, 4)]
    assert "restart (attempt 1, from checkpoint 4)" == s.restarts[0].label()
    assert "1 restart (attempt 1 from checkpoint 4)" in s.line()

    out, merged = tmp_path / "out" / "t.png", tmp_path / "out" / "merged.json"
    out.parent.mkdir()
    assert main([str(tmp_path), "-o", str(out), "--trace", str(merged), "--width", "900"]) == 0
    printed = capsys.readouterr().out.splitlines()
    width, height = png_size(out)
    assert width == 900
    assert printed[:2] == [f"wrote {merged} ({len(trace['traceEvents'])} events)", f"wrote {out} (900x{height} px)"]
    assert printed[2].startswith("4 ranks (4 stages), 2 attempts, 12 minibatches seen (0-11), 1 restart")
    assert hex_rgb("#d62728") in png_colours(out)  # the restart line
    assert json.loads(merged.read_text())["traceEvents"] == trace["traceEvents"]

    # the merged file reads back on its own, and --last keeps only the tail (the second attempt)
    again = tmp_path / "again.png"
    assert main([str(merged), "-o", str(again), "--last", "0.1"]) == 0
    assert "the last 0.1 s" in capsys.readouterr().out
    tail = clip_trace(trace, 0.1)
    assert {e["tid"] for e in tail["traceEvents"] if e.get("ph") != "M"} == {1}
    assert tail["otherData"]["t0_us"] == min(e["ts"] for e in trace["traceEvents"] if e.get("ph") != "M")
    assert summarize(tail).restarts == []  # the restart itself happened before the window


def test_no_restart_for_a_fresh_attempt(tmp_path: Path, clock: FakeClock, capsys) -> None:
    write_attempt(tmp_path, clock, stages=2, start=0, stop=4)
    assert main([str(tmp_path / "trace-attempt0-rank1.json"), "-o", str(tmp_path / "one.png")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "1 rank (1 stage), 1 attempt, 4 minibatches seen (0-3), 0 restarts")


# -- command-line errors ----------------------------------------------------------------------------------------


def _error_case(tmp_path: Path, clock: FakeClock, case: str) -> tuple[list[str], Path]:
    good = tmp_path / "good"
    write_attempt(good, clock, stages=2, start=0, stop=4)
    out = tmp_path / "t.png"
    if case == "missing path":
        return [str(tmp_path / "nope"), "-o", str(out)], out
    if case == "no trace files":
        (tmp_path / "empty").mkdir()
        return [str(tmp_path / "empty"), "-o", str(out)], out
    if case == "invalid JSON":
        bad = tmp_path / "bad.json"
        bad.write_text("this is not json\n")
        return [str(bad), "-o", str(out)], out
    if case == "broken merged JSON":
        bad = tmp_path / "bad.json"
        bad.write_text('{"traceEvents": [{"name": "F0",')
        return [str(bad), "-o", str(out)], out
    if case == "not UTF-8":
        bad = good / "trace-attempt1-rank0.json"
        bad.write_bytes(b"\xff\xfe\x00garbage")
        return [str(good), "-o", str(out)], out
    if case == "unwritable output":
        out = tmp_path / "no" / "such" / "dir" / "t.png"
        return [str(good), "-o", str(out)], out
    if case == "output is a directory":
        return [str(good), "-o", str(tmp_path)], tmp_path / "never.png"
    if case == "bad width":
        return [str(good), "-o", str(out), "--width", "ten"], out
    if case == "bad --last":
        return [str(good), "-o", str(out), "--last", "-1"], out
    if case == "unwritable --trace":
        return [str(good), "-o", str(out), "--trace", str(tmp_path / "missing" / "m.json")], out
    if case in MALFORMED:
        bad = tmp_path / "bad.json"
        bad.write_text(MALFORMED[case][0])
        return [str(bad), "-o", str(out)], out
    if case == "a malformed event among good ones":
        with open(good / "trace-attempt0-rank1.json", "a") as f:  # the file is a closed array: add an event
            f.write('{"name":"F9","ph":"X","ts":"soon","dur":1,"pid":1}\n')
        return [str(good), "-o", str(out)], out
    raise AssertionError(case)


MALFORMED = {
    # case: (file, what the error line must say)
    "0 events": ('{"traceEvents": []}', "no trace events"),
    "metadata only": ('{"traceEvents": [{"name": "process_name", "ph": "M", "pid": 0, "args": {}}]}',
                      "no trace events"),
    "events without a time": ('{"traceEvents": [{"name": "F1", "ph": "X", "pid": 0}]}',
                              '1 of 1 trace events in'),
    "a time that is not a number": ('{"traceEvents": [{"name": "F1", "ph": "X", "ts": "abc", "dur": 1, "pid": 0}]}',
                                    '"ts" must be a finite number, got "abc"'),
    "a negative duration, a pid that is not a rank": (
        '{"traceEvents": [{"name": "F1", "ph": "X", "ts": 5, "dur": -3, "pid": 0},'
        ' {"name": "F2", "ph": "X", "ts": 5, "dur": 3, "pid": "a"}]}', "2 of 2 trace events"),
    "not objects": ('[1, 2, "x"]', "not an object: 1"),
    "an object without a phase": ('{"traceEvents": [{"foo": 1}]}', 'no "ph" (phase)'),
    "an infinite time": ('[{"ph":"X","ts":1e400,"dur":1,"pid":0,"name":"F0"}]', '"ts" must be a finite number'),
}


@pytest.mark.parametrize("case", ["missing path", "no trace files", "invalid JSON", "broken merged JSON",
                                  "not UTF-8", "unwritable output", "output is a directory", "bad width",
                                  "bad --last", "unwritable --trace", *MALFORMED,
                                  "a malformed event among good ones"])
def test_cli_errors(tmp_path: Path, clock: FakeClock, capsys, case: str) -> None:
    argv, out = _error_case(tmp_path, clock, case)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipedream-timeline: error: "), captured.err
    if case in MALFORMED:
        assert MALFORMED[case][1] in lines[0], lines[0]
    if case == "a malformed event among good ones":
        assert "trace-attempt0-rank1.json" in lines[0] and "event" in lines[0] and "'F9'" in lines[0], lines[0]
    assert "Traceback" not in captured.err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no partial or temporary files


# -- a real run -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_run_follows_the_schedule(tmp_path: Path) -> None:
    from dist_helpers import run_world
    from ft_cases import checkpointed_case

    traces = tmp_path / "traces"
    run_world(checkpointed_case, 4, str(tmp_path / "ckpt"), [[0, 1], [2, 3], [4, 5], [6, 7, 8]], None, 24, None, 4,
              timeout=100, env={"PIPEDREAM_FT_TRACE_DIR": str(traces)})
    assert [p.name for p in trace_files(traces)] == [f"trace-attempt0-rank{r}.json" for r in range(4)]
    trace = merge_traces(trace_files(traces))
    check_schedule(trace, stages=4, start=0, stop=24, strict=False)
    s = summarize(trace)
    assert (s.ranks, s.attempts, s.minibatches, s.restarts) == ([0, 1, 2, 3], [0], set(range(24)), [])
    assert any(e.get("cat") == "checkpoint" for e in trace["traceEvents"])
    out = tmp_path / "real.png"
    assert main([str(traces), "-o", str(out)]) == 0
    assert png_size(out)[0] == 1600
    colours = png_colours(out)
    assert hex_rgb(FORWARD_COLOR) in colours and hex_rgb(BACKWARD_COLOR) in colours


def test_a_rank_of_several_stages_draws_its_later_stages_hatched(tmp_path: Path) -> None:
    from pipedream_ft.observe.plot import _first_stages
    from pipedream_ft.schedules import Costs, build, save_trace, to_trace
    from pipedream_ft.schedules import simulate as simulate_paper

    sched, placement = build("zbv", 2, 4)
    timeline_ = simulate_paper(sched, Costs.uniform(4), placement)
    # ZBV on 2 ranks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; the later one of each is hatched
    assert _first_stages(to_trace(timeline_)["traceEvents"]) == {0: 0, 1: 1}
    straight = simulate_paper(build("1f1b", 2, 4).schedule, Costs.uniform(2))
    assert _first_stages(to_trace(straight)["traceEvents"]) == {}  # one stage per rank: nothing hatched
    save_trace(timeline_, tmp_path / "zbv.json")
    assert main([str(tmp_path / "zbv.json"), "-o", str(tmp_path / "zbv.png")]) == 0
    assert hex_rgb(FORWARD_COLOR) in png_colours(tmp_path / "zbv.png")
