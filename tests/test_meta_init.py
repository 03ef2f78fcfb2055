"""Models built on the meta device: each process materialises and initialises only its own stage.

* Seeded per module (the default): an ``nn.Sequential`` with buffers, the GPT example (fx, tied head) and tiny
  Llama, Qwen2 and Gemma 2 (tied head, computed buffers) built on meta train on 2 gloo ranks in flush mode
  exactly like the one-process reference materialised whole with :func:`pipedream_ft.materialize`; no tensor of
  a stage is left on meta.
* The values do not depend on what is materialised together: any part of the model materialised alone equals
  the same part of the whole.
* From a file: a safetensors file, a sharded Hugging Face directory and a ``torch.save`` state dict each give
  every stage bitwise the file's tensors, reading only the stage's own (counted); the tied head's holder reads
  the embedding's tensor; a file with a stray key stops every rank with the same one line naming it; a file
  lacking a tensor, and a module with no initialisation, are named in one line; a pipedream-ft checkpoint
  directory initialises a meta model to the checkpointed weights.
* Elastic: a meta-built job resized from 4 processes to 2 (re-planned, restored from its checkpoint) ends at the
  weights of plain minibatch SGD from the seeded model.
"""

from __future__ import annotations

import json

import pytest
import torch

from dist_helpers import run_world
from meta_cases import KINDS, SEED, build, load_case, plan_json, reference, train_cases
from pipedream_ft import FromFile, PipelineSetupError, materialize

pytestmark = [pytest.mark.timeout(600)]


def test_meta_built_models_train_exactly_like_the_one_process_reference() -> None:
    steps, window = 4, 2
    runs = [(kind, plan_json(kind), steps, window) for kind in KINDS]
    out = run_world(train_cases, 2, runs, timeout=540)
    for i, kind in enumerate(KINDS):
        want_state, want_losses = reference(kind, steps, window)
        got = out[0][1][i]
        assert not got["meta_left"] and not out[1][1][i]["meta_left"], kind
        assert got["losses"] == pytest.approx(want_losses, abs=1e-6), kind
        assert sorted(got["state"]) == sorted(want_state), kind
        for k, v in want_state.items():
            diff = (got["state"][k].float() - v.float()).abs().max()
            assert diff <= 1e-6, (kind, k, diff)


@pytest.mark.parametrize("kind", ["gpt", "gemma2"])
def test_a_part_materialised_alone_equals_the_same_part_of_the_whole(kind: str) -> None:
    whole = materialize(build(kind), seed=SEED)
    names = [n for n, m in whole.named_modules() if n and not list(m.children())]
    for part in (names[: len(names) // 3], names[len(names) // 3:]):
        alone = materialize(build(kind), part, seed=SEED)
        got = {k: v for k, v in alone.state_dict().items() if not v.is_meta}
        assert got
        for k, v in got.items():
            assert torch.equal(v, whole.state_dict()[k]), k
    other = materialize(build(kind), seed=SEED + 1)
    assert not torch.equal(other.state_dict()[names[1] + ".weight"], whole.state_dict()[names[1] + ".weight"])


def _write_files(tmp_path, kind: str) -> tuple[dict[str, torch.Tensor], list[str], str]:
    from safetensors.torch import save_file

    model = materialize(build(kind), seed=11)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    single = str(tmp_path / "whole.safetensors")
    save_file(state, single)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    keys = sorted(state)
    weight_map = {}
    for i in range(3):  # three shards, keys dealt round-robin
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: state[k] for k in keys[i::3]}, str(sharded / name))
        weight_map.update({k: name for k in keys[i::3]})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    torch_file = str(tmp_path / "state.pt")
    torch.save(state, torch_file)
    bad = str(tmp_path / "bad.safetensors")
    save_file({**state, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)}, bad)
    return state, [single, str(sharded), torch_file], bad


def test_each_stage_reads_only_its_tensors_from_a_file_bitwise(tmp_path) -> None:
    kind = "gemma2"  # tied head: the last stage reads the embedding's tensor for it
    state, paths, bad = _write_files(tmp_path, kind)
    out = run_world(load_case, 2, kind, plan_json(kind), paths, bad, timeout=300)
    read_by_stage: dict[int, list[str]] = {}
    for rank in range(2):
        got = out[rank][1]
        for loaded in got["loaded"]:
            stage_state = loaded["state"]
            keys = {k if k in state else "model.embed_tokens.weight" for k in stage_state if k in state
                    or k == "lm_head.weight"}
            assert sorted(loaded["read"]) == sorted(keys), (rank, loaded["read"])  # each needed tensor once
            for k, v in stage_state.items():
                source = state.get(k, state["model.embed_tokens.weight"] if k == "lm_head.weight" else None)
                if source is not None:
                    assert torch.equal(v, source) and v.dtype == source.dtype, k
                else:
                    assert k.endswith(("inv_freq", "embed_scale")), k  # computed, not in any file
            read_by_stage[loaded["stage"]] = loaded["read"]
        assert got["error"] == out[0][1]["error"]
        assert "model.layers.9.mlp.up_proj.weight" in got["error"] and "\n" not in got["error"]
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in read_by_stage[1]  # the tied holder
    assert len(read_by_stage[0]) + len(read_by_stage[1]) < len(state) + 1 + 1


def test_a_file_lacking_a_tensor_names_it(tmp_path) -> None:
    from safetensors.torch import save_file

    model = materialize(build("llama"), seed=1)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.norm.weight"}
    path = str(tmp_path / "w.safetensors")
    save_file(state, path)
    with pytest.raises(PipelineSetupError, match=r"lacks 1 tensors of the model: model\.norm\.weight$"):
        materialize(build("llama"), init=FromFile(path))


def test_a_module_without_an_initialisation_is_named() -> None:
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), Scale())
    with pytest.raises(PipelineSetupError, match=r"no initialisation wrote 1\.gain"):
        materialize(model)


def test_a_pipedream_checkpoint_initialises_a_meta_model(tmp_path) -> None:
    from meta_cases import checkpoint_case
    from runtime_cases import mlp

    url = str(tmp_path / "ckpt")
    trained = run_world(checkpoint_case, 2, url, timeout=240)[0][1]
    with torch.device("meta"):
        model = mlp()
    materialize(model, init=FromFile(url))
    assert sorted(model.state_dict()) == sorted(trained)
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained[k]), k


def test_a_meta_built_job_resized_from_4_to_2_processes_is_minibatch_sgd(tmp_path) -> None:
    """Each attempt builds on meta; the resized one re-plans and restores its new stages from the checkpoint (its
    seeded initialisation is overwritten), ending at the weights of plain minibatch SGD from the seeded model."""
    from meta_cases import resize_case
    from pipedream_reference import minibatch_sgd_reference
    from runtime_cases import adam, data, mlp

    url = str(tmp_path / "ckpt")
    first = run_world(resize_case, 4, url, 16, timeout=240)[0][1]
    assert first["resumed"] is None and first["stages"] == 4
    resized = run_world(resize_case, 2, url, 32, timeout=240)[0][1]
    assert resized["resumed"] == 16 and resized["stages"] == 2
    with torch.device("meta"):
        model = mlp()
    want, losses = minibatch_sgd_reference(materialize(model, seed=0), data, torch.nn.functional.cross_entropy,
                                           adam, 32, 4)
    for k, v in want.items():
        assert (resized["state"][k] - v).abs().max() <= 1e-6, k
    assert resized["losses"] == pytest.approx(losses[16:], abs=1e-6)
