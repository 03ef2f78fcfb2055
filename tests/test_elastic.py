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
from pipedream_reference import elastic_reference, minibatch_sgd_reference
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


@pytest.mark.parametrize("schedule", ["zb_h1", "gpipe"])
def test_a_synchronous_schedule_shrinks_and_grows_back_as_minibatch_sgd(tmp_path, schedule):
    """Elastic resize under flush mode's schedules (ZB-H1's split backward, GPipe): the cuts fall at window ends,
    so 4 -> 2 -> 4 workers ends at plain minibatch SGD's weights whatever the plans in between."""
    url = str(tmp_path / "ckpt")
    args = ("flush", "adam", True, schedule)
    first = run_world(checkpointed_case, 4, url, P4, None, 16, None, 8, *args)[0][1]
    assert first["position"] == 16
    shrunk = run_world(checkpointed_case, 2, url, P4, None, 32, None, 8, *args)[0][1]
    assert shrunk["resumed"] == 16 and len(shrunk["stages"]) == 2
    grown = run_world(checkpointed_case, 4, url, P4, None, 48, None, 8, *args)[0][1]
    assert grown["resumed"] == 32 and len(grown["stages"]) == 4
    want, losses = minibatch_sgd_reference(mlp(), data, torch.nn.functional.cross_entropy, adam, 48, 4)
    for k, v in want.items():
        torch.testing.assert_close(grown["state"][k], v, rtol=0, atol=1e-6, msg=k)
    assert grown["losses"] == pytest.approx(losses[32:], abs=1e-6)


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


def test_replan_keeps_the_plan_s_machine_profile() -> None:
    """A plan made with measured costs is re-planned with them (same levels), or without them when a
    multi-level machine no longer fits the new world size."""
    import random

    from helpers_profiles import random_profile
    from partitioner.machine import MachineLevel, MachineProfile
    from partitioner.optimizer import partition
    from pipedream_ft.ft.elastic import replan

    profile = random_profile(random.Random(3), 12, dag=False)
    machine = MachineProfile((MachineLevel(4, 2e-3, 1e8, 5e-3, 5e7),), overhead_s=1e-3)
    plan = partition(profile, None, None, machine=machine)
    again = replan(profile, 4, plan.settings)
    assert again.settings["machine"] == plan.settings["machine"]
    assert again.time_per_minibatch_s == plan.time_per_minibatch_s
    smaller = replan(profile, 2, plan.settings)
    assert smaller.settings["machine"] == plan.settings["machine"]
    assert smaller.time_per_minibatch_s == partition(profile, [2], None, machine=machine).time_per_minibatch_s
    # a two-level machine and a world size that no longer factors into it: planned without the profile
    two = MachineProfile((MachineLevel(2, 1e-4, 1e9), MachineLevel(2, 1e-3, 1e8)))
    plan2 = partition(profile, None, None, machine=two)
    fallback = replan(profile, 3, plan2.settings)
    assert not fallback.settings.get("machine")
