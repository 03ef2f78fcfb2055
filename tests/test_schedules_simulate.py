import itertools

import pytest

from pipedream_ft.schedules import (SCHEDULES, Action, Costs, Kind, ScheduleError, add_communication, add_updates,
                                    build, gpipe, interleaved_1f1b, one_f_one_b, parse_action, render, simulate,
                                    zb_h1)

pytestmark = pytest.mark.timeout(60)


def parse(rows):
    return {r: [parse_action(t) for t in row.split()] for r, row in enumerate(rows)}


COSTS = [(1, 1, 1), (2, 2, 1), (1, 2, 1), (3, 2, 1), (2, 1, 1), (1, 1, 2), (1, 3, 3), (0.5, 1.5, 0.25)]


@pytest.mark.parametrize("f,i,w", COSTS)
def test_bubbles(f, i, w):
    b = i + w
    for stages, per_stage in itertools.product([1, 2, 3, 4, 5], [1, 2, 3]):
        n = stages * per_stage
        costs = Costs.uniform(stages, f, i, w)
        for sched in (one_f_one_b(stages, n), gpipe(stages, n)):
            t = simulate(sched, costs)
            assert t.step_time == pytest.approx(n * (f + b) + (stages - 1) * (f + b))
            assert all(v == pytest.approx((stages - 1) * (f + b)) for v in t.idle.values())  # every rank's bubble
        # ZB-H1: (S - 1)(F + I - W) while W <= F; a W longer than F no longer hides in the bubble entirely
        t = simulate(zb_h1(stages, n), costs)
        assert t.step_time - n * (f + b) == pytest.approx((stages - 1) * (f + i - min(w, f)))
        assert all(v == pytest.approx((stages - 1) * (f + i - min(w, f))) for v in t.idle.values())


def test_equal_costs_figures():
    # S = 4, 8 microbatches, F = I = W = 1: 1F1B idles 3 * 3 per rank, ZB-H1 3 * 1
    assert simulate(one_f_one_b(4, 8)).step_time == 33
    assert simulate(zb_h1(4, 8)).step_time == 27
    assert simulate(zb_h1(4, 8)).bubble_fraction == pytest.approx(3 / 27)
    # interleaving 2 stages per rank (each half the work) shortens the bubble
    half = Costs.uniform(8, 0.5, 0.5, 0.5)
    assert simulate(interleaved_1f1b(4, 2, 8), half).step_time < simulate(one_f_one_b(4, 8)).step_time


def test_grid_literal():
    t = simulate(one_f_one_b(3, 4), Costs.uniform(3, 1, 0.5, 0.5))
    assert render(t) == "\n".join([
        "rank 0: 0F0 0F1 0F2 .   .   0B0 0F3 0B1 .   0B2 .   0B3",
        "rank 1: .   1F0 1F1 .   1B0 1F2 1B1 1F3 1B2 .   1B3 .",
        "rank 2: .   .   2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 .   .",
    ])
    t = simulate(zb_h1(2, 2), Costs.uniform(2, 2, 1, 1))
    assert render(t) == "\n".join([
        "rank 0: 0F0 --- 0F1 --- .   0I0 0W0 .   0I1 0W1",
        "rank 1: .   .   1F0 --- 1I0 1F1 --- 1I1 1W0 1W1",
    ])
    assert t.busy == {0: 8, 1: 8} and t.step_time == 10 and t.idle == {0: 2, 1: 2}


def test_spans_and_latency():
    t = simulate(one_f_one_b(2, 1), Costs.uniform(2, 1, 1, 1, latency=0.5))
    assert [(str(s.action), s.start, s.end) for s in t.spans[0]] == [("0F0", 0, 1), ("0B0", 5, 7)]
    assert [(str(s.action), s.start, s.end) for s in t.spans[1]] == [("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5)]


def test_the_runtimes_overhead_is_paid_once_per_compute_action():
    """``overhead``: every F, B, I and W costs that much more (a whole backward once, a split one twice); an
    update and the messages nothing more."""
    costs = Costs.uniform(2, 1, 1, 1, update=0.5, overhead=0.25)
    assert [costs.of(parse_action(a)) for a in ("0F0", "0B0", "0I0", "0W0", "0U0", "0SEND_F0")] == \
        [1.25, 2.25, 1.25, 1.25, 0.5, 0.0]
    t = simulate(one_f_one_b(2, 1), costs)
    assert [(str(s.action), s.start, s.end) for s in t.spans[1]] == [("1F0", 1.25, 2.5), ("1B0", 2.5, 4.75)]
    # S = 4, 8 microbatches: 1F1B's step is (m + S - 1)(F + B) with each action o longer
    f, b, o = 1.0, 2.0, 0.1
    assert simulate(one_f_one_b(4, 8), Costs.uniform(4, f, b / 2, b / 2, overhead=o)).step_time == \
        pytest.approx(11 * (f + b + 2 * o))
    with pytest.raises(ValueError, match="overhead must be a finite cost >= 0"):
        Costs.uniform(2, overhead=-1)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("latency", [0, 0.25])
def test_messages_do_not_change_the_prediction(name, latency):
    sched, placement = build(name, 3, 6)
    if name != "pipedream":
        sched = add_updates(sched)
    costs = Costs(forward=[1, 2, 1, 1, 2, 1][:len(placement)], input_backward=[1, 1, 2, 1, 1, 3][:len(placement)],
                  weight_backward=[1, 0.5, 1, 2, 1, 1][:len(placement)], update=0.5, latency=latency)
    direct = simulate(sched, costs, placement)
    lowered = simulate(add_communication(sched, placement), costs, placement)
    assert lowered.step_time == pytest.approx(direct.step_time)
    assert lowered.busy == pytest.approx(direct.busy)


def test_deadlock_names_the_actions():
    # rank 0 waits for the gradient of minibatch 0 before sending minibatch 1, which rank 1 forwards first
    with pytest.raises(ScheduleError, match=r"^deadlock: rank 0 at 0B0 waits for 1B0; rank 1 at 1F1 waits for 0F1$"):
        simulate(parse(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"]))
    # a send placed before the forward that produces its tensor (the receive is posted: its forward waits)
    with pytest.raises(ScheduleError, match=r"^deadlock: rank 0 at 0SEND_F0 waits for 0F0; "
                                            r"rank 1 at 1F0 waits for 0SEND_F0$"):
        simulate(parse(["0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"]))


def test_a_lowered_schedule_runs():
    t = simulate(parse(["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"]))
    assert t.step_time == 6


@pytest.mark.parametrize("rows,message", [
    (["0F0 0B0 0F0 0B0"], r"0F0 appears 2 times"),
    (["0F0 0I0"], r"0I0 on rank 0 has no weight-gradient backward 0W0"),
    (["0F0 0W0"], r"0W0 on rank 0 has no input-gradient backward 0I0"),
    (["0F0 0B0 0I0 0W0"], r"0B0 on rank 0 and 0I0 both run the backward of minibatch 0 on stage 0"),
    (["0F0 0B0 0B1"], r"0B1 on rank 0 has no forward 0F1"),
    (["0F0 0B0 0F1"], r"0F1 on rank 0 has no backward \(0B1 or 0I1\)"),
    (["0F0 0B0", "1F0 1F1 1B0 1B1"], r"1F1 on rank 1 needs 0F1, which no rank runs"),
    (["0F0 0SEND_F0 0B0", "1F0 1B0"], r"0SEND_F0 on rank 0 is never met: rank 1 never runs 1RECV_F0"),
    (["0F0 0B0 0RECV_B0", "1RECV_F0 1F0 1B0"], r"0RECV_B0 on rank 0 is never met: rank 1 never runs 1SEND_B0"),
    (["0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0"], r"0B0 on rank 0 needs 0RECV_B0 \(its input from rank 1\), which "
                                                r"rank 0 never runs"),
    (["0F0 1F0 1B0 0B0 0SEND_F0", "1RECV_F0"], r"1RECV_F0 on rank 1 receives for stage 1, which runs on rank 0"),
    (["0F0 1F0 1B0 0B0 0SEND_F0"], r"0SEND_F0 on rank 0: stages 0 and 1 are both on rank 0, nothing to send"),
    (["0F0 2F0 2B0 0B0"], r"stages must be numbered 0..S-1, the schedule has \[0, 2\]"),
    (["0F0 0B0", "0F1 0B1"], r"stage 0 runs on two ranks: 0 and 1 \(0F1\)"),
])
def test_malformed_schedules_are_named(rows, message):
    with pytest.raises(ScheduleError, match=message):
        simulate(parse(rows))


def test_schedule_against_a_placement():
    sched = parse(["0F0 1F0 1B0 0B0", "2F0 2B0"])  # two stages on rank 0, one on rank 1
    assert simulate(sched).step_time == simulate(sched, placement={0: 0, 1: 0, 2: 1}).step_time == 9
    with pytest.raises(ScheduleError, match="1F0 is on rank 0 but stage 1 is placed on rank 1"):
        simulate(sched, placement={0: 0, 1: 1, 2: 1})


def test_idle_slots_are_skipped_and_forward_only_runs():
    t = simulate({0: [None, Action(0, Kind.F, 0), None], 1: [Action(1, Kind.F, 0)]})
    assert t.step_time == 2 and t.idle == {0: 1, 1: 1}


def test_costs_are_checked():
    with pytest.raises(ValueError, match="one cost per stage, got lengths 2, 1, 2"):
        Costs(forward=[1, 1], input_backward=[1], weight_backward=[1, 1])
    with pytest.raises(ValueError, match=r"weight_backward\[1\] must be a finite cost >= 0, got -1"):
        Costs(forward=[1, 1], input_backward=[1, 1], weight_backward=[1, -1])
    with pytest.raises(ValueError, match="latency must be a finite cost >= 0, got nan"):
        Costs.uniform(2, latency=float("nan"))
    with pytest.raises(ValueError, match=r"no costs for stage 2 \(2F0\): costs cover 2 stages"):
        simulate(one_f_one_b(3, 1), Costs.uniform(2))
    assert Costs.uniform(1, 1, 2, 3).of(Action(0, Kind.B, 0)) == 5


def test_a_receive_posted_long_before_its_send_waits_for_nothing():
    # rank 1 posts every receive up front; its forwards wait for the data, not its posting order
    early = simulate(parse(["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                            "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1"]))
    late = simulate(parse(["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                           "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1"]))
    assert early.step_time == late.step_time == 9  # F 1, B 2 (I + W): 0F0 0F1 | 1F0 1B0 | 0B0 1F1 1B1 | 0B1
