"""Ranks of hierarchical plans follow the machine hierarchy (:func:`partitioner.plan.aligned_ranks`)."""

from __future__ import annotations

import math
import random

import pytest

from helpers_profiles import random_profile
from partitioner import PlanError, partition
from partitioner.plan import aligned_ranks

pytestmark = pytest.mark.timeout(120)


def test_replicated_outer_stage_keeps_inner_stages_on_their_own_workers():
    # 2 nodes of 4 workers; one outer stage on both nodes, each node running stages of 3 and 1 workers
    ranks = aligned_ranks([4, 2], [(2, [(3, None), (1, None)])])
    assert ranks == [(0, 1, 2, 4, 5, 6), (3, 7)]  # contiguous blocks would give (0..5) and (6, 7)


def test_three_levels():
    plan = [(1, [(2, [(8, None)]), (14, [(4, None), (4, None)])]), (7, [(16, [(8, None)])])]
    ranks = aligned_ranks([8, 16, 8], plan)
    assert ranks[0] == tuple(range(16))
    assert ranks[1] == tuple(r for node in range(2, 16) for r in range(8 * node, 8 * node + 4))
    assert ranks[2] == tuple(r for node in range(2, 16) for r in range(8 * node + 4, 8 * node + 8))
    assert ranks[3] == tuple(range(128, 1024))


def test_flat_plan_is_contiguous():
    assert aligned_ranks([5], [(2, None), (1, None), (2, None)]) == [(0, 1), (2,), (3, 4)]


@pytest.mark.parametrize("plan,match", [
    ([(2, [(3, None)])], "level 1: stages use 3 machines, but the level has 4"),
    ([(1, [(4, None)])], "level 2: stages use 1 machines, but the level has 2"),
    ([(2, None)], "needs the plan its machines run"),
    ([(2, [(4, [(1, None)])])], "innermost stage cannot have an inner plan"),
    ([(0, [(4, None)]), (2, [(4, None)])], "replicas must be a whole number"),
])
def test_bad_trees(plan, match):
    with pytest.raises(PlanError, match=match):
        aligned_ranks([4, 2], plan)


def _machine_counts(ranks, size):
    per = {}
    for r in ranks:
        per[r // size] = per.get(r // size, 0) + 1
    return per


@pytest.mark.parametrize("seed", range(16))
def test_partition_aligns_stages_to_nodes(seed):
    rng = random.Random(500 + seed)
    profile = random_profile(rng, rng.randint(3, 8), dag=seed % 2 == 1)
    workers = [rng.randint(2, 4), rng.randint(2, 3)] + ([2] if seed % 4 == 0 else [])
    bandwidth = sorted((rng.choice([1e8, 1e9, 1e10, 1e11]) for _ in workers), reverse=True)
    plan = partition(profile, workers, bandwidth)
    n1 = workers[0]
    nodes_used = 0
    for s in plan.stages:
        per = _machine_counts(s.ranks, n1)
        counts = set(per.values())
        assert len(counts) == 1, (s.index, s.ranks)  # the same share of every node it uses
        share = counts.pop()
        assert share * len(per) == s.replicas
        for node in per:  # that share is one block of consecutive ranks: the stage straddles nothing
            mine = sorted(r for r in s.ranks if r // n1 == node)
            assert mine == list(range(mine[0], mine[0] + share))
        nodes_used += len(per)
    # a node runs one inner plan: its ranks belong to stages that form one contiguous run of the pipeline
    total_nodes = math.prod(workers) // n1
    for node in range(total_nodes):
        stages = sorted({plan.stage_of_rank(r).index for r in range(node * n1, (node + 1) * n1)})
        assert stages == list(range(stages[0], stages[-1] + 1))
    assert plan.world_size == math.prod(workers)
