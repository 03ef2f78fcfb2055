"""A torchvision-style ResNet-18 (``tests/resnet_torchvision.py``, small input) trained on 4 real processes.

Profiled and planned by the partitioner as a straight 4-stage pipeline, trained in ``flush`` mode (synchronous
minibatch SGD): losses, parameters *and* BatchNorm buffers (running mean and variance, batches tracked) equal
those of the plain model trained with gradient accumulation over the same windows. The partitioner's own choice
for 4 workers (here: one stage on 4 data-parallel replicas) trains too, with the plain model's losses and
parameters up to the rounding of a different summation order (BatchNorm statistics stay per replica).
"""

from __future__ import annotations

import math

from typing import Any

import pytest
import torch
from torch import nn

from dist_helpers import run_world
from partitioner import partition
from partitioner.plan import Plan
from profiler.measure import profile_model
from resnet_torchvision import resnet18

pytestmark = [pytest.mark.timeout(300)]

STEPS, WINDOW, BATCH = 8, 4, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return resnet18(num_classes=10, width=8)


def _data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + b)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def _plan_json(straight: bool) -> dict[str, Any]:
    profile = profile_model(_model(), _data(0)[0], warmup=0, repeats=1)
    return partition(profile, 4, 1e9, straight=straight).to_json()


def _window(plan_json: dict[str, Any]) -> int:
    """Minibatches per flush: at least WINDOW, and a multiple of every replica count (as flush mode needs)."""
    lcm = math.lcm(*(s.replicas for s in Plan.from_json(plan_json).stages))
    return lcm * -(-WINDOW // lcm)


def _pipeline_case(plan_json: dict[str, Any], steps: int = STEPS, window: int = WINDOW) -> dict[str, Any]:
    from pipedream_ft import PipelineConfig, PipelineTrainer

    trainer = PipelineTrainer(_model(), Plan.from_json(plan_json), loss_fn=nn.functional.cross_entropy,
                              optimizer_factory=_sgd,
                              config=PipelineConfig(mode="flush", flush_every=window, timeout_s=60, summary=False))
    result = trainer.train(_data, steps)
    state = trainer.full_state_dict()
    trainer.close()
    return {"state": state, "losses": result.losses}


def _plain(steps: int = STEPS, window: int = WINDOW, reverse: bool = False
           ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The plain model with gradient accumulation over each window; ``reverse``: each window's gradients summed in
    the reverse order (the same sum, rounded otherwise)."""
    model = _model()
    model.train()
    opt = _sgd(list(model.parameters()))
    losses = []
    for w in range(steps // window):
        window_losses = [nn.functional.cross_entropy(model(x), y)
                         for x, y in (_data(b) for b in range(w * window, (w + 1) * window))]
        losses += [float(loss.detach()) for loss in window_losses]
        for loss in reversed(window_losses) if reverse else window_losses:
            (loss / window).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


@pytest.mark.slow
def test_straight_four_stage_resnet_trains_like_the_plain_model_buffers_included() -> None:
    plan_json = _plan_json(straight=True)
    assert Plan.from_json(plan_json).num_stages == 4
    got = run_world(_pipeline_case, 4, plan_json, timeout=240)[0][1]
    want, losses = _plain()
    assert got["losses"] == pytest.approx(losses, abs=1e-5)
    assert sorted(got["state"]) == sorted(want)
    buffers = [k for k in want if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(buffers) == 3 * 20  # ResNet-18: 20 BatchNorm layers
    for k, v in want.items():
        torch.testing.assert_close(got["state"][k], v, rtol=0, atol=1e-5, msg=k)
    assert int(got["state"]["bn1.num_batches_tracked"]) == STEPS
    fresh = _model()
    fresh.load_state_dict(got["state"], strict=True)


@pytest.mark.slow
def test_the_partitioners_own_plan_trains_like_the_plain_model() -> None:
    plan_json = _plan_json(straight=False)  # its shape depends on the measured profile: any must train
    assert Plan.from_json(plan_json).world_size == 4
    window = _window(plan_json)
    got = run_world(_pipeline_case, 4, plan_json, 2 * window, window, timeout=240)[0][1]
    want, losses = _plain(2 * window, window)
    # Replicas all-reduce their gradients: the same four gradients summed in another order than the plain loop's
    # accumulation. With batch-4 BatchNorm that rounding moves the weights by up to ~1e-4 after two momentum
    # steps (the plain loop summing its own four gradients in reverse order differs from itself by 9e-5), and the
    # losses after the first update by as much as another order moves the plain loop's own (6e-6 reversed; the
    # plan, measured on a loaded machine, is not always the same: a CI run beside a CPU hog measured 1.24e-5).
    # Before the first update every loss is computed from the same weights.
    assert got["losses"][:window] == pytest.approx(losses[:window], abs=1e-5)
    _, reordered = _plain(2 * window, window, reverse=True)
    rounding = max(abs(a - b) for a, b in zip(losses, reordered))
    assert got["losses"][window:] == pytest.approx(losses[window:], abs=max(1e-5, 4 * rounding))
    # BatchNorm running statistics are per replica (as in DDP), so only parameters are compared.
    for k, p in _model().named_parameters():
        torch.testing.assert_close(got["state"][k], want[k], rtol=0, atol=3e-4, msg=k)
