"""Layers kept on one stage: keep-together groups and parameter reads are merged into one layer of the search."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from helpers_profiles import random_profile
from partitioner import cost, partition
from partitioner.chain import plan_chain
from partitioner.contract import contract
from partitioner.together import merge_groups, parameter_reads, together_groups
from profiler.measure import profile_model
from profiler.profile import KeepTogether, Layer, ModelInput, Profile, TiedGroup

pytestmark = pytest.mark.timeout(300)


def _t(name: str, ms: float = 1.0, act: float = 100.0, par: float = 10.0, desc: str = "Linear") -> Layer:
    return Layer(name, desc, ms, 2 * ms, act, par)


def _chain(times: list[float], keep: tuple[KeepTogether, ...] = ()) -> Profile:
    layers = tuple(_t(f"l{i}", ms) for i, ms in enumerate(times))
    return Profile(layers, tuple((i, i + 1) for i in range(len(times) - 1)), keep_together=keep)


# -- the general path ---------------------------------------------------------------------------------------


def test_a_group_is_never_cut_even_when_a_cut_inside_is_faster() -> None:
    # 7 layers like a decoder: embed, 4 blocks, norm, head (heavy); unconstrained, the head gets a stage alone
    times = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 10.0]
    free = partition(_chain(times), 4, 1e9, straight=True)
    assert free.layer_to_stage[5] != free.layer_to_stage[6]
    kept = partition(_chain(times, (KeepTogether("norm + head", (5, 6)),)), 4, 1e9, straight=True)
    assert kept.layer_to_stage[5] == kept.layer_to_stage[6] == 3
    assert kept.time_per_minibatch_s == pytest.approx(3 * 11.0 / 1000)  # norm + head: 11 ms forward + backward
    assert kept.profile_hash == free.profile_hash


def test_groups_close_over_paths_and_unite_when_they_share_a_layer() -> None:
    # 0 -> 1 -> 3 and 0 -> 2 -> 3 (a diamond), then 3 -> 4 -> 5
    layers = tuple(_t(str(i)) for i in range(6))
    edges = ((0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (4, 5))
    p = Profile(layers, edges, keep_together=(KeepTogether("a", (0, 3)), KeepTogether("b", (3, 4))))
    assert together_groups(p) == [(0, 1, 2, 3, 4)]
    plan = partition(p, 2, 1e9, straight=True)
    assert [list(s.layers) for s in plan.stages] == [[0, 1, 2, 3, 4], [5]]


def test_merged_layer_sums_and_counts_only_what_leaves() -> None:
    layers = (_t("a", act=1.0), _t("b", act=2.0, par=5.0), _t("c", act=4.0), _t("d", act=8.0))
    edges = ((0, 1), (1, 2), (1, 3), (2, 3))
    tied = (TiedGroup("w", 7.0, (0, 2)), TiedGroup("v", 3.0, (1, 2)))
    p = Profile(layers, edges, {}, tied, (ModelInput("x", 16.0, (0, 2)),))
    merged, members = merge_groups(p, [(1, 2)])
    assert members == ((0,), (1, 2), (3,))
    b = merged.layers[1]
    assert (b.name, b.forward_ms, b.backward_ms, b.parameter_bytes) == ("b", 2.0, 4.0, 15.0)
    assert b.activation_bytes == 2.0 + 4.0  # both b and c are read by d
    assert merged.edges == ((0, 1), (1, 2))
    assert merged.tied == (TiedGroup("w", 7.0, (0, 1)),)  # v lies inside the merged layer: nothing splits it
    assert merged.inputs == (ModelInput("x", 16.0, (0, 1)),)
    with pytest.raises(ValueError, match=r"closed under paths, got \[0, 2\]"):
        merge_groups(p, [(0, 2)])
    with pytest.raises(ValueError, match="layer 1 .* is in two"):
        merge_groups(p, [(0, 1), (1, 2)])


def _exhaustive_chain(p: Profile, M: int, bw: float, straight: bool, groups: list[tuple[int, int]]) -> float:
    """Every split of a chain (no cut inside a group: the range ``(a, b]`` of layers ``a..b``) and replica split."""
    n = len(p.layers)
    comp = [(l.forward_ms + l.backward_ms) / 1000.0 for l in p.layers]
    par = [l.parameter_bytes for l in p.layers]
    act = [l.activation_bytes for l in p.layers]
    allowed = [c for c in range(1, n) if not any(a < c <= b for a, b in groups)]
    best = None
    for k in range(1, M + 1):
        if straight and k != M:
            continue
        for cuts in itertools.combinations(allowed, k - 1):
            bounds = [0, *cuts, n]
            for reps in ([(1,) * k] if straight else
                         [c for c in itertools.product(range(1, M + 1), repeat=k) if sum(c) == M]):
                worst = 0.0
                for s, r in enumerate(reps):
                    a, b = bounds[s], bounds[s + 1]
                    C, P = sum(comp[a:b]), sum(par[a:b])
                    t = cost.first_stage_time(C, P, r, bw) if s == 0 else \
                        cost.stage_time(C, P, r, bw, act[a - 1], act[b - 1] if b < n else 0.0)
                    worst = max(worst, float(t))
                best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_random_chains_with_groups_match_brute_force(seed: int) -> None:
    rng = random.Random(9100 + seed)
    base = random_profile(rng, rng.randint(4, 7), dag=False)
    n = len(base.layers)
    a = rng.randrange(0, n - 1)
    b = rng.randrange(a + 1, min(n, a + 3))
    p = Profile(base.layers, base.edges, keep_together=(KeepTogether("g", tuple(range(a, b + 1))),))
    M = rng.randint(1, 4)
    straight = rng.random() < 0.4
    bw = rng.choice([1e8, 1e9, 1e10])
    if straight and M > n - (b - a):
        with pytest.raises(Exception, match="straight"):
            partition(p, M, bw, straight=True)
        return
    plan = partition(p, M, bw, straight=straight)
    assert len({plan.layer_to_stage[i] for i in range(a, b + 1)}) == 1
    assert plan.time_per_minibatch_s == pytest.approx(_exhaustive_chain(p, M, bw, straight, [(a, b)]), rel=1e-9)


# -- the chain path ------------------------------------------------------------------------------------------


def test_the_chain_path_keeps_groups_too() -> None:
    times = [1.0] * 299 + [150.0]  # the head alone is the slowest stage
    free = plan_chain(_chain(times), contract(_chain(times)), [8], [1e9], True, min_states=0)
    assert free is not None and free.layer_to_stage[298] != free.layer_to_stage[299]
    p = _chain(times, (KeepTogether("norm + head", (298, 299)),))
    kept = plan_chain(p, contract(p), [8], [1e9], True, min_states=0)
    assert kept is not None and kept.layer_to_stage[298] == kept.layer_to_stage[299] == 7
    assert partition(p, 8, 1e9, straight=True) == kept  # 300 layers: partition takes the chain path itself


# -- parameter reads -----------------------------------------------------------------------------------------


class _HandWritten(nn.Module):
    """A Llama-like model written by hand: its final norm's weight is read in forward (``self.norm_weight * x``),
    which fx hoists into a get_attr layer with no predecessors."""

    def __init__(self, d: int = 32, blocks: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.norm_weight = nn.Parameter(torch.ones(d))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.head(self.norm_weight * h)


def test_a_hoisted_parameter_lands_with_its_consumer() -> None:
    torch.manual_seed(0)
    profile = profile_model(_HandWritten(), torch.randn(4, 32), warmup=0, repeats=1)
    names = [l.name for l in profile.layers]
    read = names.index("norm_weight")
    (consumer,) = profile.successors()[read]
    assert parameter_reads(profile) == [(read, consumer)]
    plan = partition(profile, 4, 1e9, straight=True)
    stage = plan.layer_to_stage
    assert stage[read] == stage[consumer] != 0  # before: the read sat on stage 0, its tensor sent every minibatch
    # nothing crosses a cut as the parameter: every cut's bytes are those of the layers it really carries
    assert all(stage[a] == stage[b] for a, b in profile.edges if a == read)


def test_a_parameter_read_by_several_layers_joins_the_first() -> None:
    # w (get_attr) feeds b and d on a chain a -> b -> c -> d
    layers = (_t("a"), _t("w", 0.0, act=50.0, par=50.0, desc="get_attr w"), _t("b"), _t("c"), _t("d"))
    edges = ((0, 2), (1, 2), (1, 4), (2, 3), (3, 4))
    p = Profile(layers, edges, {}, (), (ModelInput("x", 8.0, (0,)),))
    assert parameter_reads(p) == [(1, 2)]
    plan = partition(p, 4, 1e9, straight=True)
    assert plan.layer_to_stage[1] == plan.layer_to_stage[2]
    assert plan.layer_to_stage[1] != 0


def test_a_get_attr_reading_an_input_or_with_a_predecessor_is_left_alone() -> None:
    layers = (_t("a"), _t("w", desc="get_attr w"), _t("b"))
    assert parameter_reads(Profile(layers, ((0, 1), (1, 2)))) == []
    assert parameter_reads(Profile(layers, ((1, 2), (0, 2)), {}, (), (ModelInput("x", 1.0, (1,)),))) == []
