from __future__ import annotations

import random

import numpy as np
import pytest

from helpers_profiles import PROFILES_DIR, random_profile
from partitioner.antichain import linearize
from profiler import load_profile
from profiler.profile import Layer, Profile

pytestmark = pytest.mark.timeout(60)


def _chain(n: int) -> Profile:
    layers = tuple(Layer(str(i), "L", 1.0 + i, 2.0, 10.0 * (i + 1), 5.0) for i in range(n))
    return Profile(layers, tuple((i, i + 1) for i in range(n - 1)))


def test_chain_states_are_prefixes():
    st = linearize(_chain(5))
    assert st.num_states == 5
    assert st.downsets == tuple(tuple(range(i + 1)) for i in range(5))
    assert np.allclose(st.compute_s, np.cumsum([(1.0 + i + 2.0) / 1000 for i in range(5)]))
    assert np.allclose(st.output_bytes, [10.0 * (i + 1) for i in range(5)])
    assert st.precedes.sum() == 10 and all(st.precedes[k, j] for k in range(5) for j in range(k + 1, 5))


def test_skip_connection_is_carried_across_the_cut():
    # 0 -> 1 -> 2 -> 3 and 0 -> 3: a cut after 1 or 2 also ships layer 0's output
    layers = tuple(Layer(str(i), "L", 1.0, 1.0, float(10 ** i), 0.0) for i in range(4))
    st = linearize(Profile(layers, ((0, 1), (0, 3), (1, 2), (2, 3))))
    by_down = {d: o for d, o in zip(st.downsets, st.output_bytes)}
    assert by_down[(0,)] == 1
    assert by_down[(0, 1)] == 10 + 1
    assert by_down[(0, 1, 2)] == 100 + 1
    assert by_down[(0, 1, 2, 3)] == 1000


def test_inputs_and_getitem_sinks_are_taken_out_but_placed():
    layers = (Layer("in", "Input", 5.0, 0.0, 8.0, 0.0), Layer("a", "Conv", 1.0, 1.0, 4.0, 2.0),
              Layer("b", "Linear", 1.0, 1.0, 4.0, 2.0), Layer("g", "__getitem__(0)", 0.0, 0.0, 1.0, 0.0))
    p = Profile(layers, ((0, 1), (1, 2), (2, 3)))
    st = linearize(p)
    assert st.removed_inputs == (0,) and st.removed_sinks == (3,)
    assert st.downsets == ((1,), (1, 2))
    assert st.compute_s[-1] == pytest.approx(0.004)  # the Input's 5 ms is not counted
    assert st.stage_layers([0, 1], p) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("seed", range(30))
def test_random_dag_states_are_downsets(seed):
    rng = random.Random(seed)
    p = random_profile(rng, rng.randint(2, 7), dag=True)
    st = linearize(p)
    preds = p.predecessors()
    assert set(st.downsets[-1]) == set(range(len(p)))
    for d in st.downsets:
        ds = set(d)
        assert all(set(preds[v]) <= ds for v in ds)  # closed under predecessors
    for k in range(st.num_states):
        for j in range(st.num_states):
            assert st.precedes[k, j] == (set(st.downsets[k]) < set(st.downsets[j]))
    # states are ordered so predecessors come first
    assert not np.any(np.tril(st.precedes))


def test_pipedream_profiles_state_counts():
    assert linearize(load_profile(PROFILES_DIR / "vgg16.graph.txt")).num_states == 40
    assert linearize(load_profile(PROFILES_DIR / "resnet18.graph.txt")).num_states == 100


def test_inputs_read_late_cross_the_cuts_before_their_readers():
    from profiler.profile import ModelInput

    layers = tuple(Layer(str(i), "L", 1.0, 1.0, 10.0, 0.0) for i in range(3))
    p = Profile(layers, ((0, 1), (1, 2)), {}, (), (ModelInput("x", 7.0, (0, 2)), ModelInput("y", 5.0, (0,))))
    st = linearize(p)
    assert st.downsets == ((0,), (0, 1), (0, 1, 2))
    assert list(st.output_bytes) == [10.0 + 7.0, 10.0 + 7.0, 10.0]  # x until layer 2 has it; y never crosses
    assert st.crossing == ((0,), (1,), (2,))


def test_tied_counts_per_state():
    from profiler.profile import TiedGroup

    p = Profile(_chain(4).layers, _chain(4).edges, {}, (TiedGroup("w", 8.0, (1, 3)),))
    st = linearize(p)
    assert st.tied_bytes.tolist() == [8.0] and st.tied_sizes.tolist() == [2]
    assert st.tied_counts.tolist() == [[0, 1, 1, 2]]
    assert st.tied_first.tolist() == [[False, True, True, True]]


def test_crossing_holds_every_layer_read_after_the_cut():
    for seed in range(30):
        rng = random.Random(400 + seed)
        p = random_profile(rng, rng.randint(2, 8), dag=True)
        st = linearize(p)
        succ = p.successors()
        for down, cross in zip(st.downsets, st.crossing):
            real = {i for i in down if any(c not in down for c in succ[i])}
            assert real <= set(cross) <= set(down)


def test_longest_chain():
    assert linearize(_chain(5)).longest_chain() == 5
    # a diamond: {0}, {0,1} or {0,2}, {0,1,2}, {0,1,2,3}
    layers = tuple(Layer(str(i), "L", 1.0, 1.0, 1.0, 0.0) for i in range(4))
    assert linearize(Profile(layers, ((0, 1), (0, 2), (1, 3), (2, 3)))).longest_chain() == 4
