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
from random_models import check_counted, random_models, run_stages

pytestmark = pytest.mark.timeout(600)


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
