from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from helpers_profiles import random_profile
from partitioner import PlanError, linearize, partition
from partitioner import cost
from partitioner.optimizer import exhaustive_level, flat_problem, solve_level
from profiler.profile import Layer, Profile

pytestmark = pytest.mark.timeout(120)


def _chain_exhaustive(profile: Profile, M: int, bw: float, straight: bool = False) -> float:
    """Every contiguous split of a chain and every replica split, priced straight from layer sums."""
    n = len(profile.layers)
    comp = [(l.forward_ms + l.backward_ms) / 1000.0 for l in profile.layers]
    par = [l.parameter_bytes for l in profile.layers]
    act = [l.activation_bytes for l in profile.layers]
    best = math.inf
    for k in range(1, min(n, M) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            stages = [(bounds[i], bounds[i + 1]) for i in range(k)]
            rep_choices = [[1] * k] if straight else [
                c for c in itertools.product(range(1, M + 1), repeat=k) if sum(c) == M]
            if straight and k != M:
                continue
            for reps in rep_choices:
                worst = 0.0
                for s, ((a, b), r) in enumerate(zip(stages, reps)):
                    C = sum(comp[a:b])
                    P = sum(par[a:b])
                    if s == 0:
                        t = cost.first_stage_time(C, P, r, bw)
                    else:
                        t = cost.stage_time(C, P, r, bw, act[a - 1], act[b - 1] if b < n else 0.0)
                    worst = max(worst, float(t))
                best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_dp_equals_exhaustive_search(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 6)
    M = rng.randint(1, 4)
    bw = rng.choice([1e8, 1e9, 1e10])
    dag = seed % 2 == 1
    profile = random_profile(rng, n, dag=dag)
    plan = partition(profile, [M], [bw])
    states = linearize(profile)
    expected = exhaustive_level(flat_problem(states, M, bw, False, None))
    assert plan.time_per_minibatch_s == pytest.approx(expected, rel=1e-12)
    if not dag:
        assert plan.time_per_minibatch_s == pytest.approx(_chain_exhaustive(profile, M, bw), rel=1e-12)
    assert plan.world_size == M
    assert max(s.time_s for s in plan.stages) == pytest.approx(plan.time_per_minibatch_s, rel=1e-12)
    for a, b in profile.edges:
        assert plan.layer_to_stage[a] <= plan.layer_to_stage[b]


@pytest.mark.parametrize("seed", range(20))
def test_straight_equals_exhaustive(seed):
    rng = random.Random(2000 + seed)
    n = rng.randint(3, 6)
    M = rng.randint(1, n)
    profile = random_profile(rng, n, dag=False)
    plan = partition(profile, [M], [1e9], straight=True)
    assert plan.num_stages == M and all(s.replicas == 1 for s in plan.stages)
    assert plan.time_per_minibatch_s == pytest.approx(_chain_exhaustive(profile, M, 1e9, True), rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_memory_limit_equals_exhaustive(seed):
    rng = random.Random(3000 + seed)
    n = rng.randint(2, 5)
    M = rng.randint(1, 3)
    profile = random_profile(rng, n, dag=seed % 2 == 1)
    states = linearize(profile)
    total = float(states.parameter_bytes[-1] + states.activation_bytes[-1])
    limit = total * rng.uniform(0.3, 1.5)
    expected = exhaustive_level(flat_problem(states, M, 1e9, False, limit))
    if expected is None:
        with pytest.raises(PlanError, match="memory limit"):
            partition(profile, [M], [1e9], memory_bytes=limit)
        return
    plan = partition(profile, [M], [1e9], memory_bytes=limit)
    assert plan.time_per_minibatch_s == pytest.approx(expected, rel=1e-12)
    S = plan.num_stages
    layers = profile.layers
    for s in plan.stages:
        need = cost.stage_memory(sum(layers[i].parameter_bytes for i in s.layers),
                                 sum(layers[i].activation_bytes for i in s.layers), S - s.index)
        assert need <= limit * (1 + 1e-12)


def _big_chain(n: int = 6) -> Profile:
    layers = tuple(Layer(str(i), "Conv", 10.0, 20.0, 1e6, 1e8) for i in range(n))
    return Profile(layers, tuple((i, i + 1) for i in range(n - 1)))


def test_memory_error_names_limit_and_smallest_need():
    p = _big_chain()
    with pytest.raises(PlanError) as exc:
        partition(p, [2], [1e9], memory_bytes=1e6)
    msg = str(exc.value)
    assert "1e+06" in msg and "smallest plan needs" in msg
    need = float(msg.rsplit("needs ", 1)[1].split()[0])
    partition(p, [2], [1e9], memory_bytes=need * 1.0001)  # a limit at the reported need works


def _needs(profile: Profile, plan) -> list[float]:
    L = profile.layers
    return [cost.stage_memory(sum(L[i].parameter_bytes for i in s.layers),
                              sum(L[i].activation_bytes for i in s.layers), plan.num_stages - s.index)
            for s in plan.stages]


def test_memory_limit_changes_the_plan():
    p = _big_chain()
    free = partition(p, [2], [1e9])
    limit = max(_needs(p, free)) * 0.999
    tight = partition(p, [2], [1e9], memory_bytes=limit)
    assert max(_needs(p, tight)) <= limit
    assert tight.time_per_minibatch_s >= free.time_per_minibatch_s
    assert tight.settings["memory_bytes"] == limit


def test_hierarchical_plan_covers_all_workers():
    rng = random.Random(7)
    profile = random_profile(rng, 6, dag=True, with_input=True)
    plan = partition(profile, [2, 3], [1e10, 1e9])
    assert plan.world_size == 6
    assert plan.settings["stages_per_level"][0] == plan.num_stages
    assert plan.layer_to_stage[0] == 0
    for a, b in profile.edges:
        assert plan.layer_to_stage[a] <= plan.layer_to_stage[b]


def test_single_level_hierarchy_is_flat():
    rng = random.Random(8)
    profile = random_profile(rng, 5, dag=False)
    a = partition(profile, [4], [1e9])
    b = partition(profile, [1, 4], [1e12, 1e9])  # one worker per machine: the inner level is trivial
    assert b.time_per_minibatch_s == pytest.approx(a.time_per_minibatch_s, rel=1e-12)


def test_plan_fields():
    rng = random.Random(9)
    profile = random_profile(rng, 5, dag=False, with_input=True)
    plan = partition(profile, [3], [1e9])
    assert plan.profile_hash == profile.structure_hash()
    assert plan.layer_names == tuple(l.name for l in profile.layers)
    assert plan.settings == {"workers": [3], "bandwidth": [1e9], "straight": False, "memory_bytes": None,
                             "stages_per_level": [plan.num_stages]}
    states = linearize(profile)
    dp = cost.data_parallel_time(states.compute_s[-1], states.parameter_bytes[-1], [3], [1e9])
    assert plan.data_parallel_time_s == pytest.approx(dp)
    assert plan.speedup_over_data_parallel == pytest.approx(dp / plan.time_per_minibatch_s)


@pytest.mark.parametrize("workers,bandwidth,match", [
    ([0], [1e9], "workers"), ([-2], [1e9], "workers"), ([2], [0.0], "bandwidth"), ([2], [-1e9], "bandwidth"),
    ([2], [float("nan")], "bandwidth"), ([2, 2], [1e9], "levels"), ([], [], "level"),
])
def test_bad_settings(workers, bandwidth, match):
    with pytest.raises(PlanError, match=match):
        partition(_big_chain(3), workers, bandwidth)


def test_straight_longer_than_model_fails():
    with pytest.raises(PlanError, match="straight"):
        partition(_big_chain(3), [5], [1e9], straight=True)


def test_solve_level_matches_bruteforce_on_wide_worker_counts():
    rng = random.Random(11)
    profile = random_profile(rng, 4, dag=False)
    states = linearize(profile)
    for M in (5, 6, 70):  # 70 workers: more than one 64-bit word per bitset
        prob = flat_problem(states, M, 1e9, False, None)
        got = solve_level(prob)
        if M <= 6:
            assert got.time_s == pytest.approx(exhaustive_level(prob), rel=1e-12)
        assert sum(got.replicas) == M


@pytest.mark.parametrize("seed", range(12))
def test_replica_counts_are_exact_at_every_threshold(seed):
    """``_Search.allowed``: the least r >= 2 meeting T equals a scan of the cost formula, ties included."""
    from partitioner.optimizer import _Search

    rng = random.Random(7000 + seed)
    profile = random_profile(rng, rng.randint(3, 7), dag=seed % 2 == 1)
    M = rng.randint(2, 9)
    search = _Search(flat_problem(linearize(profile), M, rng.choice([1e8, 1e9, 1e10]), False, None))
    times = [search.pair_time(r) for r in range(1, M + 1)]
    firsts = [search.first_time(r) for r in range(1, M + 1)]
    thresholds = {float(t) for ts in times + firsts for t in np.ravel(ts)}  # every stage time: exact ties
    thresholds |= {t * (1 + 1e-15) for t in list(thresholds)[:20]} | {t * (1 - 1e-15) for t in list(thresholds)[:20]}
    for T in sorted(thresholds):
        ok1, rho, ok01, rho0 = search.allowed(T)
        for tab, got in ((times, rho), (firsts, rho0)):
            want = np.full(len(got), M + 1)
            for r in range(M, 1, -1):
                want = np.where(tab[r - 1] <= T, r, want)
            # counts above the least one must fit too (time is non-increasing in r >= 2)
            assert np.array_equal(got, want), (T, got, want)
        assert np.array_equal(ok1, times[0] <= T) and np.array_equal(ok01, firsts[0] <= T)


def _holder_replicas(profile: Profile, plan) -> list[set[int]]:
    stage_of = plan.layer_to_stage
    out = []
    for g in profile.tied:
        holders = {stage_of[i] for i in g.layers}
        if len(holders) > 1:
            out.append({plan.stages[s].replicas for s in holders})
    return out


@pytest.mark.parametrize("seed", range(30))
def test_tied_holders_are_planned_with_equal_replicas_and_the_search_stays_exact(seed):
    """Stages that hold part of a tied group exchange its gradients replica by replica, so the runtime needs
    equal replica counts on them: the search plans them unreplicated, and is still the exact optimum of that
    problem (brute force over every chain and replica split that respects it)."""
    from profiler.profile import TiedGroup

    import dataclasses

    rng = random.Random(5000 + seed)
    n = rng.randint(3, 7)
    M = rng.randint(3, 6)
    bw = rng.choice([1e9, 1e10])
    base = random_profile(rng, n, dag=seed % 2 == 1)
    layers = list(base.layers)  # a heavy first layer with a light tied weight: replicating it would pay
    layers[0] = dataclasses.replace(layers[0], forward_ms=layers[0].forward_ms * 8 + 5, parameter_bytes=1e3)
    a, b = (0, n - 1) if seed % 3 else sorted(rng.sample(range(n), 2))
    profile = Profile(tuple(layers), base.edges, base.meta, (TiedGroup("w", 1e3 * rng.randint(1, 100), (a, b)),))
    plan = partition(profile, [M], [bw])
    assert plan.world_size == M
    assert all(reps == {1} for reps in _holder_replicas(profile, plan)), plan.stages
    prob = flat_problem(linearize(profile), M, bw, False, None)
    assert prob.pair_single is not None
    assert plan.time_per_minibatch_s == pytest.approx(exhaustive_level(prob), rel=1e-12)
    untied = Profile(tuple(layers), base.edges, base.meta, ())
    assert plan.time_per_minibatch_s >= partition(untied, [M], [bw]).time_per_minibatch_s * (1 - 1e-12)


def test_hierarchical_plans_with_tied_groups_keep_holders_runnable():
    from profiler.profile import TiedGroup

    rng = random.Random(7)
    for trial in range(10):
        n = rng.randint(4, 8)
        base = random_profile(rng, n, dag=False)
        profile = Profile(base.layers, base.edges, base.meta, (TiedGroup("w", 4e6, (0, n - 1)),))
        plan = partition(profile, [2, 2], [1e10, 1e9])
        assert plan.world_size == 4
        assert all(len(reps) == 1 for reps in _holder_replicas(profile, plan)), plan.stages
