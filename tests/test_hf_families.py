"""Every family :func:`profiler.hf.for_pipeline` covers, from a tiny random config, on one process.

For each family (tied and untied heads): the wrapper's logits — eager and through its fx layer graph — equal
``model(input_ids).logits``; its ``state_dict`` keys are the HF model's and a state dict loads strictly both ways.
For each family (one head each): with a padding mask and positions the logits equal HF's on every kept token;
the wrapper profiles, the partitioner plans it on 4 workers, every stage of the plan runs in turn on what the
runtime hands over (``check_plan``: output and gradients equal the whole model's), the final norm one layer
with its weight (no parameter hoisted into a layer of its own); the directory ``write_pretrained`` writes loads
with ``from_pretrained`` with no missing or unexpected keys, and the reloaded model generates (greedy, with its key/value cache) the tokens the
wrapper predicts. Trained on 4 processes: tests/test_hf_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from hf_models import FAMILIES, VOCAB, tiny
from partitioner import partition
from pipedream_ft.pipeline.check import check_plan
from pipedream_ft.pipeline.export import pretrained_of, write_pretrained
from profiler.hf import causal_lm_loss, for_pipeline
from profiler.hf_families import FAMILIES as COVERED
from profiler.layers import layer_graph, structure_profile
from profiler.measure import profile_model

pytestmark = pytest.mark.timeout(300)


def _ids(seed: int = 1, batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_state_dict_keys_are_the_hf_models(family: str, tied: bool) -> None:
    model = tiny(family, tied).eval()
    wrapper = for_pipeline(model)
    ids = _ids()  # 12 tokens: longer than the sliding windows (8) of Mistral and Gemma
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(wrapper(ids), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(layer_graph(wrapper).graph_module(ids), want, rtol=0, atol=1e-5)
    assert list(wrapper.state_dict()) == list(model.state_dict())
    other = tiny(family, tied, seed=1)
    wrapper.load_state_dict(other.state_dict(), strict=True)
    other.load_state_dict(for_pipeline(tiny(family, tied, seed=2)).state_dict(), strict=True)
    graph = layer_graph(wrapper)
    head = fetch = wrapper.get_submodule(COVERED[type(model).__name__].head)
    assert (head.weight is fetch.weight) and [t.name for t in graph.tied] == (
        [COVERED[type(model).__name__].embed + ".weight"] if tied else [])


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_mask_and_positions_give_hf_logits(family: str) -> None:
    model = tiny(family, family in ("llama", "gemma2", "gpt2")).eval()
    ids = _ids(2, 3, 10)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, 7:] = 0  # right padding
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    keep = mask.bool()
    cases = [(("input_ids", "attention_mask"), (ids, mask))]
    if family != "opt":  # OPT derives its positions from the mask
        cases.append((("input_ids", "attention_mask", "position_ids"), (ids, mask, positions)))
    for inputs, args in cases:
        with torch.no_grad():
            want = model(**dict(zip(inputs, args))).logits
            got = layer_graph(for_pipeline(model, inputs)).graph_module(*args)
        torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_plan_stages_export_and_generate(family: str, tmp_path) -> None:
    tied = FAMILIES.index(family) % 2 == 1
    model = tiny(family, tied)
    wrapper = for_pipeline(model)
    spec = COVERED[type(model).__name__]
    ids = _ids(3, 2, 12)
    profile = profile_model(wrapper, ids, warmup=0, repeats=1)
    assert profile.structure_hash() == structure_profile(wrapper).structure_hash()
    names = [layer.name for layer in profile.layers]
    layers = [n for n in names if n.startswith(spec.layers.replace(".", "_") + "_")]
    assert len(layers) == 4  # each decoder layer is one layer of the profile
    plan = partition(profile, 4, 1e9, straight=True)
    assert plan.num_stages == 4 and plan.world_size == 4
    # the final norm is one layer, its weight inside it: no parameter hoisted into a get_attr layer of its own
    assert spec.norm.replace(".", "_") in names
    assert not [d for d in (layer.description for layer in profile.layers) if d.startswith("get_attr")]
    wrapper.eval()
    check_plan(wrapper, plan, [ids], atol=1e-5)
    write_pretrained(wrapper.state_dict(), str(tmp_path), pretrained_of(wrapper), max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").exists()  # sharded
    back, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert type(back) is type(model)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    back.eval()
    prompt = ids[:, :5]
    out = back.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    tokens, done = prompt, torch.zeros(len(prompt), 1, dtype=torch.bool)
    graph = layer_graph(wrapper).graph_module
    with torch.no_grad():
        for _ in range(6):  # greedy; a row that produced the end token (0) is padded with 0 from then on, as HF does
            nxt = graph(tokens)[:, -1].argmax(-1, keepdim=True).masked_fill(done, 0)
            done |= nxt == 0
            tokens = torch.cat([tokens, nxt], dim=1)
    assert torch.equal(out, tokens)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_final_norm_head_and_soft_capping_share_the_last_stage(family: str) -> None:
    """``for_pipeline`` declares the final norm, the head and the soft-capping after it one keep-together group:
    a 4-worker plan puts them on the last stage, even where a head made heavy would be best alone."""
    from dataclasses import replace

    from partitioner.plan import Plan
    from profiler.together import with_keep_together

    model = tiny(family)
    wrapper = for_pipeline(model)
    spec = COVERED[type(model).__name__]
    tail = [spec.norm.replace(".", "_"), "lm_head"] + (["truediv", "tanh", "mul"] if family == "gemma2" else [])
    (group,) = structure_profile(wrapper).keep_together
    measured = profile_model(wrapper, _ids(), warmup=0, repeats=1)
    profile = with_keep_together(measured, wrapper)
    assert profile.keep_together == (group,) and profile.structure_hash() == measured.structure_hash()
    names = [layer.name for layer in profile.layers]
    assert [names[i] for i in group.layers] == tail
    head = names.index("lm_head")
    for prof in (profile, replace(profile, layers=tuple(  # a head that is best on a stage of its own
            replace(l, forward_ms=1e3) if i == head else l for i, l in enumerate(profile.layers)))):
        plan = Plan.from_json(partition(prof, 4, 1e9, straight=True).to_json())
        last = [names[i] for i in plan.stages[-1].layers]
        assert last[-len(tail):] == tail, last


def test_causal_lm_loss_is_transformers_loss() -> None:
    model = tiny("llama").eval()
    ids = _ids(4, 2, 10)
    labels = ids.clone()
    labels[1, 6:] = -100
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
        got = causal_lm_loss(for_pipeline(model)(ids), labels)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_model_outside_the_families_is_named_with_the_recipe() -> None:
    bert_like = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16))
    with pytest.raises(TypeError, match=r"^for_pipeline does not cover BertForMaskedLM .*Bring your Hugging Face"):
        for_pipeline(bert_like)
    with pytest.raises(TypeError, match="does not cover Linear"):
        for_pipeline(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="inputs must be input_ids"):
        for_pipeline(tiny("llama"), ("attention_mask", "input_ids"))


def test_the_mask_builder_gets_no_cache_by_the_name_the_installed_transformers_uses() -> None:
    """transformers 5.2x names the cache ``cache``; 5.1x and 4.5x name it ``past_key_values`` and also want
    ``cache_position`` (the wrapper failed on 5.17 with "unexpected keyword argument 'cache'")."""
    from profiler.hf import _no_cache

    hidden = torch.zeros(2, 5, 8)

    def new(config, inputs_embeds, attention_mask, cache, position_ids=None): ...

    def old(config, input_embeds, attention_mask, cache_position, past_key_values, position_ids=None): ...

    def oldest(config, input_embeds, attention_mask, past_key_values): ...

    assert _no_cache(new, hidden) == {"cache": None}
    got = _no_cache(old, hidden)
    assert set(got) == {"past_key_values", "cache_position"} and got["past_key_values"] is None
    assert torch.equal(got["cache_position"], torch.arange(5))
    assert _no_cache(oldest, hidden) == {"past_key_values": None}
