"""LR scheduler, gradient clipping, mixed precision, evaluation and the final model, on real gloo processes,
against single-process references (flush mode is minibatch SGD: equal to 1e-6) and against uninterrupted runs
(a resumed run is bitwise the uninterrupted one)."""

from __future__ import annotations

import re

import pytest
import torch

from dist_helpers import run_world
from feature_cases import (BATCH, MODELS, ClipThenStep, ToyData, bad_case, eval_loader, eval_refusals_case,
                           feature_case, files_under, minibatch_reference, plain_eval, sequential_data)
from pipedream_ft import PipelineConfig, PipelineSetupError
from pipedream_reference import weight_stashing_reference
from runtime_cases import plan_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MLP3 = [[0, 1, 2, 3], [4, 5, 6], [7, 8]]
BN3 = [[0, 1, 2], [3, 4], [5, 6]]


def assert_close(got: dict, want: dict, atol: float) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=atol, msg=k)


def assert_bitwise(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("sched, clip", [("step", None), (None, 0.25), ("lambda", 0.25)])
def test_flush_mode_with_scheduler_and_global_clipping_is_minibatch_sgd(sched, clip):
    """A replicated stage sums its replicas' gradients and counts its squared norm once."""
    spec = {"stages": MLP3, "replicas": [2, 1, 1], "mode": "flush", "flush_every": 4, "total": 24, "sched": sched,
            "clip": clip}
    out = run_world(feature_case, 4, spec)
    want = minibatch_reference(MODELS["mlp"](), sequential_data(ToyData(600)), 24, 4, "sgd", sched=sched, clip=clip)
    for rank in range(4):
        assert_close(out[rank][1]["state"], want["state"], atol=1e-6)
        assert out[rank][1]["losses"] == pytest.approx(want["losses"], abs=1e-6)
    assert out[0][1]["lr"] == pytest.approx(want["lrs"][-1], rel=1e-12)
    if sched:
        assert want["lrs"][-1] < 0.05 * 0.5  # the schedule moved
    if clip:
        assert sum(n > clip for n in want["norms"]) >= 2  # clipping was active


@pytest.mark.parametrize("mode", ["stash", "vertical"])
def test_asynchronous_modes_clip_per_stage_and_step_the_scheduler_per_update(mode):
    spec = {"stages": MLP3, "mode": mode, "total": 16, "sched": "lambda", "clip": 0.1}
    out = run_world(feature_case, 3, spec)
    model = MODELS["mlp"]()
    want, losses = weight_stashing_reference(model, plan_for(model, MLP3), sequential_data(ToyData(600)),
                                             torch.nn.functional.cross_entropy,
                                             lambda ps: ClipThenStep(ps, "sgd", 0.1, "lambda"), 16,
                                             vertical=mode == "vertical")
    assert_close(out[0][1]["state"], want, atol=1e-6)
    assert out[0][1]["losses"] == pytest.approx(losses, abs=1e-6)
    assert out[0][1]["lr"] == pytest.approx(0.05 / 17)


def test_bfloat16_autocast_in_flush_mode_is_minibatch_sgd_under_autocast():
    spec = {"stages": MLP3, "mode": "flush", "flush_every": 4, "total": 16, "autocast": "bf16", "opt": "adam"}
    out = run_world(feature_case, 3, spec)
    want = minibatch_reference(MODELS["mlp"](), sequential_data(ToyData(600)), 16, 4, "adam", autocast="bf16")
    assert_close(out[2][1]["state"], want["state"], atol=1e-6)
    assert out[2][1]["losses"] == pytest.approx(want["losses"], abs=1e-6)
    assert out[1][1]["learned"] == {0: ["torch.bfloat16"]}  # activations cross as bfloat16
    assert out[2][1]["learned"] == {1: ["torch.bfloat16"]}


def test_bfloat16_autocast_trains_in_stash_mode():
    out = run_world(feature_case, 3, {"stages": MLP3, "total": 48, "autocast": "bf16", "opt": "adam",
                                      "source": "loader"})
    losses = out[0][1]["losses"]
    assert out[1][1]["learned"] == {0: ["torch.bfloat16"]}
    assert sum(losses[-8:]) < sum(losses[:8])


def test_float16_loss_scaling_in_flush_mode_is_grad_scaler():
    """A first scale of 2**24 overflows float16 (the stages agree to skip, and halve it) until it fits; it
    then grows every 2 good updates and overflows again: skips and growths both happen."""
    scale = {"init_scale": 2.0**24, "growth_interval": 2}
    spec = {"stages": MLP3, "mode": "flush", "flush_every": 4, "total": 64, "autocast": "fp16", "loss_scale": scale,
            "sched": "step", "clip": 0.3}
    out = run_world(feature_case, 3, spec)
    want = minibatch_reference(MODELS["mlp"](), sequential_data(ToyData(600)), 64, 4, "sgd", autocast="fp16",
                               loss_scale=scale, sched="step", clip=0.3)
    assert want["skipped"] >= 2
    for rank in range(3):
        assert out[rank][1]["skipped"] == want["skipped"]
        assert out[rank][1]["scale"] == want["scale"]
        assert_close(out[rank][1]["state"], want["state"], atol=1e-6)
    assert out[1][1]["learned"] == {0: ["torch.float16"]}


def test_flush_mode_features_resume_bitwise(tmp_path):
    """Loss scale, scheduler and global clipping are all in the checkpoint."""
    spec = {"stages": MLP3, "mode": "flush", "flush_every": 4, "total": 24, "every": 12, "autocast": "fp16",
            "loss_scale": {"init_scale": 2.0**20, "growth_interval": 2}, "sched": "step", "clip": 1.0,
            "source": "loader"}
    run_world(feature_case, 3, {**spec, "url": str(tmp_path / "a"), "stop_at": 16})
    resumed = run_world(feature_case, 3, {**spec, "url": str(tmp_path / "a")})
    straight = run_world(feature_case, 3, {**spec, "url": str(tmp_path / "b")})
    assert resumed[0][1]["resumed"] == 12
    for rank in range(3):
        assert_bitwise(resumed[rank][1]["state"], straight[rank][1]["state"])
        assert resumed[rank][1]["scale"] == straight[rank][1]["scale"]
        assert resumed[rank][1]["lr"] == straight[rank][1]["lr"]


def test_scheduler_and_data_state_survive_an_elastic_reshard(tmp_path):
    """4 workers train 16 minibatches, then 2 workers resume by re-planning: each new stage takes its scheduler
    state from the old stages holding its layers, and stage 0 its StatefulDataLoader state (no re-reading)."""
    spec = {"stages": [[0, 1], [2, 3], [4, 5], [6, 7, 8]], "source": "sdl", "sched": "step", "every": 8,
            "elastic": True, "url": str(tmp_path / "ckpt")}
    first = run_world(feature_case, 4, {**spec, "total": 16})
    assert first[0][1]["lr"] == pytest.approx(0.05 * 0.5 ** (16 // 3))
    shrunk = run_world(feature_case, 2, {**spec, "total": 32, "shuffle_seed": 99})
    assert shrunk[0][1]["resumed"] == 16 and len(shrunk[0][1]["stages"]) == 2
    for rank in range(2):
        assert shrunk[rank][1]["lr"] == pytest.approx(0.05 * 0.5 ** (32 // 3))  # one schedule, 32 steps
    assert shrunk[0][1]["reads"] == 16 * BATCH  # loaded the saved state: skipping would have read 32


def test_evaluate_is_the_plain_model_in_eval_mode_and_disturbs_nothing():
    n_eval = 40  # 7 minibatches of 6, the last one of 4
    spec = {"model": "bn", "stages": BN3, "replicas": [1, 2, 1], "total": 16, "opt": "adam", "source": "loader"}
    with_eval = run_world(feature_case, 4, {**spec, "chunks": [8, 8], "eval": n_eval})
    without = run_world(feature_case, 4, {**spec, "chunks": [16]})
    for rank in range(4):
        got = with_eval[rank][1]
        assert_bitwise(got["state"], without[rank][1]["state"])  # training did not notice the evaluations
        assert got["rng_kept"] == [True, True]
        assert got["eval"]["unchanged"] and got["eval"]["mode_kept"]
    model = MODELS["bn"]()
    model.load_state_dict(with_eval[0][1]["state"], strict=True)
    losses, accs = plain_eval(model, eval_loader(n_eval))
    for rank in range(4):
        result = with_eval[rank][1]["eval"]["result"]
        assert len(result.losses) == 7
        assert result.losses == pytest.approx(losses, abs=1e-6)
        assert result.metrics == pytest.approx(accs, abs=1e-6)
        assert result.loss == pytest.approx(sum(losses) / 7, abs=1e-6)
        by_callable = with_eval[rank][1]["eval"]["callable"]
        assert by_callable.losses == result.losses and by_callable.metrics == result.metrics
    # eval mode mattered: BatchNorm's running statistics and no dropout
    model.train()
    torch.manual_seed(0)
    x, y = next(iter(eval_loader(n_eval)))
    with torch.no_grad():
        assert float(torch.nn.functional.cross_entropy(model(x), y)) != pytest.approx(losses[0], abs=1e-4)


def test_evaluate_refuses_a_short_source_and_the_training_one_on_every_rank():
    out = run_world(eval_refusals_case, 2)
    assert out[0][1] == out[1][1]
    short, same, loss = out[0][1]
    assert short.startswith("data source DataLoader has 4 minibatches, but evaluation asks for minibatches 0..4")
    assert same.startswith("evaluate needs its own data source")
    assert float(loss) > 0


@pytest.mark.parametrize("model, stages, fmt", [("skip", [[0, 1], [2, 3, 4, 5], [6, 7]], "torch"),
                                                 ("bn", BN3, "safetensors")])
def test_save_model_writes_what_the_plain_model_loads(tmp_path, model, stages, fmt):
    path = str(tmp_path / f"final.{fmt}")
    out = run_world(feature_case, 3, {"model": model, "stages": stages, "total": 8, "save": (path, fmt)})
    if fmt == "torch":
        state = torch.load(path)
    else:
        from safetensors.torch import load_file

        state = load_file(path)
    plain = MODELS[model]()
    plain.load_state_dict(state, strict=True)
    assert_bitwise(plain.state_dict(), out[0][1]["state"])
    assert files_under(str(tmp_path)) == [f"final.{fmt}"]  # no temporary file left


def test_save_model_failure_is_raised_on_every_rank(tmp_path):
    path = str(tmp_path / "missing-dir" / "final.pt")
    out = run_world(feature_case, 2, {"stages": [[0, 1, 2, 3], [4, 5, 6, 7, 8]], "total": 4, "save": (path, "torch")},
                    expect_failure=True)
    msgs = {payload[1] for ok, payload in out.values() if not ok}
    assert len(out) == 2 and len(msgs) == 1 and all(not ok for ok, _ in out.values())
    assert msgs.pop().startswith(f"cannot write the model to {path}")


@pytest.mark.parametrize("kind, pattern", [
    ("scheduler", r"^scheduler_factory made a NoStateScheduler, which has no state_dict\(\) and load_state_dict\(\)"),
    ("fp16", r"^autocast_dtype float16 needs a loss scale .* mode 'flush'"),
])
def test_bad_features_stop_every_rank_with_one_line_and_write_nothing(tmp_path, kind, pattern):
    url = tmp_path / "ckpt"
    out = run_world(bad_case, 2, kind, str(url), expect_failure=True, timeout=90)
    assert all(not ok for ok, _ in out.values())
    msgs = {payload[1] for _, payload in out.values()}
    assert len(msgs) == 1, msgs
    msg = msgs.pop()
    assert re.search(pattern, msg) and "\n" not in msg, msg
    assert {payload[0] for _, payload in out.values()} == {"PipelineSetupError"}
    assert not url.exists()


def test_config_refuses_float16_in_the_asynchronous_modes_only():
    for mode in ("stash", "vertical"):
        with pytest.raises(PipelineSetupError, match="float16"):
            PipelineConfig(mode=mode, autocast_dtype=torch.float16)
    assert PipelineConfig(mode="flush", autocast_dtype=torch.float16).autocast_dtype == torch.float16
    with pytest.raises(PipelineSetupError, match="bfloat16, torch.float16 or None"):
        PipelineConfig(autocast_dtype=torch.float64)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        PipelineConfig(clip_grad_norm=0.0)


def test_config_hang_s_must_exceed_two_heartbeat_intervals():
    assert PipelineConfig(hang_s=3.0).hang_s == 3.0
    with pytest.raises(ValueError, match=r"hang_s must exceed two heartbeat intervals \(0.2 s\), got 0.2"):
        PipelineConfig(hang_s=0.2)
