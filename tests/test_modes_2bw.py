"""PipeDream-2BW (mode "2bw"): its schedule as data, its checks, and the runtime on real gloo processes against a
one-process reference of its semantics (every stage one update behind, gradients averaged over windows of m)."""

from __future__ import annotations

import pytest
import torch

from async_cases import async_case
from dist_helpers import run_world
from partitioner.plan import PlanError
from pipedream_reference import two_bw_reference
from pipedream_ft.pipeline.modes import MODES, TwoBW, make_mode
from pipedream_ft.schedules import Action
from pipedream_ft.schedules.replicated import double_buffered
from pipedream_ft.pipeline.topology import Topology
from pipedream_ft.pipeline.versions import VersionStore
from runtime_cases import MODELS, OPTIMIZERS, data, plan_for
from schedule_helpers import run_replicated

pytestmark = pytest.mark.timeout(240)

MLP4 = [[0, 1], [2, 3], [4, 5], [6, 7, 8]]
loss_fn = torch.nn.functional.cross_entropy


def _actions(text: str, stage: int) -> list[Action]:
    return [Action(stage, t[0], int(t[1:])) for t in text.split()]


def test_schedule_is_1f1b_without_flush_and_one_update_per_window():
    assert double_buffered(0, 0, [1, 1], 0, 6, 2) == _actions("F0 F1 B0 F2 B1 U0 F3 B2 F4 B3 U1 F5 B4 B5 U2", 0)
    assert double_buffered(1, 0, [1, 1], 0, 6, 2) == _actions("F0 B0 F1 B1 U0 F2 B2 F3 B3 U1 F4 B4 F5 B5 U2", 1)
    # a replicated first stage: each replica updates after its own last backward of the window
    assert double_buffered(0, 1, [2, 1], 0, 8, 4) == _actions("F1 F3 B1 F5 B3 U0 F7 B5 B7 U1", 0)
    for replicas in ([1, 1, 1, 1], [2, 1, 1]):
        scheds = [[double_buffered(s, r, replicas, 0, 24, 4) for r in range(n)] for s, n in enumerate(replicas)]
        run_replicated(scheds, replicas)  # runs to completion (raises on a deadlock)
    with pytest.raises(ValueError, match=r"not whole windows of 4"):
        double_buffered(0, 0, [1, 1], 0, 6, 4)


def _topo(replicas: list[int], stage: int = 0) -> Topology:
    stages = [[i] for i in range(len(replicas))]
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in replicas])
    return Topology.of(plan_for(model, stages, replicas), sum(replicas[:stage]))


def test_mode_rules_and_checks():
    assert "2bw" in MODES and isinstance(make_mode("2bw"), TwoBW)
    topo = _topo([1, 1, 1, 1], stage=1)
    mode = make_mode("2bw")
    mode.check(topo)
    assert mode.interval(topo) == 4 and mode.window(topo) == 4 and mode.update_unit(topo) == 4
    assert mode.loss_scale() == 0.25 and mode.versions_kept(topo) == 1 and mode.delay(topo) == 1
    store = VersionStore([torch.zeros(1)], keep=1)
    store.publish()
    store.publish()  # current 2, and 1 kept
    assert [mode.version_for(topo, store, b, 0).updates for b in (8, 11, 12)] == [1, 1, 2]
    with pytest.raises(PlanError, match=r"interval 2 is too short for stage 0: .* at least 3"):
        TwoBW(2).check(_topo([1, 1, 1, 1]))
    with pytest.raises(PlanError, match=r"interval 3 must be a multiple of 2"):
        TwoBW(3).check(_topo([2, 1, 1]))
    with pytest.raises(ValueError, match=r"must be >= 1, got 0"):
        TwoBW(0)


@pytest.mark.slow
def test_2bw_matches_its_reference_on_4_processes():
    out = run_world(async_case, 4, {"stages": MLP4, "mode": "2bw", "opt": "adam", "total": 16})
    model = MODELS["mlp"]()
    want, losses = two_bw_reference(model, plan_for(model, MLP4), data, loss_fn, OPTIMIZERS["adam"], 16, 4)
    for rank in range(4):
        got = out[rank][1]
        assert sorted(got["state"]) == sorted(want)
        for k in want:
            torch.testing.assert_close(got["state"][k], want[k], rtol=0, atol=1e-6, msg=k)
        assert got["losses"] == pytest.approx(losses, abs=1e-6)
    # at most two weight versions on every stage, however deep (stash holds 4, 3, 2, 1)
    assert [out[r][1]["stats"].peak_stash_versions for r in range(4)] == [2, 2, 2, 2]


@pytest.mark.slow
def test_2bw_with_a_longer_interval_and_a_replicated_stage():
    spec = {"stages": [[0, 1, 2, 3], [4, 5, 6], [7, 8]], "replicas": [2, 1, 1], "mode": "2bw", "update_every": 6,
            "opt": "sgd", "total": 18}
    out = run_world(async_case, 4, spec)
    model = MODELS["mlp"]()
    want, losses = two_bw_reference(model, plan_for(model, spec["stages"]), data, loss_fn, OPTIMIZERS["sgd"], 18, 6)
    for rank in range(4):
        for k in want:
            torch.testing.assert_close(out[rank][1]["state"][k], want[k], rtol=0, atol=1e-6, msg=k)
    assert out[0][1]["losses"] == pytest.approx(losses, abs=1e-6)


@pytest.mark.slow
def test_2bw_resumes_from_a_window_cut_exactly(tmp_path):
    """The checkpoint at the cut holds the version before the current one, which the next window reads."""
    spec = {"stages": MLP4, "mode": "2bw", "opt": "sgd", "total": 16, "every": 8, "url": str(tmp_path / "a")}
    run_world(async_case, 4, {**spec, "stop_at": 8})
    resumed = run_world(async_case, 4, spec)
    assert resumed[0][1]["resumed"] == 8
    model = MODELS["mlp"]()
    want, _ = two_bw_reference(model, plan_for(model, MLP4), data, loss_fn, OPTIMIZERS["sgd"], 16, 4)
    for rank in range(4):
        for k in want:
            torch.testing.assert_close(resumed[rank][1]["state"][k], want[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.slow
def test_2bw_gpt_with_tied_embeddings_matches_its_reference():
    from partitioner.plan import Plan
    from runtime_cases import gpt_case, gpt_plan, lm_data, lm_loss, tiny_gpt

    plan_json = gpt_plan(4)
    out = run_world(gpt_case, 4, plan_json, 12, "2bw", "sgd", timeout=300)
    want, losses = two_bw_reference(tiny_gpt(), Plan.from_json(plan_json), lm_data, lm_loss, OPTIMIZERS["sgd"], 12, 4)
    for rank in range(4):
        got = out[rank][1]
        for k in want:
            torch.testing.assert_close(got["state"][k], want[k], rtol=0, atol=1e-6, msg=k)
        assert got["losses"] == pytest.approx(losses, abs=1e-6)
        assert torch.equal(got["state"]["wte.weight"], got["state"]["lm_head.weight"])  # the copies agree
