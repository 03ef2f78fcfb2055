import itertools
import math

import pytest

from pipedream_ft.schedules import Action, ScheduleError, parse_action, render
from pipedream_ft.schedules.replicated import async_1f1b as one_f_one_b, flushing, in_flight, replica_minibatches
from schedule_helpers import grid as unit_grid, run_replicated

pytestmark = pytest.mark.timeout(60)


def grid(replicas, n, window=None):
    def sched(s, r):
        return flushing(s, r, replicas, 0, n, window) if window else one_f_one_b(s, r, replicas, 0, n)
    return unit_grid(run_replicated([[sched(s, r) for r in range(replicas[s])] for s in range(len(replicas))],
                                    replicas))


def test_straight_1f1b_table():
    # 4 stages, 8 minibatches: warm-up of S - s forwards, then one backward (and its update), one forward.
    # every action names its stage: the same spelling as pipedream_ft.schedules (``3F0``)
    assert [str(a) for a in one_f_one_b(0, 0, [1, 1, 1, 1], 0, 8)] == (
        "0F0 0F1 0F2 0F3 0B0 0U0 0F4 0B1 0U1 0F5 0B2 0U2 0F6 0B3 0U3 0F7 0B4 0U4 0B5 0U5 0B6 0U6 0B7 0U7".split())
    assert [str(a) for a in one_f_one_b(3, 0, [1, 1, 1, 1], 0, 4)] == (
        "3F0 3B0 3U0 3F1 3B1 3U1 3F2 3B2 3U2 3F3 3B3 3U3".split())
    assert [parse_action(str(a)) for a in one_f_one_b(2, 0, [1, 1, 1, 1], 0, 4)] == one_f_one_b(2, 0, [1] * 4, 0, 4)
    timeline = run_replicated([[one_f_one_b(s, 0, [1] * 4, 0, 8)] for s in range(4)], [1] * 4)
    assert render(timeline).splitlines()[3] == (
        "rank 3: .   .   .   3F0 3B0 3U0 3F1 3B1 3U1 3F2 3B2 3U2 3F3 3B3 3U3 3F4 3B4 3U4 3F5 3B5 3U5 3F6 3B6 3U6 "
        "3F7 3B7 3U7 .   .   .")


def test_no_flush_in_steady_state():
    # between the first and the last backward of stage 0 the pipeline never drains: stage 3 is busy every tick
    g = grid([1, 1, 1, 1], 16)
    busy = [row[3] for row in g]
    first, last = busy.index(Action(3, "F", 0)), max(i for i, a in enumerate(busy) if a is not None)
    assert all(a is not None for a in busy[first:last + 1])


def test_in_flight_counts():
    assert [in_flight(s, [1, 1, 1, 1]) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(s, [2, 1, 1]) for s in range(3)] == [2, 2, 1]
    assert [in_flight(s, [1, 3]) for s in range(2)] == [4, 1]


def test_round_robin():
    assert replica_minibatches(1, 3, 0, 10) == [1, 4, 7]
    assert replica_minibatches(0, 2, 4, 10) == [4, 6, 8]
    with pytest.raises(ValueError, match="replica must be in"):
        replica_minibatches(3, 3, 0, 10)


@pytest.mark.parametrize("replicas", [list(r) for n in range(1, 5) for r in itertools.product([1, 2, 3], repeat=n)])
def test_every_schedule_completes(replicas):
    lcm = math.lcm(*replicas)
    for n in (lcm, 3 * lcm):
        g = grid(replicas, n)
        for rank_col in zip(*g):
            done = [a for a in rank_col if a is not None]
            fwd = [a.index for a in done if a.kind == "F"]
            bwd = [a.index for a in done if a.kind == "B"]
            assert sorted(fwd) == sorted(bwd)
            for b in bwd:  # every forward before its backward
                s = done[0].stage
                assert done.index(Action(s, "F", b)) < done.index(Action(s, "B", b))
        g = grid(replicas, 2 * lcm, window=lcm)
        assert g


def test_flushing_window_and_updates():
    acts = flushing(1, 0, [1, 1], 0, 8, 4)
    assert [str(a) for a in acts] == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1U0 1F4 1B4 1F5 1B5 1F6 1B6 1F7 1B7 1U1".split()
    with pytest.raises(ValueError, match="whole windows"):
        flushing(0, 0, [1], 0, 6, 4)
    with pytest.raises(ValueError, match="multiple of every stage's replica count"):
        flushing(0, 0, [2, 3], 0, 12, 4)


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError, match="multiple of 2"):
        one_f_one_b(0, 0, [2, 1], 0, 5)
    with pytest.raises(ValueError, match="replicas must be positive"):
        one_f_one_b(0, 0, [0], 0, 4)


def test_deadlock_is_reported():
    bad = [[[Action(0, "B", 0), Action(0, "F", 0)]]]
    with pytest.raises(ScheduleError, match="deadlock"):
        run_replicated(bad, [1])
