import pytest

from pipedream_ft.schedules import (Action, Kind, ScheduleError, add_communication, add_updates, build, compute_only,
                                    interleaved_1f1b, one_f_one_b, parse_action, simulate, zb_h1)

pytestmark = pytest.mark.timeout(60)


def parse(rows):
    return {r: [parse_action(t) for t in row.split()] for r, row in enumerate(rows)}


def text(schedule):
    return {r: " ".join(map(str, acts)) for r, acts in schedule.items()}


def test_straight_literal():
    assert text(add_communication(one_f_one_b(2, 2))) == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        1: "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    }


def test_split_backward_sends_after_i():
    assert text(add_communication(zb_h1(2, 1))) == {
        0: "0F0 0SEND_F0 0RECV_B0 0I0 0W0",
        1: "1RECV_F0 1F0 1I0 1SEND_B0 1W0",
    }


def test_same_rank_stages_send_nothing():
    one_rank = interleaved_1f1b(1, 3, 2)  # three stages, all on rank 0
    assert add_communication(one_rank) == {0: list(one_rank[0])}
    # many-to-one: 4 stages on 2 ranks as 0,0,1,1 -- only the 1 -> 2 boundary crosses ranks
    sched = parse(["0F0 1F0 1B0 0B0", "2F0 3F0 3B0 2B0"])
    assert text(add_communication(sched, {0: 0, 1: 0, 2: 1, 3: 1})) == {
        0: "0F0 1F0 1SEND_F0 1RECV_B0 1B0 0B0",
        1: "2RECV_F0 2F0 3F0 3B0 2B0 2SEND_B0",
    }


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "looped_bfs", "zbv", "dualpipev"])
def test_every_message_met_and_removable(name):
    sched, placement = build(name, 4, 8)
    lowered = add_communication(sched, placement)
    assert compute_only(lowered) == sched
    sends = [a for acts in lowered.values() for a in acts if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    recvs = {a for acts in lowered.values() for a in acts if a.kind in (Kind.RECV_F, Kind.RECV_B)}
    assert len(sends) == len(recvs)
    simulate(lowered, placement=placement)  # checks each send has its receive on the right rank


def test_refusals_name_the_action():
    with pytest.raises(ScheduleError, match=r"cannot place the messages, the schedule deadlocks: "
                                            r"rank 0 at 0B0 waits for 1I0 or 1B0; rank 1 at 1F1 waits for 0F1"):
        add_communication(parse(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"]))
    with pytest.raises(ScheduleError, match="rank 0's schedule already has communication \\(0SEND_F0\\)"):
        add_communication(add_communication(one_f_one_b(2, 1)))
    with pytest.raises(ScheduleError, match="1F0 is on rank 0 but stage 1 is placed on rank 1"):
        add_communication(parse(["0F0 1F0 1B0 0B0"]), {0: 0, 1: 1})


def test_updates_follow_each_stage_last_backward():
    assert text(add_updates(zb_h1(2, 2), update=3)) == {
        0: "0F0 0F1 0I0 0W0 0I1 0W1 0U3",
        1: "1F0 1I0 1F1 1I1 1W0 1W1 1U3",
    }
    sched, _ = build("interleaved_1f1b", 2, 2)
    with_updates = add_updates(sched)
    assert [a for a in with_updates[0] if a.kind == Kind.U] == [Action(2, Kind.U, 0), Action(0, Kind.U, 0)]
    assert with_updates[0][-1] == Action(0, Kind.U, 0)
    with pytest.raises(ScheduleError, match="already has updates"):
        add_updates(with_updates)
    assert add_updates({0: [Action(0, Kind.F, 0)]}) == {0: [Action(0, Kind.F, 0)]}


def test_receives_move_as_early_as_they_are_useful_and_the_list_still_runs():
    from pipedream_ft.schedules.comms import post_receives_early

    lowered = add_communication(one_f_one_b(3, 4))
    early = post_receives_early(lowered)
    assert text(early)[1] == ("1RECV_F0 1RECV_F1 1F0 1SEND_F0 1RECV_B0 1RECV_F2 1F1 1SEND_F1 1RECV_B1 1B0 1SEND_B0 "
                              "1RECV_F3 1F2 1SEND_F2 1RECV_B2 1B1 1SEND_B1 1F3 1SEND_F3 1RECV_B3 1B2 1SEND_B2 1B3 "
                              "1SEND_B3")
    for rank in lowered:
        assert sorted(early[rank]) == sorted(lowered[rank])  # the same actions, receives moved only
        assert [a for a in early[rank] if a.kind.value[:4] != "RECV"] == \
            [a for a in lowered[rank] if a.kind.value[:4] != "RECV"]
    assert simulate(early).step_time == simulate(lowered).step_time
    # a stage whose backwards do not follow its forwards' order keeps its gradient receives where they were
    sched = parse(["0F0 0F1 0B1 0B0", "1F0 1F1 1B1 1B0"])
    moved = post_receives_early(add_communication(sched))
    assert [str(a) for a in moved[0] if a.kind == Kind.RECV_B] == ["0RECV_B1", "0RECV_B0"]
    simulate(moved)


def _full(schedule, placement, rank):
    from pipedream_ft.schedules.comms import post_receives_early

    return post_receives_early({rank: add_communication(schedule, placement)[rank]})[rank]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "interleaved_zero_bubble",
                                  "looped_bfs", "zbv", "dualpipev"])
@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_a_rank_lowers_its_own_list_as_the_whole_pass_does(name, ranks, microbatches):
    from pipedream_ft.schedules.comms import lower_rank

    sched, placement = build(name, ranks, microbatches)
    sched = add_updates(sched)
    for rank in sched:
        mine = lower_rank(rank, sched[rank], placement)
        # None: a stage of the rank runs its backwards out of its forwards' order (looped BFS runs them reversed)
        assert (mine is None) == (name == "looped_bfs"), (name, rank)
        if mine is not None:
            assert mine == _full(sched, placement, rank), (name, rank)


def test_a_rank_whose_backwards_leave_the_forwards_order_needs_every_rank():
    from pipedream_ft.schedules.comms import lower_rank

    sched = parse(["0F0 0F1 0B1 0B0", "1F0 1F1 1B1 1B0"])
    assert lower_rank(0, sched[0], {0: 0, 1: 1}) is None
    assert lower_rank(1, sched[1], {0: 0, 1: 1}) == _full(sched, {0: 0, 1: 1}, 1)
    with pytest.raises(ScheduleError, match="1F0 is on rank 0 but stage 1 is placed on rank 1"):
        lower_rank(0, parse(["0F0 1F0 1B0 0B0"])[0], {0: 0, 1: 1})
    with pytest.raises(ScheduleError, match="already has communication"):
        lower_rank(0, add_communication(one_f_one_b(2, 1))[0], {0: 0, 1: 1})
