"""The scalable exact search for chain-like profiles (:mod:`partitioner.chain`).

Its states equal :func:`~partitioner.antichain.linearize`'s; its optimum equals the general dynamic program's
(which reproduces PipeDream's, see ``test_pipedream_reference.py``) on random chains with skip connections and
random 1-3 level machines, and exhaustive search on tiny flat ones; whenever it cannot decide (a stage
replicated across machines might win) ``partition`` falls back to the general path.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from partitioner import PlanError, partition
from partitioner.antichain import linearize
from helpers_profiles import random_profile
from partitioner.chain import chain_states, comparable_chain, flat_upper_plan, plan_chain, solve_chain
from partitioner.contract import contract
from partitioner.optimizer import exhaustive_level, flat_problem, solve_level
from profiler.profile import Layer, ModelInput, Profile

pytestmark = pytest.mark.timeout(300)


def skip_chain(rng: random.Random, n: int, *, skip: int = 2, with_input: bool = True, sink: bool = False,
               model_input: bool = False) -> Profile:
    """``n`` blocks in a chain, block ``i`` also feeding ``i + skip`` (most of the time)."""
    layers = []
    if with_input:
        layers.append(Layer("in", "Input", 0.0, 0.0, float(rng.randrange(1, 10**6)), 0.0))
    off = len(layers)
    for i in range(n):
        f = rng.uniform(0.1, 5.0)
        layers.append(Layer(f"b{i}", "Block", f, rng.uniform(0.0, 2.0) * f,
                            float(rng.choice([0, rng.randrange(1, 10**7)])),
                            float(rng.choice([0, rng.randrange(1, 10**8)]))))
    edges = {(off + i, off + i + 1) for i in range(n - 1)}
    edges |= {(off + i, off + i + skip) for i in range(n - skip) if rng.random() < 0.7}
    if with_input:
        edges |= {(0, off), (0, off + min(2, n - 1))}
    if sink:
        layers.append(Layer("out", "__getitem__(0)", 0.0, 0.0, 4.0, 0.0))
        edges.add((len(layers) - 2, len(layers) - 1))
    inputs = (ModelInput("x", 4096, (off, off + n - 1)),) if model_input else ()
    return Profile(tuple(layers), tuple(sorted(edges)), inputs=inputs)


def _case(seed: int):
    rng = random.Random(9000 + seed)
    prof = skip_chain(rng, rng.randint(2, 13), skip=rng.choice([2, 3]), with_input=rng.random() < 0.6,
                      sink=rng.random() < 0.3, model_input=rng.random() < 0.3)
    levels = rng.choice([1, 2, 2, 3])
    workers = [rng.randint(1, 4) for _ in range(levels)]
    bandwidth = sorted((rng.choice([1e8, 1e9, 1e10, 1e11]) for _ in range(levels)), reverse=True)
    return prof, workers, bandwidth, rng.random() < 0.2


@pytest.mark.parametrize("seed", range(40))
def test_chain_states_equal_linearize(seed):
    prof, _, _, _ = _case(seed)
    states = linearize(prof)
    cs = chain_states(prof)
    assert cs is not None and cs.num_states == states.num_states
    assert np.array_equal(cs.compute[1:], states.compute_s)  # bit for bit: same sums in the same order
    assert np.array_equal(cs.params[1:], states.parameter_bytes)
    assert np.array_equal(cs.cut_bytes[1:-1], states.output_bytes[:-1])
    assert [tuple(cs.live[: q + 1]) for q in range(cs.num_states)] == [tuple(d) for d in states.downsets]
    cuts = sorted(random.Random(seed).sample(range(cs.num_states - 1), min(2, cs.num_states - 1))) \
        + [cs.num_states - 1]
    assert cs.stage_layers([0] + [c + 1 for c in cuts], prof) == states.stage_layers(cuts, prof)


def test_not_a_chain():
    layers = tuple(Layer(str(i), "Conv", 1.0, 1.0, 1.0, 1.0) for i in range(4))
    assert chain_states(Profile(layers, ((0, 1), (0, 2), (1, 3), (2, 3)))) is None  # a diamond
    assert chain_states(Profile(layers, ((0, 1), (1, 2), (2, 3)))) is not None


def test_equals_the_general_program():
    decided = 0
    for seed in range(150):
        prof, workers, bandwidth, straight = _case(seed)
        cs = chain_states(prof)
        try:
            want = partition(prof, workers, bandwidth, straight=straight).time_per_minibatch_s
        except PlanError:
            want = None
        try:
            sol = solve_chain(cs, workers, bandwidth, straight=straight)
        except ValueError:
            assert want is None, (seed, workers, bandwidth, straight)
            continue
        if sol is None:  # undecided: only where a stage on several machines is possible
            assert len(workers) >= 2 and not straight
            continue
        decided += 1
        assert want is not None and sol.time_s == pytest.approx(want, rel=1e-12), (seed, workers, bandwidth)
        assert sum(sol.replicas) == math.prod(workers) and sol.bounds[0] == 0 and sol.bounds[-1] == cs.num_states
        assert all(a < b for a, b in zip(sol.bounds, sol.bounds[1:]))
        assert max(sol.stage_times) <= sol.time_s
    assert decided >= 100


@pytest.mark.parametrize("seed", range(30))
def test_flat_equals_exhaustive(seed):
    rng = random.Random(11000 + seed)
    prof = skip_chain(rng, rng.randint(2, 6), with_input=seed % 2 == 0)
    M = rng.randint(1, 4)
    bw = rng.choice([1e8, 1e9, 1e10])
    want = exhaustive_level(flat_problem(linearize(prof), M, bw, False, None))
    sol = solve_chain(chain_states(prof), [M], [bw])
    assert sol.time_s == pytest.approx(want, rel=1e-12)


def test_plan_chain_matches_partition_and_is_aligned():
    checked = 0
    for seed in range(16):
        prof, workers, bandwidth, straight = _case(100 + seed)
        try:
            want = partition(prof, workers, bandwidth, straight=straight)
        except PlanError:
            continue
        plan = plan_chain(prof, contract(prof), workers, bandwidth, straight, min_states=0)
        if plan is None:
            continue
        checked += 1
        assert plan.time_per_minibatch_s == pytest.approx(want.time_per_minibatch_s, rel=1e-12)
        assert max(s.time_s for s in plan.stages) == pytest.approx(plan.time_per_minibatch_s, rel=1e-12)
        assert plan.world_size == math.prod(workers)
        assert plan.settings["stages_per_level"][-1] == (workers[-1] if len(workers) > 1 else plan.num_stages)
        for a, b in prof.edges:
            assert plan.layer_to_stage[a] <= plan.layer_to_stage[b]
        for s in plan.stages:  # one machine per stage, consecutive ranks
            assert s.ranks == tuple(range(s.ranks[0], s.ranks[0] + s.replicas))
            assert s.ranks[0] // workers[0] == s.ranks[-1] // workers[0]
    assert checked >= 8


def test_long_chain_is_planned_by_the_scalable_search():
    rng = random.Random(3)
    prof = skip_chain(rng, 1500, with_input=True)
    plan = partition(prof, [4, 4, 2], [1e11, 1e10, 1e9])
    sol = solve_chain(chain_states(contract(prof).profile), [4, 4, 2], [1e11, 1e10, 1e9])
    assert sol is not None and plan.time_per_minibatch_s == sol.time_s
    assert plan.world_size == 32 and plan.num_stages == len(sol.replicas)
    assert plan.time_per_minibatch_s >= chain_states(prof).compute[-1] / 32
    for a, b in prof.edges:
        assert plan.layer_to_stage[a] <= plan.layer_to_stage[b]


def test_straight_too_long_fails():
    rng = random.Random(4)
    prof = skip_chain(rng, 1100)
    with pytest.raises(PlanError, match="straight"):
        partition(prof, [8, 16, 9], [1e11, 1e10, 1e9], straight=True)


def test_comparable_chain_keeps_only_cuts_between_blocks():
    # 0 -> {1, 2} -> 3 -> 4: the states inside the diamond are not comparable with each other
    layers = tuple(Layer(str(i), "Conv", 1.0 + i, 1.0, 10.0, 100.0) for i in range(5))
    prof = Profile(layers, ((0, 1), (0, 2), (1, 3), (2, 3), (3, 4)))
    states = linearize(prof)
    cs, index = comparable_chain(states)
    for k in index:
        assert all(states.precedes[k, j] or states.precedes[j, k] for j in range(states.num_states) if j != k)
    assert len(index) < states.num_states and index[-1] == states.num_states - 1
    assert np.array_equal(cs.compute[1:], states.compute_s[index])


@pytest.mark.parametrize("seed", range(20))
def test_search_from_any_upper_plan_is_exact(seed):
    rng = random.Random(12000 + seed)
    prof = random_profile(rng, rng.randint(2, 6), dag=True)
    M = rng.randint(1, 4)
    states = linearize(prof)
    prob = flat_problem(states, M, 1e9, False, None)
    want = exhaustive_level(prob)
    upper = flat_upper_plan(states, M, 1e9, False)
    assert upper is None  # small profiles: the general search alone
    found = comparable_chain(states)
    if found is not None:
        cs, index = found
        sol = solve_chain(cs, [M], [1e9])
        upper = ([int(index[q - 1]) for q in sol.bounds[1:]], sol.replicas)
        assert solve_level(prob, 0.0, upper).time_s == pytest.approx(want, rel=1e-12)
    # a poor upper plan (one stage on every worker) leads to the same optimum
    assert solve_level(prob, 0.0, ([states.num_states - 1], [M])).time_s == pytest.approx(want, rel=1e-12)


def _blocks_with_branches(rng: random.Random, blocks: int) -> Profile:
    """ResNet-like: blocks of 3 layers with a residual edge, every 4th block with a 1-layer side branch."""
    layers = [Layer("in", "Input", 0.0, 0.0, 1e6, 0.0)]
    edges = []
    prev = 0
    for b in range(blocks):
        start = len(layers)
        for i in range(3):
            f = rng.uniform(0.1, 3.0)
            layers.append(Layer(f"b{b}.{i}", "Conv2d", f, 2 * f, float(rng.randrange(1, 10**7)),
                                float(rng.randrange(0, 10**7))))
            edges.append((len(layers) - 2 if i else prev, len(layers) - 1))
        if b % 4 == 0:
            layers.append(Layer(f"b{b}.side", "Conv2d", 0.5, 1.0, 1e6, 1e5))
            edges.append((prev, len(layers) - 1))
        layers.append(Layer(f"b{b}.add", "Add", 0.01, 0.01, float(rng.randrange(1, 10**7)), 0.0))
        edges += [(start + 2, len(layers) - 1), (prev if b % 4 else len(layers) - 2, len(layers) - 1)]
        prev = len(layers) - 1
    return Profile(tuple(layers), tuple(sorted(set(edges))))


@pytest.mark.parametrize("workers,bandwidth", [(8, 1e9), (32, 1e10), (13, 1e8)])
def test_upper_plan_on_a_large_dag_keeps_the_optimum(workers, bandwidth, monkeypatch):
    from partitioner import chain

    prof = _blocks_with_branches(random.Random(workers), 80)
    states = linearize(prof)
    assert states.num_states >= chain.CHAIN_MIN_STATES and chain_states(prof) is None  # a DAG, not a chain
    assert flat_upper_plan(states, workers, bandwidth, False) is not None
    fast = partition(prof, workers, bandwidth)
    monkeypatch.setattr(chain, "SCALABLE", False)
    general = partition(prof, workers, bandwidth)
    assert fast.time_per_minibatch_s == general.time_per_minibatch_s
