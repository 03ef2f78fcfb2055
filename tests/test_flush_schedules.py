"""``flush`` mode's schedules (1F1B, GPipe, ZB-H1 with its split backward) on real gloo processes: every one is
gradient accumulation of the plain model (tied weights and shape arithmetic included), and a ZB-H1 run
checkpoints and resumes bitwise; plus the orders themselves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dist_helpers import run_world
from feature_cases import MODELS, ToyData, feature_case, minibatch_reference, sequential_data
from pipedream_ft import PipelineConfig
from pipedream_ft.observe.plot import WEIGHT_COLOR
from pipedream_ft.observe.timeline import merge_traces, trace_files
from pipedream_ft.observe.timeline_cli import main as timeline_main
from pipedream_ft.pipeline.modes import Flush
from pipedream_ft.schedules import Action, ScheduleError
from pipedream_ft.schedules.replicated import synchronous
from schedule_helpers import ran, run_replicated
from pipedream_reference import minibatch_sgd_reference
from png_helpers import hex_rgb, png_colours
from runtime_cases import OPTIMIZERS, gpt_case, gpt_plan, lm_data, lm_loss, planned_schedule_case, tiny_gpt
from partitioner.plan import PlanError

MLP4 = [[0, 1], [2, 3, 4], [5, 6], [7, 8]]


def _close(got: dict, want: dict, atol: float) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=atol, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_gpt_with_tied_embeddings_is_gradient_accumulation_under_every_schedule(schedule):
    out = run_world(gpt_case, 4, gpt_plan(4), 12, "flush", "sgd", 4, None, None, schedule, timeout=300)
    want, losses = minibatch_sgd_reference(tiny_gpt(), lm_data, lm_loss, OPTIMIZERS["sgd"], 12, 4)
    _close(out[0][1]["state"], want, 1e-6)
    assert out[0][1]["losses"] == pytest.approx(losses, abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zb_h1_with_a_scheduler_and_global_clipping_is_minibatch_sgd():
    spec = {"stages": MLP4, "mode": "flush", "schedule": "zb_h1", "flush_every": 4, "total": 16, "sched": "lambda",
            "clip": 0.25}
    out = run_world(feature_case, 4, spec)
    want = minibatch_reference(MODELS["mlp"](), sequential_data(ToyData(600)), 16, 4, "sgd", sched="lambda", clip=0.25)
    for rank in range(4):
        _close(out[rank][1]["state"], want["state"], 1e-6)
    assert out[0][1]["losses"] == pytest.approx(want["losses"], abs=1e-6)
    assert sum(n > 0.25 for n in want["norms"]) >= 2  # clipping was active


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_zb_h1_run_checkpoints_and_resumes_bitwise_and_its_timeline_shows_each_weight_gradient(tmp_path):
    base = {"stages": MLP4, "mode": "flush", "schedule": "zb_h1", "flush_every": 4, "total": 24, "opt": "adam"}
    url = str(tmp_path / "ckpt")
    traces = tmp_path / "traces"
    straight = run_world(feature_case, 4, base, env={"PIPEDREAM_FT_TRACE_DIR": str(traces)})[0][1]
    events = [e for e in merge_traces(trace_files(traces))["traceEvents"] if e.get("ph") == "X"]
    for rank in range(4):
        mine = sorted((e for e in events if e["pid"] == rank), key=lambda e: e["ts"])
        order = [e["name"] for e in mine if e["cat"] in ("backward", "weight")]
        assert sorted(n for n in order if n[0] == "W") == sorted(f"W{b}" for b in range(24)), (rank, order)
        assert all(order.index(f"B{b}") < order.index(f"W{b}") for b in range(24)), (rank, order)
    png = tmp_path / "zb.png"
    assert timeline_main([str(traces), "-o", str(png)]) == 0
    assert hex_rgb(WEIGHT_COLOR) in png_colours(png)
    run_world(feature_case, 4, {**base, "url": url, "every": 8, "stop_at": 12})
    resumed = run_world(feature_case, 4, {**base, "url": url, "every": 8})[0][1]
    assert resumed["resumed"] == 8
    for k, v in straight["state"].items():
        assert torch.equal(resumed["state"][k], v), k


def test_gpipe_runs_every_forward_then_every_backward_then_the_update():
    assert [str(a) for a in synchronous("gpipe", 1, 0, [1, 1, 1], 4, 8, 2)] == (
        "1F4 1F5 1B4 1B5 1U2 1F6 1F7 1B6 1B7 1U3".split())


@pytest.mark.parametrize("stages, window", [(4, 4), (4, 8), (3, 2)])
def test_zb_h1_splits_every_backward_and_the_pipeline_completes(stages, window):
    plans = [[synchronous("zb_h1", s, 0, [1] * stages, 0, 2 * window, window)] for s in range(stages)]
    for s, (acts,) in enumerate(plans):
        kinds = {k: sorted(a.index for a in acts if a.kind == k) for k in "FIWB"}
        assert kinds["B"] == [] and kinds["F"] == kinds["I"] == kinds["W"] == list(range(2 * window))
        assert all(acts.index(Action(s, "I", b)) < acts.index(Action(s, "W", b)) for b in range(2 * window))
        # stage s defers its first s weight gradients (the last stage: all of them, into its idle drain)
        first_w = next(i for i, a in enumerate(acts) if a.kind == "W")
        assert acts[first_w - 1] == Action(s, "I", min(s, window - 1))
        assert [a for a in acts if a.kind == "U"] == [Action(s, "U", 0), Action(s, "U", 1)]
    timeline = run_replicated(plans, [1] * stages)
    assert ran(timeline) == {s: p[0] for s, p in enumerate(plans)}  # every action ran, in its order


def test_a_schedule_that_cannot_run_is_refused_with_what_runs():
    assert PipelineConfig(mode="flush", schedule="interleaved_1f1b").schedule == "interleaved_1f1b"  # virtual
    with pytest.raises(ValueError, match="'interleaved_1f1b' is a synchronous schedule .*mode 'stash' runs"):
        PipelineConfig(mode="stash", schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match="mode 'stash' runs PipeDream's asynchronous 1F1B"):
        PipelineConfig(mode="stash", schedule="zb_h1")
    with pytest.raises(ValueError, match="'nope' is unknown; mode 'flush' runs 1f1b, gpipe, zb_h1, interleaved_1f1b, "
                                         "interleaved_zero_bubble, looped_bfs, zbv, dualpipev"):
        PipelineConfig(mode="flush", schedule="nope")
    with pytest.raises(PlanError, match=r"straight pipeline; the plan replicates stages \[0\]"):
        Flush(4, "zb_h1").check(SimpleNamespace(replicas=(2, 1)))  # type: ignore[arg-type]
    assert PipelineConfig(mode="flush", schedule="gpipe").schedule == "gpipe"


def test_schedule_plan_runs_the_schedule_the_plan_records():
    """``PipelineConfig(schedule="plan")``: flush mode runs what ``pipedream-partition --schedule`` recorded; a
    plan that records none, PipeDream's asynchronous 1F1B or a table stops every rank with one line saying what to
    pass instead."""
    default = [str(a) for a in synchronous("1f1b", 0, 0, [1, 1], 0, 4, 4)]
    for name in ("zb_h1", "gpipe"):
        got = run_world(planned_schedule_case, 2, name)
        for stage in (0, 1):
            assert got[stage][1] == [str(a) for a in synchronous(name, stage, 0, [1, 1], 0, 4, 4)]
        assert got[0][1] != default  # the plan's choice, not the default 1F1B
    for recorded, said in [(None, "the plan records no schedule"),
                           ("pipedream", "the plan chose PipeDream's asynchronous 1F1B"),
                           ("zb4.csv", "the plan chose the table 'zb4.csv'")]:
        out = run_world(planned_schedule_case, 2, recorded, expect_failure=True)
        assert all(not out[r][0] and out[r][1][0] == "PlanError" for r in (0, 1))
        msgs = {out[r][1][1] for r in (0, 1)}
        assert len(msgs) == 1 and msgs.pop().startswith(f"schedule 'plan': {said}")
    with pytest.raises(ValueError, match="schedule 'plan' is flush mode's schedule as the plan records it"):
        PipelineConfig(mode="stash", schedule="plan")


def test_a_weight_gradient_before_its_input_gradient_deadlocks_in_the_simulator():
    bad = [[[Action(0, "F", 0), Action(0, "W", 0), Action(0, "I", 0), Action(0, "U", 0)]]]
    with pytest.raises(ScheduleError, match="0W0"):
        run_replicated(bad, [1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_schedule_given_as_a_table_is_minibatch_sgd_and_resumes_bitwise(tmp_path):
    # a window's order no built-in runs: every forward, then whole backwards for even minibatches and split ones
    # for odd, whose weight gradients wait for the end of the window
    rows = [[f"{s}F{b}" for b in range(4)] + [f"{s}B{b}" if b % 2 == 0 else f"{s}I{b}" for b in range(4)]
            + [f"{s}W1", f"{s}W3"] for s in range(4)]
    table = tmp_path / "mixed.csv"
    table.write_text("\n".join(",".join(r) for r in rows) + "\n")
    base = {"stages": MLP4, "mode": "flush", "schedule": str(table), "flush_every": 4, "total": 16, "opt": "adam"}
    straight = run_world(feature_case, 4, base)
    want = minibatch_reference(MODELS["mlp"](), sequential_data(ToyData(600)), 16, 4, "adam")
    for rank in range(4):
        _close(straight[rank][1]["state"], want["state"], 1e-6)
    assert straight[0][1]["losses"] == pytest.approx(want["losses"], abs=1e-6)
    url = str(tmp_path / "ckpt")
    run_world(feature_case, 4, {**base, "url": url, "every": 4, "stop_at": 8})
    resumed = run_world(feature_case, 4, {**base, "url": url, "every": 4})[0][1]
    assert resumed["resumed"] == 8
    for k, v in straight[0][1]["state"].items():
        assert torch.equal(resumed["state"][k], v), k
