"""What ``pipedream-partition`` prints (partitioner/report.py): one set of figures, each saying what it is, in one
vocabulary (processes and stages); a plan of pure data parallelism said so at plan time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from partitioner import partition
from partitioner.cli import main
from partitioner.plan import load_plan
from partitioner.schedule_choice import format_ranking, rank_schedules
from profiler.profile import Layer, Profile

pytestmark = pytest.mark.timeout(60)


def _profile(forward: list[float], parameter_bytes: float = 1e6) -> Profile:
    layers = tuple(Layer(str(i), "Linear", f, 2 * f, 1e5, parameter_bytes) for i, f in enumerate(forward))
    return Profile(layers, tuple((i, i + 1) for i in range(len(layers) - 1)))


def _plan(tmp_path: Path, capsys, profile: Profile, *args: str) -> tuple[str, Path]:
    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    profile.save(prof)
    assert main([str(prof), *args, "-o", str(out)]) == 0
    return capsys.readouterr().out, out


def _ranking_rows(text: str) -> dict[str, list[str]]:
    """The ranking table's rows by schedule name (its first word)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("schedule "))
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("train with"):
            break
        rows[line.split()[0]] = line.split()
    return rows


def test_a_virtual_plan_gives_one_figure_per_minibatch_and_per_step_and_names_each_stages_process(tmp_path, capsys):
    profile = _profile([1.0] * 16)
    text, out = _plan(tmp_path, capsys, profile, "-n", "2", "-b", "1e12", "--straight", "--schedule",
                      "interleaved_1f1b", "--microbatches", "4")
    plan = load_plan(out)
    assert plan.num_stages == 4
    # the stage table says which process holds each stage (interleaved: stage s on process s % 2), not 4 ranks
    lines = text.splitlines()
    assert lines[0].split() == ["stage", "layers", "process", "ms/minibatch"]
    assert [int(line.split()[2]) for line in lines[1:5]] == [0, 1, 0, 1]
    assert "4 stages on 2 processes, 2 each (where interleaved_1f1b places them)" in text
    assert "world" not in text and " ranks" not in text
    # one predicted figure per minibatch, the chosen schedule's, the same in the summary, the ranking and the plan
    predicted = re.findall(r"predicted time per minibatch: ([\d.]+) ms with interleaved_1f1b \(simulated, see the "
                           r"schedules below\), ([\d.]+) ms per step of 4 minibatches \(flush_every=4\)", text)
    assert len(predicted) == 1 and text.count("predicted time per minibatch") == 1, text
    per_minibatch, per_step = map(float, predicted[0])
    row = _ranking_rows(text)["interleaved_1f1b"]
    assert row[-1] == "chosen" and (float(row[3]), float(row[4])) == (per_minibatch, per_step)
    assert per_minibatch == pytest.approx(plan.time_per_minibatch_s * 1e3, abs=1e-3)
    assert per_step == pytest.approx(4 * plan.time_per_minibatch_s * 1e3, abs=1e-3)
    # data parallelism on the same 2 processes, not on the plan's 4 stages
    two = partition(profile, 2, 1e12, straight=True)
    assert plan.data_parallel_time_s == pytest.approx(two.data_parallel_time_s)
    assert f"data parallelism (the whole model on each of the 2 processes) is predicted " \
           f"{plan.data_parallel_time_s * 1e3:.3f} ms per minibatch" in text
    assert f"speedup over data parallelism: {plan.speedup_over_data_parallel:.3f}x" in text
    assert "(2 stages/process)" in text and "stages/worker" not in text


def test_a_schedule_on_one_stage_per_process_is_the_plans_figure_and_the_slowest_stage_is_named_apart(tmp_path, capsys):
    text, out = _plan(tmp_path, capsys, _profile([1.0] * 8), "-n", "4", "-b", "1e12", "--straight", "--schedule",
                      "1f1b", "--microbatches", "8")
    plan = load_plan(out)
    row = _ranking_rows(text)["1f1b"]
    assert row[-1] == "chosen"
    assert (f"predicted time per minibatch: {row[1]} ms with 1f1b (simulated, see the schedules below), {row[2]} ms "
            "per step of 8 minibatches (flush_every=8); the slowest stage alone: 6.000 ms, the pace with no "
            "flush") in text
    assert float(row[1]) == pytest.approx(plan.time_per_minibatch_s * 1e3, abs=1e-3)
    assert "4 stages on 4 processes, one stage each" in text
    # the asynchronous schedule steps every minibatch: no figure per step
    assert _ranking_rows(text)["pipedream"][3] == "-"


def test_a_data_parallel_plan_says_so_in_one_line_and_how_to_get_a_pipeline(tmp_path, capsys):
    profile = _profile([1.0, 1.0, 1.0, 10.0, 1.0, 1.0, 1.0, 1.0])  # one heavy layer: no pipeline balances it
    text, out = _plan(tmp_path, capsys, profile, "-n", "4", "-b", "1e12")
    plan = load_plan(out)
    assert plan.num_stages == 1 and plan.world_size == 4
    notes = [line for line in text.splitlines() if "pure data parallelism" in line]
    assert len(notes) == 1, text
    note = notes[0]
    assert note.startswith("note: this plan is pure data parallelism, no pipeline: one stage, the whole model "
                           "replicated on all 4 processes; at 1e+12 bytes/s it is predicted faster than any pipeline")
    straight = partition(profile, 4, 1e12, straight=True)
    assert f"a straight pipeline of 4 stages: {straight.time_per_minibatch_s * 1e3:.3f} ms per minibatch" in note
    assert "busy machine" in note and note.endswith("plan with --straight to train a pipeline anyway")
    assert "speedup over data parallelism: 1.000x (this plan is data parallelism)" in text
    # forced into a pipeline: no note, and the speedup under 1 says what it means and why
    text, _ = _plan(tmp_path, capsys, profile, "-n", "4", "-b", "1e12", "--straight")
    assert "pure data parallelism" not in text
    line = next(line for line in text.splitlines() if line.startswith("speedup over data parallelism"))
    assert re.fullmatch(r"speedup over data parallelism: 0\.\d{3}x \(data parallelism's time per minibatch over this "
                        r"plan's\): under 1, this plan is predicted [\d.]+x slower than data parallelism on 4 "
                        r"processes at 1e\+12 bytes/s; --straight forced a pipeline \(without it the planner picks "
                        r"the fastest plan, data parallelism included\)", line), line


def test_a_pipeline_faster_than_data_parallelism_says_its_speedup_means_that(tmp_path, capsys):
    # big weights on a slow link: data parallelism's all-reduce costs more than a pipeline's transfers
    text, out = _plan(tmp_path, capsys, _profile([1.0] * 8, parameter_bytes=1e8), "-n", "4", "-b", "1e8")
    plan = load_plan(out)
    assert plan.num_stages > 1 and plan.speedup_over_data_parallel > 1
    assert "pure data parallelism" not in text
    speedup = plan.speedup_over_data_parallel
    assert (f"speedup over data parallelism: {speedup:.3f}x (data parallelism's time per minibatch over this plan's): "
            f"at or above 1, this plan is predicted {speedup:.2f}x as fast as data parallelism on 4 processes at 1e+08 "
            "bytes/s") in text
    assert "predicted time per minibatch" in text and "the slowest stage's: the pipeline's pace once full" in text


def test_the_ranking_table_gives_a_figure_per_step_only_when_told_the_minibatches_per_step():
    profile = _profile([1.0] * 8)
    ranking = rank_schedules(partition(profile, 4, 1e12, straight=True), profile, 8)
    assert format_ranking(ranking).splitlines()[0].split() == ["schedule", "ms/minibatch", "bubble", "peak",
                                                               "memory/process"]
    table = format_ranking(ranking, "gpipe", microbatches=8).splitlines()
    assert table[0].split()[:3] == ["schedule", "ms/minibatch", "ms/step"]
    gpipe = next(line.split() for line in table if line.startswith("gpipe"))
    assert float(gpipe[2]) == pytest.approx(8 * float(gpipe[1]), abs=2e-3) and gpipe[-1] == "chosen"
