"""Virtual stages (a process holds several stages: interleaved 1F1B, ZBV, DualPipeV, ...) on real gloo processes.

Every schedule is minibatch SGD of the plain model (tied embeddings included, where ZBV and DualPipeV put the
first and the last stage on one process); a run checkpoints and resumes bitwise, resumes on another number of
processes under another schedule, and a process killed mid-window is replaced in place with a bitwise result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port, run_world
from ft_cases import checkpointed_case
from partitioner.plan import PlanError
from pipedream_ft.virtual import virtual_layout
from pipedream_reference import minibatch_sgd_reference
from runtime_cases import OPTIMIZERS, adam, data, gpt_case, gpt_plan, lm_data, lm_loss, mlp, plan_for, tiny_gpt

pytestmark = [pytest.mark.timeout(300)]

P4 = [[0, 1], [2, 3, 4], [5, 6], [7, 8]]
P6 = [[0, 1], [2], [3, 4], [5], [6], [7, 8]]


def _close(got: dict, want: dict, atol: float) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=atol, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv", "dualpipev"])
def test_gpt_with_tied_embeddings_on_two_processes_is_gradient_accumulation(schedule):
    """A 4-stage plan of the GPT example on 2 processes: interleaved 1F1B puts stages 0 and 2 on process 0, the V
    schedules stages 0 and 3 (so the tied embedding's two holders share a process)."""
    out = run_world(gpt_case, 2, gpt_plan(4), 12, "flush", "sgd", 4, None, None, schedule, timeout=300)
    want, losses = minibatch_sgd_reference(tiny_gpt(), lm_data, lm_loss, OPTIMIZERS["sgd"], 12, 4)
    for rank in (0, 1):
        _close(out[rank][1]["state"], want, 1e-6)
    assert out[0][1]["losses"] == pytest.approx(losses, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "looped_bfs"])
def test_three_stages_per_process_are_minibatch_sgd(schedule, tmp_path):
    """6 stages on 2 processes (v = 3), the split backward of interleaved zero bubble and looped BFS's order."""
    got = run_world(checkpointed_case, 2, str(tmp_path / "ckpt"), P6, None, 16, None, 8, "flush", "adam", False,
                    schedule)[0][1]
    want, losses = minibatch_sgd_reference(mlp(), data, torch.nn.functional.cross_entropy, adam, 16, 4)
    _close(got["state"], want, 1e-6)
    assert got["losses"] == pytest.approx(losses, abs=1e-6)
    assert got["stages"] == P6


@pytest.mark.slow
def test_interleaved_1f1b_resumes_bitwise_and_on_another_number_of_processes(tmp_path):
    """A run stopped at a committed checkpoint resumes bitwise; its checkpoint then resumes on 4 processes under
    straight 1F1B and again on 2 under ZBV (each stage's part restored where that stage now runs), ending at
    minibatch SGD's weights."""
    args = ("flush", "adam", False)
    straight = run_world(checkpointed_case, 2, str(tmp_path / "a"), P4, None, 24, None, 8, *args,
                         "interleaved_1f1b")[0][1]
    url = str(tmp_path / "b")
    run_world(checkpointed_case, 2, url, P4, None, 24, 12, 4, *args, "interleaved_1f1b")
    resumed = run_world(checkpointed_case, 2, url, P4, None, 24, None, 4, *args, "interleaved_1f1b")[0][1]
    assert resumed["resumed"] == 12
    for k, v in straight["state"].items():
        assert torch.equal(resumed["state"][k], v), k
    four = run_world(checkpointed_case, 4, url, P4, None, 32, None, 4, *args, "1f1b")[0][1]
    assert four["resumed"] == 24
    two = run_world(checkpointed_case, 2, url, P4, None, 40, None, 4, *args, "zbv")[0][1]
    assert two["resumed"] == 32
    want, losses = minibatch_sgd_reference(mlp(), data, torch.nn.functional.cross_entropy, adam, 40, 4)
    _close(two["state"], want, 1e-6)


WORKER = Path(__file__).with_name("ft_worker.py")


def _torchrun(tmp: Path, faults: str) -> tuple[Path, str]:
    out = tmp / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts=0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.5",
           str(WORKER), "--ckpt", str(tmp / "ckpt"), "--total", "48", "--every", "8", "--memory-every", "4",
           "--out", str(out), "--sleep-ms", "5", "--timeout", "8", "--mode", "flush", "--schedule", "zbv"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PIPEDREAM_FT_FAULTS=faults, PIPEDREAM_FT_RECOVERY="in-place")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    return out, log


@pytest.fixture(scope="module")
def zbv_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted ZBV run on 2 processes under in-place recovery."""
    return torch.load(_torchrun(tmp_path_factory.mktemp("zbv-straight"), "")[0])


@pytest.mark.slow
@pytest.mark.parametrize("fault, replaced", [("kill@rank=2,step=22", "1"), ("term@rank=1,step=19", "01")])
def test_a_process_of_a_zbv_pipeline_is_replaced_in_place_bitwise(zbv_reference, tmp_path, fault, replaced):
    """ZBV on 2 processes (stages 0 and 3 on process 0, 1 and 2 on process 1). Killed: the process holding logical
    ranks 2 and 3 dies mid-window; its supervisor starts a replacement that brings both stages back, process 0's
    stages recover in place. Preempted (SIGTERM to logical rank 1's process): an emergency checkpoint of every
    stage, then every process is replaced. Either way the result is the uninterrupted run's, bitwise."""
    out, log = _torchrun(tmp_path, fault)
    for process in (0, 1):
        said = f"pipedream-ft: rank {process}: training process died"
        assert (said in log) == (str(process) in replaced), log[-5000:]
    assert "joined epoch 1" in log, log[-5000:]
    if fault.startswith("term"):
        assert "preempted: checkpoint" in log, log[-5000:]
    else:
        assert "recovering in place" in log, log[-5000:]
    got = torch.load(out)
    assert sorted(got) == sorted(zbv_reference)
    for k, v in zbv_reference.items():
        assert torch.equal(got[k], v), k


def test_a_plan_that_does_not_fit_the_schedule_is_refused_naming_the_counts():
    plan4, plan6 = plan_for(mlp(), P4), plan_for(mlp(), P6)
    assert virtual_layout("1f1b", plan4, 2, 4) is None  # one stage per process: not virtual
    layout = virtual_layout("interleaved_1f1b", plan4, 2, 4)
    assert layout is not None and layout.placement == (0, 1, 0, 1)
    assert virtual_layout("zbv", plan4, 2, 4).placement == (0, 1, 1, 0)
    assert virtual_layout("looped_bfs", plan6, 2, 4).placement == (0, 1, 0, 1, 0, 1)
    with pytest.raises(PlanError, match=r"'zbv' runs 2 stages per process in a V: the plan has 6 stages for 2 "
                                        r"processes \(plan 4\)"):
        virtual_layout("zbv", plan6, 2, 4)
    with pytest.raises(PlanError, match=r"'interleaved_1f1b' runs v >= 2 stages per process: the plan has 4 stages "
                                        r"for 3 processes"):
        virtual_layout("interleaved_1f1b", plan4, 3, 4)
    with pytest.raises(PlanError, match="runs v >= 2 stages per process: the plan has 4 stages for 4 processes"):
        virtual_layout("interleaved_1f1b", plan4, 4, 4)


def _refused(kind: str) -> None:
    from pipedream_ft import PipelineConfig, PipelineTrainer
    from pipedream_ft.ft.replan import RePlanPolicy

    replicas = [2, 1, 1, 1] if kind == "replicated" else [1, 1, 1, 1]
    PipelineTrainer(mlp(), plan_for(mlp(), P4, replicas), loss_fn=torch.nn.functional.cross_entropy,
                    optimizer_factory=adam, config=PipelineConfig(mode="flush", schedule="interleaved_1f1b",
                                                                  timeout_s=20,
                                                                  replan=RePlanPolicy() if kind == "replan" else None))


def test_a_plan_that_cannot_run_virtual_stages_stops_every_process_with_the_same_line():
    out = run_world(_refused, 3, "counts", expect_failure=True)
    said = {o[1][1] for o in out.values()}
    assert said == {"schedule 'interleaved_1f1b' runs v >= 2 stages per process: the plan has 4 stages for 3 "
                    "processes (plan a multiple of 3, at least 6)"}, out
    assert {o[1][0] for o in out.values()} == {"PlanError"}
    out = run_world(_refused, 2, "replicated", expect_failure=True)
    assert {o[1][1] for o in out.values()} == {"virtual stages run a straight pipeline; the plan replicates stages "
                                               "[0]"}, out
    out = run_world(_refused, 2, "replan", expect_failure=True)
    assert {o[1][1].split(":")[0] for o in out.values()} == {"re-planning from measured costs (PipelineConfig(replan=...)) "
                                                             "does not run with virtual stages"}, out


def test_nccl_refuses_a_layout_that_puts_two_neighbouring_stages_on_one_gpu():
    from pipedream_ft.virtual import _check_backend

    plan4 = plan_for(mlp(), P4)
    _check_backend(virtual_layout("interleaved_1f1b", plan4, 2, 4), "nccl")  # neighbours on two processes
    _check_backend(virtual_layout("zbv", plan4, 2, 4), "gloo")
    with pytest.raises(PlanError, match="puts stages 1 and 2, which exchange tensors, on process 1: NCCL cannot "
                                        "connect two ranks on one GPU"):
        _check_backend(virtual_layout("zbv", plan4, 2, 4), "nccl")


@pytest.mark.slow
def test_a_resize_to_a_process_count_the_plan_does_not_fit_replans_and_stays_minibatch_sgd(tmp_path):
    """Elastic resize: 4 stages on 2 processes, then 3 processes (interleaved 1F1B re-plans 6 stages, 2 each,
    from the profile, and reshards the checkpoint into them), then 2 again under ZBV (4 stages): minibatch SGD's
    weights throughout."""
    url = str(tmp_path / "ckpt")
    args = ("flush", "adam", True)
    first = run_world(checkpointed_case, 2, url, P4, None, 16, None, 8, *args, "interleaved_1f1b")[0][1]
    assert first["position"] == 16 and first["stages"] == P4
    three = run_world(checkpointed_case, 3, url, P4, None, 32, None, 8, *args, "interleaved_1f1b")[0][1]
    assert three["resumed"] == 16 and len(three["stages"]) == 6
    back = run_world(checkpointed_case, 2, url, P4, None, 48, None, 8, *args, "zbv")[0][1]
    assert back["resumed"] == 32 and len(back["stages"]) == 4
    want, losses = minibatch_sgd_reference(mlp(), data, torch.nn.functional.cross_entropy, adam, 48, 4)
    _close(back["state"], want, 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "dualpipev"])
def test_each_process_runs_its_stages_actions_in_the_schedules_order_and_the_timeline_draws_it(schedule, tmp_path):
    """The traced run: each process's compute actions, both stages together, come in the order the schedule gives
    the process, and ``pipedream-timeline`` draws them, one row per process."""
    from pipedream_ft.observe.timeline import merge_traces, trace_files
    from pipedream_ft.observe.timeline_cli import main as timeline_main

    traces = tmp_path / "traces"
    run_world(checkpointed_case, 2, str(tmp_path / "ckpt"), P4, None, 16, None, 8, "flush", "adam", False,
              schedule, env={"PIPEDREAM_FT_TRACE_DIR": str(traces)})
    events = [e for e in merge_traces(trace_files(traces))["traceEvents"]
              if e.get("ph") == "X" and e["cat"] in ("forward", "backward", "weight")]
    layout = virtual_layout(schedule, plan_for(mlp(), P4), 2, 4)
    assert {e["pid"] for e in events} == {0, 1}
    for pid in (0, 1):
        ran = [(e["args"]["stage"], e["name"]) for e in sorted((e for e in events if e["pid"] == pid),
                                                               key=lambda e: e["ts"])]
        kind = {"F": "F", "B": "B", "I": "B", "W": "W"}
        want = [(a.stage, f"{kind[a.kind.value]}{a.index}") for a in layout.rank_actions(pid, 0, 16)
                if a.kind.value != "U"]
        assert ran == want, pid
    png = tmp_path / "virtual.png"
    assert timeline_main([str(traces), "-o", str(png)]) == 0 and png.stat().st_size > 0
