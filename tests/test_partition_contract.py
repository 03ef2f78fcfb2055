"""Value layers are contracted out of the search; plans list them for recomputation."""

from __future__ import annotations

import random

import pytest

from helpers_profiles import random_profile
from partitioner import PlanError, linearize, partition
from partitioner import cost
from partitioner.contract import contract, place_values, tensor_roots
from partitioner.optimizer import exhaustive_level, flat_problem
from profiler.profile import Layer, ModelInput, Profile, TiedGroup

pytestmark = pytest.mark.timeout(120)


def _t(name: str, act: float = 100.0, par: float = 10.0, ms: float = 1.0) -> Layer:
    return Layer(name, "Linear", ms, 2 * ms, act, par)


def _v(name: str) -> Layer:
    return Layer(name, "size", 0.01, 0.0, 0.0, 0.0, kind="value")


def _attention_like() -> Profile:
    """x -> a -> b -> c -> d, with n = a.size() feeding c (view of b) and m = n // 2 feeding d; input read by n2."""
    layers = (_t("a"), _v("n"), _v("m"), _t("b"), _t("c"), _v("n2"), _t("d"))
    edges = ((0, 1), (0, 3), (1, 2), (1, 4), (2, 6), (3, 4), (4, 6), (5, 6))
    return Profile(layers, edges, {}, (TiedGroup("a.weight", 10.0, (0, 6)),),
                   (ModelInput("x", 32.0, (0, 5)),))


def test_tensor_roots_follow_value_chains():
    roots, inputs = tensor_roots(_attention_like())
    assert roots[1] == {0} and roots[2] == {0} and roots[5] == set()
    assert roots[0] == {0} and roots[4] == {4}
    assert inputs[5] == {0} and inputs[1] == set()


def test_contract_replaces_value_edges_by_root_edges():
    con = contract(_attention_like())
    assert con.value_layers == (1, 2, 5)
    assert con.tensor_layers == (0, 3, 4, 6)
    p = con.profile
    assert [l.name for l in p.layers] == ["a", "b", "c", "d"]
    # a -> b, a -> c (through n), a -> d (through m), b -> c, c -> d
    assert p.edges == ((0, 1), (0, 2), (0, 3), (1, 2), (2, 3))
    assert p.tied == (TiedGroup("a.weight", 10.0, (0, 3)),)
    # d reads the input through the value layer n2
    assert p.inputs == (ModelInput("x", 32.0, (0, 3)),)


def test_contract_without_value_layers_is_the_identity():
    p = random_profile(random.Random(3), 6, dag=True)
    assert contract(p).profile is p


def test_only_value_layers_is_an_error():
    with pytest.raises(PlanError, match="only value layers"):
        partition(Profile((_v("n"),), ()), 1, 1e9)


def test_place_values_uses_earliest_consumer_or_last_stage():
    p = Profile((_t("a"), _v("n"), _v("m"), _t("b"), _t("c"), _v("dead")),
                ((0, 1), (1, 2), (1, 4), (2, 3), (0, 3), (3, 4), (0, 5)))
    assert place_values(p, [0, None, None, 2, 1, None], 3) == [0, 1, 2, 2, 1, 2]


def test_plan_lists_value_layers_and_counts_roots_across_cuts():
    p = _attention_like()
    plan = partition(p, 4, 1e9, straight=True)
    assert plan.recompute == (1, 2, 5)
    assert [s.layers for s in plan.stages] == [(0,), (3,), (1, 4), (2, 5, 6)]  # n with c, m and n2 with d
    # c (stage 2) recomputes n from a, and d (stage 3) m from a: a's output crosses every cut; the input x too
    states = linearize(contract(p).profile)
    assert list(states.output_bytes[:3]) == [100.0 + 32.0, 200.0 + 32.0, 200.0 + 32.0]


def test_value_layers_are_no_cut_points():
    # a chain of 3 tensor layers with 3 value layers between them: only 3 stages fit
    layers = (_t("a"), _v("s1"), _t("b"), _v("s2"), _v("s3"), _t("c"))
    p = Profile(layers, ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (0, 2), (2, 5)))
    assert partition(p, 3, 1e9, straight=True).num_stages == 3
    with pytest.raises(PlanError, match="at most 3 stages"):
        partition(p, 4, 1e9, straight=True)


@pytest.mark.parametrize("seed", range(40))
def test_random_dags_with_values_and_ties_are_exact(seed):
    rng = random.Random(5000 + seed)
    base = random_profile(rng, rng.randint(3, 7), dag=True)
    n = len(base.layers)
    kinds = ["value" if 0 < i < n - 1 and rng.random() < 0.3 else "tensor" for i in range(n)]
    layers = tuple(Layer(l.name, l.description, l.forward_ms, l.backward_ms,
                         0.0 if k == "value" else l.activation_bytes, 0.0 if k == "value" else l.parameter_bytes, k)
                   for l, k in zip(base.layers, kinds))
    tensors = [i for i in range(n) if kinds[i] == "tensor"]
    tied = ()
    if len(tensors) >= 2 and rng.random() < 0.7:
        members = tuple(sorted(rng.sample(tensors, min(len(tensors), rng.randint(2, 3)))))
        tied = (TiedGroup("w", float(rng.randrange(1, 10**8)), members),)
    p = Profile(layers, base.edges, {}, tied, (ModelInput("x", 1e5, (0,)),))
    M = rng.randint(1, 4)
    straight = rng.random() < 0.3
    try:
        plan = partition(p, M, 1e9, straight=straight)
    except PlanError:
        assert straight
        return
    states = linearize(contract(p).profile)
    expected = exhaustive_level(flat_problem(states, M, 1e9, straight, None))
    assert plan.time_per_minibatch_s == pytest.approx(expected, rel=1e-12)
    assert list(plan.recompute) == [i for i in range(n) if kinds[i] == "value"]
    stage_of = plan.layer_to_stage
    for a, b in p.edges:
        assert stage_of[a] <= stage_of[b]
    succ = p.successors()
    for i in plan.recompute:
        assert stage_of[i] == min((stage_of[c] for c in succ[i]), default=plan.num_stages - 1)


# -- tied parameters, against a brute force over chain splits --------------------------------------------------


def _tied_chain_exhaustive(p: Profile, M: int, bw: float, straight: bool, memory: float | None) -> float | None:
    """Every split of a chain and replica split, priced from layer sums with the tied-group terms of cost.py
    (a stage holding part of a tied group has one replica)."""
    import itertools

    n = len(p.layers)
    comp = [(l.forward_ms + l.backward_ms) / 1000.0 for l in p.layers]
    par = [l.parameter_bytes for l in p.layers]
    act = [l.activation_bytes for l in p.layers]
    best = None
    for k in range(1, min(n, M) + 1):
        if straight and k != M:
            continue
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            stages = [(bounds[i], bounds[i + 1]) for i in range(k)]
            reps_all = [[1] * k] if straight else [c for c in itertools.product(range(1, M + 1), repeat=k)
                                                    if sum(c) == M]
            for reps in reps_all:
                worst, ok = 0.0, True
                for s, ((a, b), r) in enumerate(zip(stages, reps)):
                    C, P = sum(comp[a:b]), sum(par[a:b])
                    for g in p.tied:
                        inside = [i for i in g.layers if a <= i < b]
                        if 0 < len(inside) < len(g.layers):
                            C += 2 * g.bytes / bw
                            ok = ok and r == 1  # a holder of a split group runs unreplicated
                        if inside and g.layers[0] not in inside:
                            P += g.bytes
                    if memory is not None and (k - s) * (P + sum(act[a:b])) > memory:
                        ok = False
                    if s == 0:
                        t = cost.first_stage_time(C, P, r, bw)
                    else:
                        t = cost.stage_time(C, P, r, bw, act[a - 1], act[b - 1] if b < n else 0.0)
                    worst = max(worst, float(t))
                if ok and (best is None or worst < best):
                    best = worst
    return best


@pytest.mark.parametrize("seed", range(40))
def test_tied_groups_on_chains_match_brute_force(seed):
    rng = random.Random(6000 + seed)
    base = random_profile(rng, rng.randint(3, 6), dag=False)
    n = len(base.layers)
    groups = []
    for g in range(rng.randint(1, 2)):
        members = tuple(sorted(rng.sample(range(n), rng.randint(2, min(3, n)))))
        groups.append(TiedGroup(f"w{g}", float(rng.choice([1e6, 1e8, 1e9])), members))
    p = Profile(base.layers, base.edges, {}, tuple(groups))
    M = rng.randint(1, 4)
    bw = rng.choice([1e9, 1e10])
    straight = rng.random() < 0.3 and M <= n
    memory = None
    if rng.random() < 0.3:
        memory = sum(l.parameter_bytes + l.activation_bytes for l in p.layers) * rng.uniform(0.5, 2.0)
    expected = _tied_chain_exhaustive(p, M, bw, straight, memory)
    if expected is None:
        with pytest.raises(PlanError):
            partition(p, M, bw, straight=straight, memory_bytes=memory)
        return
    plan = partition(p, M, bw, straight=straight, memory_bytes=memory)
    assert plan.time_per_minibatch_s == pytest.approx(expected, rel=1e-9)


def test_split_tied_group_costs_sync_time():
    layers = tuple(_t(str(i), act=0.0, par=0.0, ms=10.0) for i in range(4))
    chain = tuple((i, i + 1) for i in range(3))
    plain = partition(Profile(layers, chain), 2, 1e9, straight=True)
    tied = partition(Profile(layers, chain, {}, (TiedGroup("w", 1e6, (0, 3)),)), 2, 1e9, straight=True)
    # 4 layers of 30 ms in two stages of 60 ms; each stage holds one end of the group: + 2 P / B = 2 ms
    assert plain.time_per_minibatch_s == pytest.approx(0.060)
    assert tied.time_per_minibatch_s == pytest.approx(0.060 + 2 * 1e6 / 1e9)


def test_scalar_and_numpy_settings():
    import numpy as np

    p = random_profile(random.Random(4), 6, dag=True)
    a = partition(p, [4], [1e9])
    assert partition(p, 4, 1e9) == a
    assert partition(p, np.int64(4), np.float64(1e9)) == a
    assert partition(p, 4, 1000000000) == a
    with pytest.raises(PlanError, match="workers"):
        partition(p, "4", 1e9)


@pytest.mark.parametrize("seed", range(10))
def test_tied_groups_on_a_trivial_inner_level_plan_as_flat(seed):
    rng = random.Random(8000 + seed)
    base = random_profile(rng, rng.randint(4, 6), dag=False)
    p = Profile(base.layers, base.edges, {}, (TiedGroup("w", 1e6, (0, len(base.layers) - 1)),))
    M = rng.randint(2, 4)
    for straight in (False, True):
        flat = partition(p, M, 1e9, straight=straight)
        nested = partition(p, [1, M], [1e10, 1e9], straight=straight)  # one worker per machine: no inner level
        assert nested.time_per_minibatch_s == pytest.approx(flat.time_per_minibatch_s, rel=1e-12)
    assert partition(p, [2, 2], [1e11, 1e9]).world_size == 4
