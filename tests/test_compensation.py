"""Delay compensation (weight prediction, delay-aware learning rate, look-ahead, error feedback): the options, and
the runtime in each asynchronous mode on real gloo processes against one-process references of their semantics."""

from __future__ import annotations

import pytest
import torch

from async_cases import async_case
from dist_helpers import run_world
from pipedream_reference import two_bw_reference, weight_stashing_reference
from pipedream_ft import PipelineConfig
from pipedream_ft.pipeline.compensation import Compensation, Compensator, lookahead_factor
from pipedream_ft.pipeline.versions import VersionStore
from runtime_cases import MODELS, OPTIMIZERS, data, plan_for

pytestmark = pytest.mark.timeout(240)

MLP4 = [[0, 1], [2, 3], [4, 5], [6, 7, 8]]
MLP3 = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
loss_fn = torch.nn.functional.cross_entropy


def test_options_and_their_checks():
    assert not Compensation().active
    c = Compensation(lr_scale=True)
    assert [c.lr_factor(d, 5) for d in (0, 1, 3)] == [1.0, 0.5, 0.25]
    w = Compensation(lr_scale=True, lr_warmup=4)
    assert [w.lr_factor(3, u) for u in (0, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="lr_warmup=3 .* needs lr_scale=True"):
        Compensation(lr_warmup=3)
    with pytest.raises(ValueError, match="lr_warmup must be >= 0, got -1"):
        Compensation(lr_scale=True, lr_warmup=-1)
    with pytest.raises(ValueError, match="mode 'flush' has no delay"):
        PipelineConfig(mode="flush", compensation=Compensation(predict=True))
    PipelineConfig(mode="2bw", compensation=Compensation(predict=True))


def test_prediction_publishes_the_weights_extrapolated_along_the_step():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([p], lr=0.5)
    store = VersionStore([p])
    comp = Compensator(Compensation(predict=True, lr_scale=True), delay=2)
    p.grad = torch.tensor([1.0, -2.0])
    comp.before_step([p], opt, 0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 / 3)
    opt.step()
    store.offset = comp.after_step([p], opt)
    assert opt.param_groups[0]["lr"] == 0.5  # the scale is for the step only
    store.publish()
    step = torch.tensor([-1.0, 2.0]) * (0.5 / 3)
    assert torch.allclose(p.detach(), torch.tensor([1.0, 2.0]) + step)
    assert torch.allclose(store.current.tensors[0], torch.tensor([1.0, 2.0]) + 3 * step)  # w + 2 * (w - w_before)
    store.publish()  # the offset is for one version only
    assert torch.equal(store.current.tensors[0], p.detach())


def test_lookahead_and_error_feedback_options():
    assert Compensation(lookahead=True).active and Compensation(error_feedback=0.5).active
    assert lookahead_factor(0.9, 2) == pytest.approx(0.9 + 0.81)
    assert lookahead_factor(0.9, 0) == 0.0
    with pytest.raises(ValueError, match="error_feedback must be a finite lambda >= 0, got -1"):
        Compensation(error_feedback=-1)
    with pytest.raises(ValueError, match="error_feedback .* got nan"):
        Compensation(error_feedback=float("nan"))
    with pytest.raises(ValueError, match="predict=True and lookahead=True"):
        Compensation(predict=True, lookahead=True)
    with pytest.raises(ValueError, match="mode 'flush' has no delay"):
        PipelineConfig(mode="flush", compensation=Compensation(error_feedback=1.0))
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    comp = Compensator(Compensation(lookahead=True), delay=1)
    opt = torch.optim.Adagrad([p])
    comp.before_step([p], opt, 0)
    opt.step()
    with pytest.raises(ValueError, match="lookahead needs a momentum coefficient .* Adagrad has"):
        comp.after_step([p], opt)


def test_lookahead_publishes_the_momentum_reach_of_the_step():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    store = VersionStore([p])
    comp = Compensator(Compensation(lookahead=True), delay=2)
    for grad in ([1.0, -2.0], [0.5, 0.5]):
        before = p.detach().clone()
        p.grad = torch.tensor(grad)
        comp.before_step([p], opt, 0)
        opt.step()
        store.offset = comp.after_step([p], opt)
        store.publish()
        step = p.detach() - before
        assert torch.allclose(store.current.tensors[0], p.detach() + (0.9 + 0.81) * step)
    for _ in range(2):  # the delay's worth of SGD steps with zero gradients reaches exactly that point
        p.grad = torch.zeros(2)
        opt.step()
    assert torch.allclose(p.detach(), store.current.tensors[0])


def test_error_feedback_corrects_the_gradient_towards_the_live_weights():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    stale = torch.tensor([0.0, 2.5, 3.0])
    p.grad = torch.tensor([2.0, -1.0, 4.0])
    opt = torch.optim.SGD([p], lr=1.0)
    comp = Compensator(Compensation(error_feedback=0.5), delay=3)
    with pytest.raises(ValueError, match="stale version of each of the 1 parameters, got None"):
        comp.before_step([p], opt, 0)
    comp.before_step([p], opt, 0, [stale])
    # g + 0.5 * g * g * (w - w_stale)
    assert torch.equal(p.grad, torch.tensor([2.0 + 0.5 * 4 * 1, -1.0 + 0.5 * 1 * -0.5, 4.0]))
    assert comp.after_step([p], opt) is None
    q = torch.nn.Parameter(torch.ones(1))
    q.grad = torch.ones(1)
    Compensator(Compensation(error_feedback=0.5), delay=0).before_step([q], opt, 0)  # no delay: left alone
    assert torch.equal(q.grad, torch.ones(1))


def _check(out: dict, want: dict, losses: list[float], ranks: int) -> None:
    for rank in range(ranks):
        got = out[rank][1]
        assert sorted(got["state"]) == sorted(want)
        for k in want:
            torch.testing.assert_close(got["state"][k], want[k], rtol=0, atol=1e-6, msg=k)
        assert got["losses"] == pytest.approx(losses, abs=1e-6)


def _differs(a: dict, b: dict) -> bool:
    return any(not torch.allclose(a[k], b[k], atol=1e-4) for k in a)


@pytest.mark.slow
def test_stash_with_prediction_and_a_warmed_up_delay_aware_lr():
    comp = {"predict": True, "lr_scale": True, "lr_warmup": 8}
    out = run_world(async_case, 4, {"stages": MLP4, "mode": "stash", "opt": "adam", "total": 16,
                                    "compensation": comp})
    model = MODELS["mlp"]()
    plan = plan_for(model, MLP4)
    want, losses = weight_stashing_reference(model, plan, data, loss_fn, OPTIMIZERS["adam"], 16,
                                             compensation=Compensation(**comp))
    _check(out, want, losses, 4)
    plain, _ = weight_stashing_reference(MODELS["mlp"](), plan, data, loss_fn, OPTIMIZERS["adam"], 16)
    assert _differs(want, plain)  # the compensation changed the result


@pytest.mark.slow
def test_vertical_sync_with_prediction():
    comp = {"predict": True}
    out = run_world(async_case, 3, {"stages": MLP3, "mode": "vertical", "opt": "sgd", "total": 12,
                                    "compensation": comp})
    model = MODELS["mlp"]()
    plan = plan_for(model, MLP3)
    want, losses = weight_stashing_reference(model, plan, data, loss_fn, OPTIMIZERS["sgd"], 12, vertical=True,
                                             compensation=Compensation(**comp))
    _check(out, want, losses, 3)
    plain, _ = weight_stashing_reference(MODELS["mlp"](), plan, data, loss_fn, OPTIMIZERS["sgd"], 12, vertical=True)
    assert _differs(want, plain)


@pytest.mark.slow
def test_2bw_with_prediction_and_a_delay_aware_lr():
    comp = {"predict": True, "lr_scale": True}
    out = run_world(async_case, 4, {"stages": MLP4, "mode": "2bw", "opt": "sgd", "total": 16, "compensation": comp})
    model = MODELS["mlp"]()
    plan = plan_for(model, MLP4)
    want, losses = two_bw_reference(model, plan, data, loss_fn, OPTIMIZERS["sgd"], 16, 4,
                                    compensation=Compensation(**comp))
    _check(out, want, losses, 4)
    plain, _ = two_bw_reference(MODELS["mlp"](), plan, data, loss_fn, OPTIMIZERS["sgd"], 16, 4)
    assert _differs(want, plain)


@pytest.mark.slow
def test_stash_with_prediction_resumes_from_a_cut_exactly(tmp_path):
    """The checkpoint holds the real weights and the predicted versions, the current one included."""
    comp = {"predict": True}
    spec = {"stages": MLP4, "mode": "stash", "opt": "sgd", "total": 16, "every": 8, "url": str(tmp_path / "a"),
            "compensation": comp}
    run_world(async_case, 4, {**spec, "stop_at": 8})
    resumed = run_world(async_case, 4, spec)
    assert resumed[0][1]["resumed"] == 8
    model = MODELS["mlp"]()
    want, losses = weight_stashing_reference(model, plan_for(model, MLP4), data, loss_fn, OPTIMIZERS["sgd"], 16,
                                             compensation=Compensation(**comp))
    for rank in range(4):
        for k in want:
            torch.testing.assert_close(resumed[rank][1]["state"][k], want[k], rtol=0, atol=1e-6, msg=k)
    assert resumed[0][1]["losses"] == pytest.approx(losses[8:], abs=1e-6)


@pytest.mark.slow
def test_stash_with_lookahead_error_feedback_and_a_delay_aware_lr():
    comp = {"lookahead": True, "error_feedback": 2.0, "lr_scale": True}
    out = run_world(async_case, 4, {"stages": MLP4, "mode": "stash", "opt": "adam", "total": 16,
                                    "compensation": comp})
    model = MODELS["mlp"]()
    plan = plan_for(model, MLP4)
    want, losses = weight_stashing_reference(model, plan, data, loss_fn, OPTIMIZERS["adam"], 16,
                                             compensation=Compensation(**comp))
    _check(out, want, losses, 4)
    lr_only, _ = weight_stashing_reference(MODELS["mlp"](), plan, data, loss_fn, OPTIMIZERS["adam"], 16,
                                           compensation=Compensation(lr_scale=True))
    assert _differs(want, lr_only)


@pytest.mark.slow
def test_vertical_sync_with_lookahead():
    comp = {"lookahead": True}
    out = run_world(async_case, 3, {"stages": MLP3, "mode": "vertical", "opt": "sgd", "total": 12,
                                    "compensation": comp})
    model = MODELS["mlp"]()
    plan = plan_for(model, MLP3)
    want, losses = weight_stashing_reference(model, plan, data, loss_fn, OPTIMIZERS["sgd"], 12, vertical=True,
                                             compensation=Compensation(**comp))
    _check(out, want, losses, 3)
    plain, _ = weight_stashing_reference(MODELS["mlp"](), plan, data, loss_fn, OPTIMIZERS["sgd"], 12, vertical=True)
    assert _differs(want, plain)


@pytest.mark.slow
def test_2bw_with_error_feedback_and_prediction():
    comp = {"error_feedback": 200.0, "predict": True}
    out = run_world(async_case, 4, {"stages": MLP4, "mode": "2bw", "opt": "sgd", "total": 16, "compensation": comp})
    model = MODELS["mlp"]()
    plan = plan_for(model, MLP4)
    want, losses = two_bw_reference(model, plan, data, loss_fn, OPTIMIZERS["sgd"], 16, 4,
                                    compensation=Compensation(**comp))
    _check(out, want, losses, 4)
    predict_only, _ = two_bw_reference(MODELS["mlp"](), plan, data, loss_fn, OPTIMIZERS["sgd"], 16, 4,
                                       compensation=Compensation(predict=True))
    assert _differs(want, predict_only)


@pytest.mark.slow
def test_stash_with_lookahead_and_error_feedback_resumes_from_a_cut_exactly(tmp_path):
    """The checkpoint holds the looked-ahead versions and the stale ones error feedback reads."""
    comp = {"lookahead": True, "error_feedback": 2.0}
    spec = {"stages": MLP4, "mode": "stash", "opt": "sgd", "total": 16, "every": 8, "url": str(tmp_path / "a"),
            "compensation": comp}
    run_world(async_case, 4, {**spec, "stop_at": 8})
    resumed = run_world(async_case, 4, spec)
    assert resumed[0][1]["resumed"] == 8
    model = MODELS["mlp"]()
    want, losses = weight_stashing_reference(model, plan_for(model, MLP4), data, loss_fn, OPTIMIZERS["sgd"], 16,
                                             compensation=Compensation(**comp))
    for rank in range(4):
        for k in want:
            torch.testing.assert_close(resumed[rank][1]["state"][k], want[k], rtol=0, atol=1e-6, msg=k)
    assert resumed[0][1]["losses"] == pytest.approx(losses[8:], abs=1e-6)
