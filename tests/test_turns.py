"""The turns of the stages of one process (virtual stages), with threads standing in for the stages."""

from __future__ import annotations

import threading
import time

import pytest

from pipedream_ft.pipeline.group import PeerTimeoutError
from pipedream_ft.pipeline.turns import Turns
from pipedream_ft.schedules.actions import Action, Kind
from pipedream_ft.schedules.window import virtual_schedule

pytestmark = pytest.mark.timeout(60)


def _stage(turns: Turns, stage: int, start: int, stop: int, ran: list[Action], *, barrier=None) -> None:
    turns.begin(stage, start, stop)
    try:
        for a in turns.schedule.actions(stage, start, stop):
            with turns.turn(a):
                ran.append(a)
                if a.kind == Kind.U and barrier is not None:
                    barrier.wait(5)  # the updates are collectives: both stages' must run at once
                time.sleep(0.001)
    finally:
        turns.leave(stage)


def _run(turns: Turns, start: int, stop: int, barrier=None) -> list[Action]:
    ran: list[Action] = []
    threads = [threading.Thread(target=_stage, args=(turns, s, start, stop, ran), kwargs={"barrier": barrier})
               for s in reversed(turns.stages)]  # the later stage starts first: the order must not depend on it
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return ran


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv", "dualpipev"])
def test_the_stages_of_a_process_take_their_actions_in_the_schedules_order(name):
    schedule = virtual_schedule(name, 2, 4)
    for rank in (0, 1):
        turns = Turns(schedule, rank, timeout_s=10)
        for start, stop in [(4, 12), (12, 16)]:  # a second run is ordered again
            ran = _run(turns, start, stop, barrier=threading.Barrier(2))
            want = schedule.rank_actions(rank, start, stop)
            assert [a for a in ran if a.kind != Kind.U] == [a for a in want if a.kind != Kind.U]
            assert sorted(a for a in ran if a.kind == Kind.U) == sorted(a for a in want if a.kind == Kind.U)
            for w in range(start // 4, stop // 4):  # a window's updates come after all of its compute
                last = max(i for i, a in enumerate(ran) if a.kind != Kind.U and a.index // 4 == w)
                assert all(i > last for i, a in enumerate(ran) if a.kind == Kind.U and a.index == w)


def test_a_stage_waits_for_the_others_to_begin_then_a_stage_that_leaves_frees_it():
    turns = Turns(virtual_schedule("interleaved_1f1b", 2, 4), 0, timeout_s=10)
    turns.begin(2, 0, 4)
    passed = threading.Event()

    def second_stage() -> None:
        with turns.turn(Action(2, Kind.F, 0)):
            passed.set()

    t = threading.Thread(target=second_stage)
    t.start()
    assert not passed.wait(0.3)  # stage 0 has not begun: stage 2 may not run ahead of its first forward
    turns.leave(0)  # stage 0 will not run (its group failed): stage 2 goes on alone
    assert passed.wait(5)
    t.join(5)


def test_a_stage_that_ran_alone_meanwhile_is_ordered_from_where_it_got_to():
    schedule = virtual_schedule("interleaved_1f1b", 2, 4)
    turns = Turns(schedule, 0, timeout_s=10)
    turns.begin(0, 0, 4)
    turns.leave(2)  # an earlier run's stage 2 left late: stage 0 runs freely until stage 2 begins this run
    mine = schedule.actions(0, 0, 4)
    for a in mine[:3]:
        with turns.turn(a):
            pass
    rest: list[Action] = []
    t = threading.Thread(target=_stage, args=(turns, 2, 0, 4, rest))
    t.start()
    for a in mine[3:]:
        with turns.turn(a):
            rest.append(a)
    t.join(10)
    order = [a for a in schedule.rank_actions(0, 0, 4) if a not in mine[:3]]
    assert [a for a in rest if a.kind != Kind.U] == [a for a in order if a.kind != Kind.U]


def test_a_turn_that_never_comes_fails_like_a_peer_naming_what_it_waits_for():
    schedule = virtual_schedule("zbv", 2, 4)
    turns = Turns(schedule, 0, timeout_s=0.3)
    turns.begin(0, 0, 4)
    with pytest.raises(PeerTimeoutError, match=r"0F0 waited 0.3 s for its turn on rank 0: stages \[3\] have not "
                                               "begun the run"):
        with turns.turn(Action(0, Kind.F, 0)):
            pass
    turns.begin(3, 0, 4)
    with pytest.raises(PeerTimeoutError, match="3F0 waited 0.3 s for its turn on rank 0: 0F0 comes first"):
        with turns.turn(Action(3, Kind.F, 0)):
            pass
    with pytest.raises(ValueError, match=r"stage 1 does not run on rank 0 \(it holds \[0, 3\]\)"):
        turns.begin(1, 0, 4)


def test_a_stage_waits_as_long_as_another_runs_an_action_and_then_its_timeout_counts_again():
    """The timeout counts while no stage of the process runs an action: an action of another stage that takes
    longer than it (a long forward after a long wait for a peer) does not fail the stage that waits."""
    schedule = virtual_schedule("interleaved_1f1b", 2, 4)
    turns = Turns(schedule, 0, timeout_s=0.3)
    for stage in (0, 2):
        turns.begin(stage, 0, 4)
    first, second = schedule.rank_actions(0, 0, 4)[:2]  # 0F0 then 0F1: stage 0 twice
    later = next(a for a in schedule.rank_actions(0, 0, 4) if a.stage == 2)
    inside = threading.Event()
    release = threading.Event()

    def long_action() -> None:
        with turns.turn(first):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=long_action)
    t.start()
    assert inside.wait(5)
    failed: list[BaseException] = []

    def waiter() -> None:
        try:
            with turns.turn(later):
                pass
        except BaseException as exc:  # noqa: BLE001 -- recorded for the assertion
            failed.append(exc)

    w = threading.Thread(target=waiter)
    w.start()
    time.sleep(1.0)  # more than three timeouts while stage 0's action runs
    assert not failed and w.is_alive()
    release.set()
    t.join(5)
    w.join(5)  # stage 0's next action (0F1) never comes: now the timeout counts, and stage 2 fails naming it
    assert len(failed) == 1 and isinstance(failed[0], PeerTimeoutError), failed
    assert f"{second} comes first" in str(failed[0])
