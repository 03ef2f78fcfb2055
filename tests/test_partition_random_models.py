"""Property: every plan the partitioner emits for a random fx model is runnable, and its cut sizes are honest.

For random models with branches, residuals, tuple-returning calls and shape arithmetic (see
:mod:`random_models`), random worker counts and both modes:

(a) every value that really crosses a cut (under the runtime's contract) is counted by the search: it is in
    the cut state's crossing set, and the bytes counted are at least the bytes that cross;
(b) only tensors cross: value layers are exactly ``plan.recompute``, and a stage-by-stage run that hands over
    only the crossing tensors reproduces every layer.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner import PlanError, partition
from partitioner.antichain import linearize
from partitioner.contract import contract
from profiler.measure import profile_model
from profiler.profile import Profile
from random_models import Key, random_models, run_stages

pytestmark = pytest.mark.timeout(600)


def check_counted(profile: Profile, plan, crossings: list[set[Key]]) -> None:
    """(a): the search counted every value in ``crossings`` at the cut where it crosses."""
    con = contract(profile)
    states = linearize(con.profile)
    position = {old: new for new, old in enumerate(con.tensor_layers)}
    stage_of = plan.layer_to_stage
    by_downset = {d: k for k, d in enumerate(states.downsets)}
    for t in range(1, plan.num_stages):
        down = tuple(sorted(position[i] for i in con.tensor_layers if stage_of[i] < t))
        assert down in by_downset, f"the cut before stage {t} is no antichain state of the search"
        k = by_downset[down]
        counted: set[Key] = {("layer", con.tensor_layers[i]) for i in states.crossing[k]}
        for x, inp in enumerate(con.profile.inputs):
            if set(inp.readers) - set(down):
                counted.add(("input", x))
        missing = crossings[t] - counted
        assert not missing, f"cut before stage {t}: {sorted(missing)} cross but are not counted"
        real = sum(profile.layers[i].activation_bytes if kind == "layer" else profile.inputs[i].bytes
                   for kind, i in crossings[t])
        assert real <= states.output_bytes[k] * (1 + 1e-12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_models(), st.integers(2, 6), st.booleans())
def test_plans_of_random_models_only_send_counted_tensors(model_and_input, workers, straight):
    model, example = model_and_input
    torch.manual_seed(0)
    profile = profile_model(model, example, warmup=0, repeats=1)
    try:
        plan = partition(profile, workers, 1e9, straight=straight)
    except PlanError as exc:  # a straight pipeline longer than the model has cut points
        assert straight and "straight" in str(exc)
        assert linearize(contract(profile).profile).longest_chain() < workers
        return
    values = [i for i, layer in enumerate(profile.layers) if layer.kind == "value"]
    assert list(plan.recompute) == values
    assert plan.world_size == workers
    for a, b in profile.edges:
        assert plan.layer_to_stage[a] <= plan.layer_to_stage[b]
    crossings = run_stages(model, example, profile, plan)
    check_counted(profile, plan, crossings)
    for t, keys in enumerate(crossings):
        assert all(kind == "input" or profile.layers[i].kind == "tensor" for kind, i in keys)
