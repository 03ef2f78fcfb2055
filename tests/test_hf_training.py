"""Hugging Face GPT-2 trained through the whole pipeline: profiled, planned on 4 workers, run on 4 real processes.

``transformers.GPT2LMHeadModel`` (random init, small config, no dropout) is wrapped by
``profiler.hf.gpt2_for_pipeline`` (blocks as layers, the tied ``wte``/``lm_head`` weight held by the first and the
last stage), profiled and planned by the partitioner, and trained in ``flush`` mode on 4 spawned ranks. Flush
mode is synchronous minibatch SGD, so the losses and the final weights must equal those of the plain HF model
trained with the same optimizer on the mean loss of each window; the gathered state dict loads into a fresh
``GPT2LMHeadModel`` with ``strict=True``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from dist_helpers import run_world
from pipedream_ft_examples.text_data import TextData
from partitioner import partition
from partitioner.plan import Plan
from profiler.hf import gpt2_for_pipeline
from profiler.measure import profile_model

pytestmark = [pytest.mark.timeout(300)]

transformers.logging.set_verbosity_error()

STEPS, WINDOW = 12, 4
DATA = dict(block_size=16, batch_size=4, seed=0)


def _hf() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=4, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _plan_json(straight: bool = True) -> dict[str, Any]:
    wrapper = gpt2_for_pipeline(_hf())
    profile = profile_model(wrapper, TextData(**DATA)(0)[0], warmup=0, repeats=1)
    return partition(profile, 4, 1e9, straight=straight).to_json()


def _pipeline_case(plan_json: dict[str, Any]) -> dict[str, Any]:
    """One rank: the wrapped HF model on the plan, ``STEPS`` minibatches in flush mode."""
    from pipedream_ft import PipelineConfig, PipelineTrainer

    transformers.logging.set_verbosity_error()
    trainer = PipelineTrainer(gpt2_for_pipeline(_hf()), Plan.from_json(plan_json), loss_fn=_loss,
                              optimizer_factory=_adamw,
                              config=PipelineConfig(mode="flush", flush_every=WINDOW, timeout_s=60, summary=False))
    result = trainer.train(TextData(**DATA), STEPS)
    state = trainer.full_state_dict()
    stage = trainer.stage_index
    trainer.close()
    return {"state": state, "losses": result.losses, "stage": stage}


def _plain() -> tuple[transformers.GPT2LMHeadModel, list[float]]:
    """The plain HF model trained the same way: one AdamW step per window, on the mean of its losses."""
    model = _hf()
    model.train()
    opt = _adamw(list(model.parameters()))
    data = TextData(**DATA)
    losses = []
    for b in range(STEPS):
        x, y = data(b)
        loss = _loss(model(input_ids=x).logits, y)
        losses.append(float(loss.detach()))
        (loss / WINDOW).backward()
        if (b + 1) % WINDOW == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model, losses


@pytest.fixture(scope="module")
def plan_json() -> dict[str, Any]:
    return _plan_json(straight=True)


def test_the_plan_splits_gpt2_into_four_stages_with_the_head_tied_across(plan_json: dict[str, Any]) -> None:
    plan = Plan.from_json(plan_json)
    assert plan.num_stages == 4 and plan.world_size == 4
    names = plan.layer_names
    first = {names[i] for i in plan.stages[0].layers}
    last = {names[i] for i in plan.stages[-1].layers}
    assert "transformer_wte" in first and "lm_head" in last


@pytest.mark.slow
def test_hf_gpt2_trains_on_four_processes_like_the_plain_model(plan_json: dict[str, Any]) -> None:
    out = run_world(_pipeline_case, 4, plan_json, timeout=240)
    assert sorted(out[r][1]["stage"] for r in range(4)) == [0, 1, 2, 3]
    got = out[0][1]
    model, losses = _plain()
    assert got["losses"] == pytest.approx(losses, abs=1e-5)
    assert losses[-1] < losses[0]
    want = model.state_dict()
    assert sorted(got["state"]) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got["state"][k], v, rtol=0, atol=1e-5, msg=k)
    fresh = _hf()
    fresh.load_state_dict(got["state"], strict=True)
    fresh.eval()
    model.eval()
    x = TextData(**DATA)(99)[0]
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=x).logits, model(input_ids=x).logits, rtol=0, atol=1e-4)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied after loading
