"""Each process's memory report: its stage's weights, gradients, optimizer state, weight versions and in-flight
activations, against its peak and the plan's prediction (``trainer.gather_stats()[rank]["memory"]``).

A 2-stage MLP trained with Adam in stash mode on 2 gloo ranks: the weights are the stage's parameter bytes,
gradients the same, Adam's state twice that (and its step counts); stage 0 keeps 2 weight versions (copies) and
2 minibatches in flight, stage 1 one of each, its version being the live weights themselves (no copy: its
backward always runs before its next update); the activations saved are more than nothing and the prediction is
``(S - s) · (P + A)`` of the profile.
"""

from __future__ import annotations

import pytest

from dist_helpers import run_world
from meta_cases import memory_case
from runtime_cases import mlp, timed_profile

pytestmark = [pytest.mark.timeout(300)]


def test_every_process_reports_where_its_memory_goes() -> None:
    out = run_world(memory_case, 2, "stash", timeout=240)
    rows = out[0][1]
    assert rows == out[1][1]
    model, profile = mlp(), timed_profile(mlp())
    stages = [[0, 1, 2, 3], [4, 5, 6, 7, 8]]
    names = [name for name, _ in model.named_children()]
    for row in rows:
        memory, s = row["memory"], row["stage"]
        params = sum(p.numel() * 4 for i in stages[s] for p in model.get_submodule(names[i]).parameters())
        assert memory["parameters"] == params and memory["gradients"] == params
        assert 2 * params <= memory["optimizer"] <= 2 * params + 8 * 8  # exp_avg, exp_avg_sq, a step each
        assert memory["stash"] == row["peak_stash_bytes"] == (2 * params if s == 0 else 0)
        assert memory["in_flight"] == 2 - s and memory["activations"] > 0
        assert memory["peak"] >= memory["baseline"] > 0
        layers = [profile.layers[i] for i in stages[s]]
        assert memory["predicted"] == (2 - s) * sum(l.parameter_bytes + l.activation_bytes for l in layers)
        assert memory["accounted"] == sum(memory[k] for k in ("parameters", "gradients", "optimizer", "stash",
                                                             "activations"))
