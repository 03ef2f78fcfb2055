"""Throughput curves: the partitioner's predicted time per minibatch, planned once and cached on disk."""

from __future__ import annotations

import pytest

from partitioner.optimizer import partition
from pipedream_ft.pool import PlanSettings, PoolError, ThroughputModel
from profiler.profile import load_profile

from pool_helpers import write_chain_profile

pytestmark = pytest.mark.timeout(60)


def test_rate_is_one_over_the_best_plans_time_per_minibatch(tmp_path) -> None:
    prof = write_chain_profile(tmp_path / "m.graph.txt")
    tm = ThroughputModel({"m": prof}, PlanSettings(bandwidth=1e9))
    for n in (1, 2, 3):
        assert tm.rate("m", n) == pytest.approx(1 / partition(load_profile(prof), n, 1e9).time_per_minibatch_s)
    assert tm.curve("m", [1, 2])[2] > tm.curve("m", [1, 2])[1]


def test_each_size_is_planned_once_and_the_disk_cache_is_keyed_by_profile_and_settings(tmp_path) -> None:
    prof = write_chain_profile(tmp_path / "m.graph.txt")
    cache = tmp_path / "cache"
    tm = ThroughputModel({"m": prof}, PlanSettings(bandwidth=1e9), cache)
    first = tm.curve("m", range(1, 5))
    tm.curve("m", range(1, 5))
    assert tm.planned == 4
    again = ThroughputModel({"m": prof}, PlanSettings(bandwidth=1e9), cache)
    assert again.curve("m", range(1, 5)) == first and again.planned == 0
    other_bw = ThroughputModel({"m": prof}, PlanSettings(bandwidth=1e6), cache)
    other_bw.curve("m", [2])
    assert other_bw.planned == 1
    write_chain_profile(prof, ms=20.0)  # a changed profile is planned anew
    changed = ThroughputModel({"m": prof}, PlanSettings(bandwidth=1e9), cache)
    assert changed.rate("m", 1) == pytest.approx(first[1] / 2) and changed.planned == 1


def test_sizes_with_no_plan_are_left_out(tmp_path) -> None:
    prof = write_chain_profile(tmp_path / "m.graph.txt", layers=3)
    tm = ThroughputModel({"m": prof}, PlanSettings(bandwidth=1e9, straight=True))
    assert tm.time_per_minibatch("m", 5) is None  # a straight pipeline of 5 stages from 3 layers
    assert sorted(tm.curve("m", range(1, 6))) == [1, 2, 3]


def test_bad_settings_and_models_are_refused() -> None:
    with pytest.raises(PoolError, match="bandwidth must be > 0"):
        PlanSettings(bandwidth=0)
    with pytest.raises(PoolError, match="unknown model 'x'"):
        ThroughputModel({}).rate("x", 1)


def test_a_real_pipedream_profile_scales_and_plans_fast(tmp_path, shared_profiles) -> None:
    tm = ThroughputModel({"resnet18": shared_profiles / "resnet18.graph.txt"}, PlanSettings(), tmp_path)
    c = tm.curve("resnet18", [1, 2, 4, 8])
    assert c[1] < c[2] < c[4] < c[8]


def test_a_model_with_a_large_search_is_offered_powers_of_two(tmp_path) -> None:
    prof = write_chain_profile(tmp_path / "m.graph.txt")
    assert ThroughputModel({"m": prof}).elastic_sizes("m", 1, 6) == [1, 2, 3, 4, 5, 6]
    big = ThroughputModel({"m": prof}, dense_states=0)
    assert big.elastic_sizes("m", 1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert big.elastic_sizes("m", 3, 12) == [3, 4, 8, 12]
