"""Planning the fx-traced GPT: few antichain states once value layers are contracted, and runnable plans."""

from __future__ import annotations

import pytest
import torch

from pipedream_ft_examples.gpt import gpt
from partitioner import partition
from partitioner.antichain import linearize
from partitioner.contract import contract
from profiler.measure import profile_model
from profiler.profile import Layer, Profile
from random_models import check_counted, run_stages

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def gpt4():
    torch.manual_seed(0)
    model = gpt(n_layer=4, n_embd=64, n_head=4, block_size=32)
    idx = torch.randint(0, 256, (2, 16))
    return model, idx, profile_model(model, idx, warmup=0, repeats=1)


def test_value_layers_shrink_the_search(gpt4):
    _, _, profile = gpt4
    assert len(profile) == 139
    values = [l for l in profile.layers if l.kind == "value"]
    assert len(values) == 32  # size, getitem of sizes, floordiv, getattr (device)
    assert {l.description for l in values} == {".size", "getitem", "floordiv", "getattr"}
    # the search's states: 322 over the tensor layers, instead of 4296 had every layer been a cut point
    assert linearize(contract(profile).profile).num_states == 322
    every = Profile(tuple(Layer(l.name, l.description, l.forward_ms, l.backward_ms, l.activation_bytes,
                                l.parameter_bytes) for l in profile.layers), profile.edges)
    assert linearize(every).num_states == 4296


@pytest.mark.parametrize("workers", [4, 8, 16])
@pytest.mark.parametrize("straight", [False, True])
def test_plans_only_send_counted_tensors(gpt4, workers, straight):
    model, idx, profile = gpt4
    plan = partition(profile, workers, 1e9, straight=straight)
    assert plan.world_size == workers
    assert plan.recompute == tuple(i for i, l in enumerate(profile.layers) if l.kind == "value")
    (group,) = profile.tied  # the embedding's holders exchange gradients replica by replica: equal counts
    holders = {plan.layer_to_stage[i] for i in group.layers}
    assert len({plan.stages[s].replicas for s in holders}) == 1, plan.stages
    model.eval()
    crossings = run_stages(model, idx, profile, plan)
    check_counted(profile, plan, crossings)


def test_split_tied_embedding_is_paid_for(gpt4):
    _, _, profile = gpt4
    plan = partition(profile, 4, 1e9, straight=True)
    (group,) = profile.tied
    stage_of = plan.layer_to_stage
    assert stage_of[group.layers[0]] == 0 and stage_of[group.layers[1]] == 3  # wte first, lm_head last
    # a straight first stage: its tensor layers' compute plus the tied weight's sync, 2 P / B
    compute = sum((l.forward_ms + l.backward_ms) / 1000 for i, l in enumerate(profile.layers)
                  if stage_of[i] == 0 and l.kind == "tensor")
    assert plan.stages[0].time_s == pytest.approx(compute + 2 * group.bytes / 1e9, rel=1e-9)
    untied = Profile(profile.layers, profile.edges, profile.meta, (), profile.inputs)
    assert plan.time_per_minibatch_s >= partition(untied, 4, 1e9, straight=True).time_per_minibatch_s
