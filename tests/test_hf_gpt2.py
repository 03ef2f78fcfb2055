"""Hugging Face GPT-2, split at its blocks by profiler.hf, profiles and plans like any fx model."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from partitioner import partition
from profiler.hf import GPT2ForPipeline, gpt2_for_pipeline
from profiler.layers import layer_graph, structure_profile
from profiler.measure import profile_model
from random_models import run_stages

pytestmark = pytest.mark.timeout(300)

transformers.logging.set_verbosity_error()


def _hf(n_layer: int = 4, **extra) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=n_layer, n_head=4,
                                     bos_token_id=0, eos_token_id=0, **extra)
    return transformers.GPT2LMHeadModel(config).eval()


def test_wrapper_computes_the_same_logits() -> None:
    model = _hf()
    wrapper = gpt2_for_pipeline(model)
    idx = torch.randint(0, 256, (3, 20))
    with torch.no_grad():
        expected = model(idx).logits
        assert torch.equal(wrapper(idx), expected)
        assert torch.equal(layer_graph(wrapper).graph_module(idx), expected)


def test_state_dict_keys_are_the_hf_models() -> None:
    model = _hf()
    wrapper = gpt2_for_pipeline(model)
    assert list(wrapper.state_dict()) == list(model.state_dict())
    assert wrapper.transformer is model.transformer and wrapper.lm_head is model.lm_head  # shared, not copied
    assert "transformer.wte.weight" in wrapper.state_dict() and "lm_head.weight" in wrapper.state_dict()


def test_blocks_are_layers_and_the_head_is_tied() -> None:
    wrapper = gpt2_for_pipeline(_hf())
    g = layer_graph(wrapper)
    assert [n for n in g.names if n.startswith("transformer_h_")] == [f"transformer_h_{i}" for i in range(4)]
    assert g.descriptions[g.names.index("transformer_h_0")].startswith("GPT2Block(")
    assert [(t.name, [g.names[i] for i in t.layers]) for t in g.tied] == [
        ("transformer.wte.weight", ["transformer_wte", "lm_head"])]
    assert structure_profile(wrapper).tied[0].bytes == 256 * 64 * 4


def test_profile_and_plan_on_four_workers() -> None:
    wrapper = gpt2_for_pipeline(_hf())
    wrapper.train()
    idx = torch.randint(0, 256, (2, 16))
    profile = profile_model(wrapper, idx, warmup=0, repeats=1)
    assert profile.structure_hash() == structure_profile(wrapper).structure_hash()
    assert [profile.layers[i].name for i in range(len(profile)) if profile.layers[i].kind == "value"] == [
        "size", "getattr_1"]
    for straight in (False, True):
        plan = partition(profile, 4, 1e9, straight=straight)
        assert plan.world_size == 4 and plan.recompute == (1, 2)  # after the token embedding
        if straight:
            assert plan.num_stages == 4
        wrapper.eval()
        run_stages(wrapper, idx, profile, plan)


def test_refuses_what_it_cannot_reproduce() -> None:
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        gpt2_for_pipeline(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="add_cross_attention"):
        gpt2_for_pipeline(_hf(n_layer=1, add_cross_attention=True))
    assert isinstance(gpt2_for_pipeline(_hf(n_layer=1)), GPT2ForPipeline)


def test_eager_attention_builds_its_causal_mask_inside_each_block() -> None:
    model = _hf(n_layer=2, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"  # with no mask, eager blocks would attend everywhere
    idx = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(layer_graph(gpt2_for_pipeline(model)).graph_module(idx), model(idx).logits)
