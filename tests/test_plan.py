from __future__ import annotations

import json

import pytest

from partitioner import Plan, PlanError, load_plan, partition
from profiler.profile import Layer, Profile

pytestmark = pytest.mark.timeout(60)


def _plan() -> Plan:
    layers = tuple(Layer(str(i), "Conv", 1.0 + i, 2.0, 1e5, 1e6) for i in range(8))
    profile = Profile(layers, tuple((i, i + 1) for i in range(7)))
    return partition(profile, [4], [1e9])


def test_round_trip(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    again = load_plan(path)
    assert again == plan
    assert not list(tmp_path.glob("*.tmp"))


def test_json_has_required_fields():
    data = json.loads(_plan().dumps())
    assert data["time_per_minibatch_s"] > 0
    assert data["speedup_over_data_parallel"] == pytest.approx(
        data["data_parallel_time_s"] / data["time_per_minibatch_s"])
    assert len(data["layer_to_stage"]) == data["num_layers"] == 8
    assert sorted(r for ranks in data["stage_to_ranks"] for r in ranks) == list(range(4))
    assert data["settings"]["workers"] == [4] and data["settings"]["bandwidth"] == [1e9]


def test_from_stages_assigns_contiguous_ranks():
    plan = Plan.from_stages([[0, 1], [2]], [2, 1], profile_hash="h", layer_names=["a", "b", "c"])
    assert plan.stage_to_ranks == [[0, 1], [2]]
    assert plan.layer_to_stage == [0, 0, 1]


def test_rejects_missing_layer():
    with pytest.raises(PlanError, match="belong to no stage"):
        Plan.from_stages([[0]], [1], profile_hash="h", layer_names=["a", "b"])


def test_check_fits():
    plan = _plan()
    plan.check_fits(profile_hash=plan.profile_hash, num_layers=8, world_size=4)
    with pytest.raises(PlanError, match="workers"):
        plan.check_fits(profile_hash=plan.profile_hash, num_layers=8, world_size=3)
    with pytest.raises(PlanError, match="another model"):
        plan.check_fits(profile_hash="x" * 64, num_layers=8, world_size=4)


def test_load_plan_errors(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{")
    with pytest.raises(PlanError, match="invalid JSON"):
        load_plan(bad)
    bad.write_text("{}")
    with pytest.raises(PlanError, match="not a pipedream-ft plan"):
        load_plan(bad)


def _value_plan() -> Plan:
    layers = (Layer("x", "Linear", 1.0, 2.0, 1e5, 1e6), Layer("n", "size", 0.0, 0.0, 0.0, 0.0, kind="value"),
              Layer("v", ".view", 0.5, 0.5, 1e5, 0.0), Layer("y", "Linear", 1.0, 2.0, 1e5, 1e6))
    profile = Profile(layers, ((0, 1), (0, 2), (1, 2), (2, 3)))
    return partition(profile, 2, 1e9, straight=True)


def test_recompute_round_trip(tmp_path):
    plan = _value_plan()
    assert plan.recompute == (1,)
    assert json.loads(plan.dumps())["recompute"] == [1]
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan


def test_recompute_defaults_to_empty(tmp_path):
    data = json.loads(_plan().dumps())
    del data["recompute"]
    assert Plan.from_json(data).recompute == ()


@pytest.mark.parametrize("bad", [[9], [1, 1], [2, 1], [-1], ["1"], 3])
def test_bad_recompute(bad):
    data = json.loads(_value_plan().dumps())
    data["recompute"] = bad
    with pytest.raises(PlanError, match="recompute") as info:
        Plan.from_json(data, source="p.json")
    assert str(info.value).startswith("p.json")
