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
from pipedream_ft.schedules.actions import COMMUNICATION, Kind
from pipedream_ft.virtual import process_actions, stage_links, virtual_layout
from pipedream_reference import minibatch_sgd_reference
from feature_cases import ToyData, minibatch_reference, sequential_data, stages_feature_case
from runtime_cases import (OPTIMIZERS, adam, data, gpt_case, gpt_plan, lm_data, lm_loss, mlp, plan_for, stages_case,
                           tiny_gpt)

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
@pytest.mark.parametrize("schedule, stages", [("zbv", 2), ("dualpipev", 2), ("interleaved_1f1b", 4),
                                              ("interleaved_zero_bubble", 4)])
def test_one_process_holding_every_stage_is_gradient_accumulation(schedule, stages):
    """The shape that runs on one GPU under NCCL (``benchmarks/check_stages.py``): a single process holds every
    stage of the GPT (two in a V, four interleaved), nothing travels, the tied embedding's holders share it."""
    out = run_world(gpt_case, 1, gpt_plan(stages), 12, "flush", "sgd", 4, None, None, schedule, timeout=300)
    want, losses = minibatch_sgd_reference(tiny_gpt(), lm_data, lm_loss, OPTIMIZERS["sgd"], 12, 4)
    _close(out[0][1]["state"], want, 1e-6)
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
@pytest.mark.parametrize("fault, replaced", [("kill@rank=1,step=22", "1"), ("term@rank=0,step=19", "01")])
def test_a_process_of_a_zbv_pipeline_is_replaced_in_place_bitwise(zbv_reference, tmp_path, fault, replaced):
    """ZBV on 2 processes (stages 0 and 3 on process 0, 1 and 2 on process 1), each one rank. Killed: process 1
    dies mid-window; its supervisor starts a replacement that brings both of its stages back, process 0's stages
    recover in place. Preempted (SIGTERM to process 0): an emergency checkpoint of every stage, then every process
    is replaced. Either way the result is the uninterrupted run's, bitwise."""
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
    out = run_world(_refused, 2, "replan", expect_failure=True)  # re-planning runs, from a durable tier
    assert {o[1][1].split(":")[0] for o in out.values()} == {"re-planning needs a durable checkpoint tier "
                                                             "(CheckpointConfig(url=...))"}, out


@pytest.mark.parametrize("schedule, world", [("zbv", 2), ("dualpipev", 3), ("interleaved_1f1b", 2),
                                             ("interleaved_1f1b", 3)])
def test_every_stream_between_processes_has_a_link_at_both_ends_and_none_joins_stages_of_one_process(schedule, world):
    """Under NCCL each stream (channel, sending stage) between two processes gets a communicator: both processes
    must name it. Stages of one process exchange nothing, so nothing asks NCCL for two ranks on one GPU."""
    plan = plan_for(mlp(), [[0, 1], [2], [3, 4], [5], [6], [7, 8]] if world == 3 else P4)
    layout = virtual_layout(schedule, plan, world, 8)
    last = plan.num_stages - 1
    links = {r: stage_links(layout.placement, layout.stages_of(r), [(0, last)]) for r in range(world)}
    for r, mine in links.items():
        assert mine and len(set(mine)) == len(mine)
        for peer, link in mine:
            assert peer != r and (r, link) in links[peer], (r, peer, link)
    for s in range(last):
        if layout.placement[s] == layout.placement[s + 1]:
            assert not any(link in (f"act:{s}", f"grad:{s + 1}") for ls in links.values() for _, link in ls)
    if schedule in ("zbv", "dualpipev"):  # the first and the last stage share process 0: no targets, no tied link
        assert not any(link.startswith(("tgt", "tied")) for ls in links.values() for _, link in ls)


@pytest.mark.parametrize("schedule, stages", [("interleaved_1f1b", P4), ("zbv", P4), ("dualpipev", P4),
                                              ("interleaved_zero_bubble", P6), ("looped_bfs", P6)])
def test_a_process_runs_its_stages_actions_with_messages_only_to_other_processes(schedule, stages):
    layout = virtual_layout(schedule, plan_for(mlp(), stages), 2, 4)
    where = layout.placement
    lists = {r: process_actions(layout, r, 0, 12) for r in range(2)}
    sent, received = set(), set()
    for r, acts in lists.items():
        assert [a for a in acts if a.kind not in COMMUNICATION] == layout.rank_actions(r, 0, 12)
        for a in acts:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                to = a.stage + 1 if a.kind == Kind.SEND_F else a.stage - 1
                assert where[a.stage] == r != where[to], a
                sent.add((to, a.kind, a.index))
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                assert where[a.stage] == r, a
                received.add((a.stage, Kind.SEND_F if a.kind == Kind.RECV_F else Kind.SEND_B, a.index))
    assert sent == received and sent
    if schedule in ("zbv", "dualpipev"):
        assert not any(a.stage in (1, 2) and a.kind in COMMUNICATION and
                       (a.stage, a.kind) in ((1, Kind.SEND_F), (2, Kind.RECV_F), (2, Kind.SEND_B), (1, Kind.RECV_B))
                       for a in lists[1])


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
    the process, each stage's checkpoint parts are on its track, and ``pipedream-timeline`` draws them, one row per
    process."""
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
    # each stage's part of each checkpoint (every 8 minibatches) on its own stage's track
    saved = sorted((e["args"]["stage"], e["args"]["cut"]) for e in merge_traces(trace_files(traces))["traceEvents"]
                   if e.get("ph") == "X" and e["cat"] == "checkpoint")
    assert saved == [(s, cut) for s in range(4) for cut in (8, 16)], saved
    png = tmp_path / "virtual.png"
    assert timeline_main([str(traces), "-o", str(png)]) == 0 and png.stat().st_size > 0


def _ran_with_messages(trace_dir, pid: int) -> list[str]:
    from pipedream_ft.observe.timeline import merge_traces, trace_files

    events = [e for e in merge_traces(trace_files(trace_dir))["traceEvents"] if e.get("pid") == pid and (
        (e.get("ph") == "X" and e["cat"] in ("forward", "backward", "weight", "update"))
        or (e.get("ph") == "i" and e.get("cat") == "message"))]
    events.sort(key=lambda e: e["ts"])
    return [f"{e['args']['stage']}{e['name']}" for e in events]


@pytest.mark.slow
@pytest.mark.parametrize("schedule, stages", [("zbv", P4), ("interleaved_zero_bubble", P6)])
def test_one_rank_per_process_runs_its_lowered_list_and_is_minibatch_sgd(schedule, stages, tmp_path):
    """A process holding several stages is one rank of a world of 2, with as many threads as a process holding
    one stage; it runs exactly its lowered list (compute, updates, and sends and receives to the other process
    only), reads a stream once on stage 0, and trains minibatch SGD's weights; it evaluates and saves the model."""
    from safetensors.torch import load_file

    traces = tmp_path / "traces"
    out = run_world(stages_case, 2, stages, 16, schedule,
                    {"trace_dir": str(traces), "stream": True, "save": str(tmp_path / "model.safetensors")})
    one = run_world(stages_case, 2, [[0, 1, 2, 3], [4, 5, 6, 7, 8]], 16, "1f1b",
                    {"trace_dir": str(tmp_path / "one"), "stream": True})
    want, losses = minibatch_sgd_reference(mlp(), data, torch.nn.functional.cross_entropy, adam, 16, 4)
    layout = virtual_layout(schedule, plan_for(mlp(), stages), 2, 4)
    for rank in (0, 1):
        got = out[rank][1]
        assert got["kind"] == "PipelineTrainer" and got["world"] == 2 and got["stages"] == layout.stages_of(rank)
        _close(got["state"], want, 1e-6)
        assert got["losses"] == pytest.approx(losses, abs=1e-6)
        assert got["eval"] == pytest.approx(one[rank][1]["eval"], abs=1e-5)
        want_list = [str(a) if a.kind in (Kind.F, Kind.B, Kind.U) or a.kind in COMMUNICATION
                     else f"{a.stage}{'B' if a.kind == Kind.I else 'W'}{a.index}"  # the trace names I's event B
                     for a in process_actions(layout, rank, 0, 16)]
        assert _ran_with_messages(traces, rank) == want_list, rank
    _close(load_file(str(tmp_path / "model.safetensors")), want, 1e-6)
    # the same threads as two processes of one stage each (the one holding the last stage reports progress)
    for what in ("python", "os"):
        many = sorted(out[0][1]["threads"][what] + out[1][1]["threads"][what]) if what == "python" else \
            out[0][1]["threads"][what] + out[1][1]["threads"][what]
        few = sorted(one[0][1]["threads"][what] + one[1][1]["threads"][what]) if what == "python" else \
            one[0][1]["threads"][what] + one[1][1]["threads"][what]
        assert many == few, (what, many, few)


def _checkpointed_threads(stage_layers: list[list[int]], schedule: str, url: str) -> dict:
    """Per-process body: train 8 minibatches (flush mode, windows of 4) checkpointing every cut to the memory tier
    and to ``url``; the process's threads while its writers are open, its stages, and whether every cut committed."""
    import threading

    from pipedream_ft import CheckpointConfig, PipelineConfig, PipelineTrainer
    from pipedream_ft.policies import EveryNSteps
    from torch import nn

    model = mlp()
    trainer = PipelineTrainer(model, plan_for(model, stage_layers), loss_fn=nn.functional.cross_entropy,
                              optimizer_factory=adam,
                              config=PipelineConfig(mode="flush", flush_every=4, timeout_s=60, schedule=schedule,
                                                    summary=False),
                              checkpoint=CheckpointConfig(url=url, policy=EveryNSteps(4), memory_policy=EveryNSteps(4),
                                                          defer_when_behind=False))
    trainer.train(data, 8)
    ckpt = trainer.ckpt
    assert ckpt is not None and ckpt.flush_durable(timeout=60)
    threads = {"python": sorted(t.name.split("-")[0] if t.name.startswith("Thread-") else t.name
                                for t in threading.enumerate()),
               "os": len(os.listdir("/proc/self/task"))}
    out = {"threads": threads, "parts": ckpt.names, "memory": ckpt.memory is not None,
           "durable": [p.writer.last_durable for p in ckpt.parts if p.writer is not None]}
    trainer.close()
    return out


@pytest.mark.slow
def test_a_process_checkpointing_several_stages_has_the_threads_of_a_process_of_one_stage(tmp_path):
    """With both checkpoint tiers on, a process's background writing is one thread per tier whatever its number
    of stages: a process of 2 stages (ZBV) or 3 (interleaved zero bubble) runs as many threads as one of 1 (1F1B)."""
    env = {"TORCHELASTIC_RUN_ID": f"threads-{os.getpid()}", "PIPEDREAM_FT_SECRET": "s" * 32}
    runs = {}
    for name, stages, schedule in (("one", [[0, 1, 2, 3], [4, 5, 6, 7, 8]], "1f1b"), ("two", P4, "zbv"),
                                   ("three", P6, "interleaved_zero_bubble")):
        runs[name] = run_world(_checkpointed_threads, 2, stages, schedule, str(tmp_path / name), env=env,
                               timeout=240)
    for name, per_process in (("one", 1), ("two", 2), ("three", 3)):
        for rank in (0, 1):
            got = runs[name][rank][1]
            assert len(got["parts"]) == per_process and got["memory"], (name, rank, got["parts"])
            assert got["durable"] == [8] * per_process, (name, rank, got["durable"])
    # both processes together (the one holding the last stage reports progress; rank 0 commits)
    few = runs["one"]
    for name in ("two", "three"):
        many = runs[name]
        python = [sorted(run[0][1]["threads"]["python"] + run[1][1]["threads"]["python"]) for run in (many, few)]
        assert python[0] == python[1], (name, python)
        # one background writer per tier and process
        assert python[0].count("checkpoint-writer") == 2 and python[0].count("checkpoint-tiers") == 2, python
        os_threads = [run[0][1]["threads"]["os"] + run[1][1]["threads"]["os"] for run in (many, few)]
        assert os_threads[0] <= os_threads[1], (name, os_threads)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "interleaved_1f1b"])
def test_global_clipping_and_a_scheduler_over_several_stages_per_process_are_minibatch_sgd(schedule):
    """The window's gradient norm is one all-reduce for the process's stages together (and the tied-free MLP's
    scheduler steps once per window on each)."""
    spec = {"stages": P4, "mode": "flush", "schedule": schedule, "flush_every": 4, "total": 16, "sched": "lambda",
            "clip": 0.25}
    out = run_world(stages_feature_case, 2, spec)
    want = minibatch_reference(mlp(), sequential_data(ToyData(600)), 16, 4, "sgd", sched="lambda", clip=0.25)
    for rank in range(2):
        _close(out[rank][1]["state"], want["state"], 1e-6)
        assert len(set(out[rank][1]["lr"].values())) == 1 and len(out[rank][1]["lr"]) == 2
    assert out[0][1]["losses"] == pytest.approx(want["losses"], abs=1e-6)
    assert sum(n > 0.25 for n in want["norms"]) >= 2  # clipping was active


@pytest.mark.slow
def test_float16_loss_scaling_over_several_stages_per_process_is_grad_scaler():
    """Under ZBV the overflow flags of a process's two stages and the other process's go into one all-reduce per
    window: every stage skips the same updates and keeps the same scale as ``torch.amp.GradScaler``."""
    scale = {"init_scale": 2.0**24, "growth_interval": 2}
    spec = {"stages": P4, "mode": "flush", "schedule": "zbv", "flush_every": 4, "total": 48, "autocast": "fp16",
            "loss_scale": scale, "sched": "step", "clip": 0.3}
    out = run_world(stages_feature_case, 2, spec)
    want = minibatch_reference(mlp(), sequential_data(ToyData(600)), 48, 4, "sgd", autocast="fp16",
                               loss_scale=scale, sched="step", clip=0.3)
    assert want["skipped"] >= 2
    for rank in range(2):
        got = out[rank][1]
        assert got["skipped"] == [want["skipped"]] * 2 and got["scale"] == [want["scale"]] * 2, (got, want)
        _close(got["state"], want["state"], 1e-6)
