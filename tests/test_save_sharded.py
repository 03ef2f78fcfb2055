"""Saving without gathering: every stage writes its own tensors.

A Llama of about 285 MB (float32) built on the meta device on 4 processes: ``save_pretrained`` writes shards (each
stage its own, at least one per stage) and the index, which ``AutoModelForCausalLM.from_pretrained`` loads with
no missing or unexpected keys and the same logits as the one-process reference; ``save_model(...,
"safetensors")`` writes one file bitwise the reference's weights. No process's peak resident memory grew by
more than its stage twice (its weights and the runtime's current version of them), and less than 3/4 of the model
(the way it was, every process built the whole model first).
"""

from __future__ import annotations

import pytest
import torch

from dist_helpers import run_world
from meta_cases import SEED, big_llama, save_case
from partitioner.plan import Plan
from pipedream_ft import materialize
from profiler.layers import structure_profile

pytestmark = [pytest.mark.timeout(600)]


def _plan(model: torch.nn.Module) -> dict:
    prof = structure_profile(model)
    n = len(prof.layers)  # embedding (65 MB), 12 decoder layers (12 MB each), norm, head (65 MB)
    stages = [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10, 11, 12], list(range(13, n))]
    return Plan.from_stages(stages, [1] * 4, profile_hash=prof.structure_hash(),
                            layer_names=[layer.name for layer in prof.layers]).to_json()


def test_four_stages_save_their_own_shards_and_none_holds_the_model(tmp_path) -> None:
    import transformers
    from safetensors.torch import load_file

    directory, file = str(tmp_path / "hf"), str(tmp_path / "model.safetensors")
    out = run_world(save_case, 4, _plan(big_llama()), directory, file, timeout=540)
    reference = materialize(big_llama(), seed=SEED)
    whole = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    assert whole > 250 * 2**20
    for rank, (_, got) in out.items():
        grown = (got["peak_kib"] - got["before_kib"]) * 1024
        assert got["stage_bytes"] < 0.35 * whole
        # its stage twice (the weights and the current version the runtime keeps of them), nothing of the others'
        assert grown < 2 * got["stage_bytes"] + 48 * 2**20 and grown < 0.75 * whole, \
            (rank, grown / 2**20, whole / 2**20, got)
    shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*-of-*.safetensors"))
    assert len(shards) >= 4 and (tmp_path / "hf" / "model.safetensors.index.json").exists()
    back, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(0, 32000, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(input_ids=ids).logits, reference.eval()(ids), rtol=0, atol=1e-5)
    del back
    state = load_file(file)
    want = reference.state_dict()
    assert sorted(state) == sorted(want)
    for k, v in want.items():
        assert torch.equal(state[k], v), k
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.safetensors"]  # no temporary file left
