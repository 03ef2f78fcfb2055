import itertools

import pytest

from pipedream_ft.schedules import replicated as runtime
from pipedream_ft.schedules import (SCHEDULES, Action, Kind, add_updates, build, dualpipev, gpipe, interleaved_1f1b,
                                    interleaved_zero_bubble, loop_placement, looped_bfs, one_f_one_b, pipedream,
                                    simulate, stage_to_rank, v_placement, zb_h1, zbv)

pytestmark = pytest.mark.timeout(60)


def table(schedule):
    return {r: " ".join(map(str, acts)) for r, acts in schedule.items()}


def test_gpipe_table():
    assert table(gpipe(3, 3)) == {
        0: "0F0 0F1 0F2 0B0 0B1 0B2",
        1: "1F0 1F1 1F2 1B0 1B1 1B2",
        2: "2F0 2F1 2F2 2B0 2B1 2B2",
    }


def test_one_f_one_b_table():
    # rank r warms up with R - 1 - r forwards, then one forward and one backward, then the remaining backwards
    assert table(one_f_one_b(4, 6)) == {
        0: "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5",
        1: "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5",
        2: "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5",
        3: "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5",
    }
    assert table(one_f_one_b(3, 1)) == {0: "0F0 0B0", 1: "1F0 1B0", 2: "2F0 2B0"}


def test_zb_h1_table():
    # the same forwards and I as 1F1B; rank r holds back its first r weight gradients for the cool-down
    assert table(zb_h1(3, 4)) == {
        0: "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        1: "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        2: "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    }


def test_pipedream_table():
    assert table(pipedream(3, 4)) == {
        0: "0F0 0F1 0F2 0B0 0U0 0F3 0B1 0U1 0B2 0U2 0B3 0U3",
        1: "1F0 1F1 1B0 1U0 1F2 1B1 1U1 1F3 1B2 1U2 1B3 1U3",
        2: "2F0 2B0 2U0 2F1 2B1 2U1 2F2 2B2 2U2 2F3 2B3 2U3",
    }


def test_interleaved_table():
    # 2 ranks x 2 stages (stage s on rank s % 2), microbatches in rounds of 2 through a rank's stages
    assert table(interleaved_1f1b(2, 2, 4)) == {
        0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    }
    # zero bubble: warm-up one forward shorter per hop; rank r defers r weight gradients
    assert table(interleaved_zero_bubble(2, 2, 4)) == {
        0: "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3",
        1: "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3",
    }


def test_looped_bfs_table():
    assert table(looped_bfs(2, 2, 3)) == {
        0: "0F0 0F1 0F2 2F0 2F1 2F2 2B2 2B1 2B0 0B2 0B1 0B0",
        1: "1F0 1F1 1F2 3F0 3F1 3F2 3B2 3B1 3B0 1B2 1B1 1B0",
    }


def test_v_tables():
    # rank r holds stages r and 2R - 1 - r
    assert table(zbv(2, 3)) == {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2",
        1: "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2",
    }
    assert table(dualpipev(2, 4)) == {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        1: "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    }


def test_placements():
    assert loop_placement(2, 3) == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}
    assert v_placement(3) == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}
    assert stage_to_rank(interleaved_1f1b(3, 2, 6)) == loop_placement(3, 2)
    assert stage_to_rank(zbv(3, 6)) == v_placement(3)


def test_argument_checks():
    with pytest.raises(ValueError, match="microbatches must be a positive integer, got 0"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="ranks must be a positive integer, got -1"):
        one_f_one_b(-1, 4)
    with pytest.raises(ValueError, match="stages_per_rank must be a positive integer, got 0"):
        interleaved_1f1b(2, 0, 4)
    with pytest.raises(ValueError, match=r"multiple of the rounds max\(1, microbatches // ranks\) = 2, "
                                         r"got microbatches=9 ranks=4"):
        interleaved_1f1b(4, 2, 9)
    with pytest.raises(ValueError, match=r"at least as many microbatches as stages \(2 \* ranks = 8\), "
                                         r"got microbatches=7 ranks=4"):
        dualpipev(4, 7)
    with pytest.raises(ValueError, match="ranks must be a positive integer, got True"):
        zbv(True, 4)


def test_catalog():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "zb_h1", "pipedream", "interleaved_1f1b", "interleaved_zero_bubble",
                              "looped_bfs", "zbv", "dualpipev"}
    built = build("interleaved_1f1b", 2, 4, stages_per_rank=3)
    assert built.schedule == interleaved_1f1b(2, 3, 4) and built.placement == loop_placement(2, 3)
    assert build("zbv", 3, 6).placement == v_placement(3)
    with pytest.raises(ValueError, match="unknown schedule 'zb2p': expected one of gpipe, 1f1b"):
        build("zb2p", 2, 4)
    with pytest.raises(ValueError, match="schedule 'zbv' runs 2 stage\\(s\\) per rank, got stages_per_rank=3"):
        build("zbv", 2, 4, stages_per_rank=3)


LOOPED = ("interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs")


def check_complete(name, ranks, n, v):
    try:
        sched, placement = build(name, ranks, n, stages_per_rank=v if name in LOOPED else None)
    except ValueError as e:
        assert "microbatches" in str(e)  # the schedule's own requirement on the count
        return
    stages = len(placement)
    for rank, acts in sched.items():
        assert all(placement[a.stage] == rank for a in acts)
    done = [a for acts in sched.values() for a in acts]
    split = {(a.stage, a.index) for a in done if a.kind == Kind.I}
    expected = {Action(s, Kind.F, m) for s in range(stages) for m in range(n)}
    for s, m in itertools.product(range(stages), range(n)):
        expected |= ({Action(s, Kind.I, m), Action(s, Kind.W, m)} if (s, m) in split else {Action(s, Kind.B, m)})
        if name == "pipedream":
            expected.add(Action(s, Kind.U, m))
    assert sorted(done) == sorted(expected)
    simulate(sched, placement=placement)  # no deadlock, every dependency met


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_complete_and_runs(name):
    # each stage runs every microbatch's forward and backward once, on its rank, and the whole runs
    for ranks, n, v in itertools.product((1, 2, 3, 4), range(1, 10), (1, 2, 3) if name in LOOPED else (None,)):
        check_complete(name, ranks, n, v)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("per_stage", [1, 2, 3])
def test_agrees_with_the_runtime_modes_schedules(stages, per_stage):
    # a straight pipeline: the flush mode's 1F1B and PipeDream's asynchronous 1F1B, action for action
    n = stages * per_stage
    flushed = add_updates(one_f_one_b(stages, n))
    asynchronous = pipedream(stages, n)
    replicas = [1] * stages
    for s in range(stages):
        assert flushed[s] == [Action(s, a.kind, a.index) for a in runtime.flushing(s, 0, replicas, 0, n, n)]
        assert asynchronous[s] == [Action(s, a.kind, a.index) for a in runtime.async_1f1b(s, 0, replicas, 0, n)]
