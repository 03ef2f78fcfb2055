"""The schedule that runs is the schedule that was lowered: every mode's per-rank lists with their sends and receives.

Pure tests check :meth:`Mode.lowered` against :func:`~pipedream_ft.schedules.add_communication` (replicated stages
included: a message goes to the replica that runs the minibatch); a traced run on real gloo processes shows each
process running exactly its lowered list, sends and receives included, in order.
"""

from __future__ import annotations

import pytest
import torch

from dist_helpers import run_world
from ft_cases import checkpointed_case
from pipedream_ft.pipeline.modes import make_mode
from pipedream_ft.pipeline.topology import Topology
from pipedream_ft.schedules import Action, Kind, ScheduleError, add_communication, parse_action
from pipedream_ft.schedules.placement import Replicated
from runtime_cases import mlp, plan_for

pytestmark = pytest.mark.timeout(240)

P3 = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def _lowered(plan, mode: str, start: int, stop: int) -> dict[int, list[Action]]:
    m = make_mode(mode, 4)
    topos = [Topology.of(plan, r) for r in range(plan.world_size)]
    for t in topos:
        m.check(t)
    return {t.rank: m.lowered(t, start, stop) for t in topos}


def _messages_meet(lowered: dict[int, list[Action]], placement: Replicated) -> None:
    """Every send is received once, by the rank that runs the minibatch on the neighbouring stage, and the reverse."""
    sends = {(a, r) for r, acts in lowered.items() for a in acts if a.kind in (Kind.SEND_F, Kind.SEND_B)}
    recvs = {(a, r) for r, acts in lowered.items() for a in acts if a.kind in (Kind.RECV_F, Kind.RECV_B)}
    assert len(sends) == len(recvs) > 0
    for a, r in sends:
        to = a.stage + 1 if a.kind == Kind.SEND_F else a.stage - 1
        kind = Kind.RECV_F if a.kind == Kind.SEND_F else Kind.RECV_B
        assert (Action(to, kind, a.index), placement.rank(to, a.index)) in recvs, a
        assert r == placement.rank(a.stage, a.index)


@pytest.mark.parametrize("mode", ["stash", "vertical", "flush", "2bw"])
def test_every_mode_lowers_to_messages_that_meet(mode):
    plan = plan_for(mlp(), P3)
    lowered = _lowered(plan, mode, 0, 12)
    _messages_meet(lowered, Replicated.of([s.ranks for s in plan.stages]))
    # receives as early as they are useful: the next forward's input on its way, the gradient's after the send
    assert [str(a) for a in lowered[1][:6]] == ["1RECV_F0", "1RECV_F1", "1F0", "1SEND_F0", "1RECV_B0", "1RECV_F2"]
    # a compute action's input is received before it, on its own rank
    for rank, acts in lowered.items():
        seen: set[Action] = set()
        for a in acts:
            if a.kind == Kind.F and a.stage > 0:
                assert Action(a.stage, Kind.RECV_F, a.index) in seen, (rank, a)
            if a.kind in (Kind.B, Kind.I) and a.stage < 2:
                assert Action(a.stage, Kind.RECV_B, a.index) in seen, (rank, a)
            seen.add(a)


def test_a_replicated_stage_sends_each_minibatch_to_the_replica_that_runs_it():
    plan = plan_for(mlp(), P3, [2, 1, 1])  # ranks 0 and 1 are stage 0's replicas, rank 2 stage 1, rank 3 stage 2
    lowered = _lowered(plan, "stash", 0, 8)
    placement = Replicated.of([s.ranks for s in plan.stages])
    _messages_meet(lowered, placement)
    assert {a.index for a in lowered[0] if a.kind == Kind.SEND_F} == {0, 2, 4, 6}
    assert {a.index for a in lowered[1] if a.kind == Kind.RECV_B} == {1, 3, 5, 7}
    assert [a for a in lowered[2] if a.kind == Kind.U] == [Action(1, Kind.U, j) for j in range(8)]


def test_lowering_refuses_an_action_on_a_rank_that_does_not_run_its_minibatch():
    placement = Replicated(((0, 1), (2,)))
    with pytest.raises(ScheduleError, match="0F1 is on rank 0 but stage 0 runs minibatch 1 on rank 1"):
        add_communication({0: [parse_action("0F1")], 1: [], 2: []}, placement)
    with pytest.raises(ScheduleError, match=r"0U0 is on rank 2 but stage 0 is placed on ranks \[0, 1\]"):
        add_communication({0: [], 1: [], 2: [parse_action("0U0")]}, placement)


def _ran(trace_dir, pid: int) -> list[str]:
    from pipedream_ft.observe.timeline import merge_traces, trace_files

    events = [e for e in merge_traces(trace_files(trace_dir))["traceEvents"] if e.get("pid") == pid and (
        (e.get("ph") == "X" and e["cat"] in ("forward", "backward", "weight", "update"))
        or (e.get("ph") == "i" and e.get("cat") == "message"))]
    events.sort(key=lambda e: e["ts"])  # stable: an instant recorded before a compute that starts at the same time
    return [f"{e['args']['stage']}{e['name']}" for e in events]


@pytest.mark.slow
@pytest.mark.parametrize("mode, schedule", [("stash", "1f1b"), ("flush", "zb_h1")])
def test_each_process_runs_its_lowered_list_sends_and_receives_included(tmp_path, mode, schedule):
    traces = tmp_path / "traces"
    run_world(checkpointed_case, 3, str(tmp_path / "ckpt"), P3, None, 8, None, 8, mode, "adam", False, schedule,
              env={"PIPEDREAM_FT_TRACE_DIR": str(traces)})
    plan = plan_for(mlp(), P3)
    m = make_mode(mode, 4, schedule=schedule)
    for rank in range(3):
        want = [str(a) if a.kind in (Kind.F, Kind.B, Kind.U) or a.kind.value.startswith(("SEND", "RECV"))
                else f"{a.stage}{'B' if a.kind == Kind.I else 'W'}{a.index}"  # the trace names I's event B
                for a in m.lowered(Topology.of(plan, rank), 0, 8)]
        assert _ran(traces, rank) == want, rank


REPLICAS = [[1, 1, 1], [2, 1, 1], [1, 2, 1], [1, 1, 2], [2, 2, 1], [3, 1, 2]]


@pytest.mark.parametrize("mode,replicas", [(m, r) for m in ("stash", "flush", "2bw") for r in REPLICAS]
                         + [("vertical", [1, 1, 1]), ("vertical", [2, 2, 2])])  # vertical: one replica count
def test_each_rank_lowers_alone_what_the_pass_over_every_rank_gives(mode, replicas):
    """Mode.lowered makes a rank's list from its own actions (schedules.comms.lower_rank): the same list as
    add_communication over every rank's schedule, receives moved early."""
    from pipedream_ft.schedules.comms import lower_rank, post_receives_early

    plan = plan_for(mlp(), P3, replicas)
    m = make_mode(mode, 6, update_every=6 if mode == "2bw" else None)  # a multiple of every replica count here
    window = m.window(Topology.of(plan, 0)) if mode != "flush" else 6
    topos = [Topology.of(plan, r) for r in range(plan.world_size)]
    for t in topos:
        m.check(t)
    for start, stop in ((0, 2 * window), (window, 4 * window)):
        every = {t.rank: m.schedule(t, start, stop) for t in topos}
        full = add_communication(every, Replicated.of([s.ranks for s in plan.stages]))
        for t in topos:
            assert lower_rank(t.rank, every[t.rank], Replicated.of([s.ranks for s in plan.stages])) is not None
            assert m.lowered(t, start, stop) == post_receives_early({t.rank: full[t.rank]})[t.rank], (t.rank, start)


@pytest.mark.parametrize("schedule, stages", [("interleaved_1f1b", 4), ("zbv", 4), ("dualpipev", 4),
                                              ("interleaved_zero_bubble", 6), ("looped_bfs", 6)])
def test_a_process_of_several_stages_lowers_alone_what_the_pass_over_every_process_gives(schedule, stages):
    """A process's list made whole (process_actions) and as it runs (iter_process_actions, which reads its stages'
    order from two windows) is the pass's over every process, for runs shorter and longer than those windows."""
    from pipedream_ft.schedules.comms import post_receives_early
    from pipedream_ft.virtual import iter_process_actions, process_actions, virtual_layout

    layers = [[2 * s, 2 * s + 1] for s in range(stages)]
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2 * stages)])
    layout = virtual_layout(schedule, plan_for(model, layers), 2, 4)
    for start, stop in ((0, 4), (0, 8), (4, 16), (4, 64)):
        every = {r: layout.rank_actions(r, start, stop) for r in range(2)}
        full = add_communication(every, dict(enumerate(layout.placement)))
        for r in range(2):
            want = post_receives_early({r: full[r]})[r]
            assert process_actions(layout, r, start, stop) == want, (r, start)
            assert list(iter_process_actions(layout, r, start, stop)) == want, (r, start)


@pytest.mark.parametrize("mode,replicas", [(m, r) for m in ("stash", "flush", "2bw") for r in REPLICAS]
                         + [("vertical", [1, 1, 1]), ("vertical", [2, 2, 2])])
def test_a_run_lowered_as_it_goes_is_the_run_lowered_whole(mode, replicas):
    """Mode.iter_lowered (what a process runs: made as it runs, its stages' order read from a few windows) gives
    Mode.lowered's list, for runs shorter and much longer than that sample, from the start and from a later cut."""
    plan = plan_for(mlp(), P3, replicas)
    m = make_mode(mode, 6, update_every=6 if mode == "2bw" else None)
    for t in (Topology.of(plan, r) for r in range(plan.world_size)):
        window = m.window(t)
        for start, stop in ((0, window), (0, 2 * window), (window, 40 * window), (3 * window, 200 * window)):
            assert list(m.iter_lowered(t, start, stop)) == m.lowered(t, start, stop), (t.rank, start, stop)


def test_a_run_lowered_as_it_goes_starts_at_once_however_long_it_is():
    from itertools import islice

    plan = plan_for(mlp(), P3, [1, 1, 1])
    for mode in ("stash", "flush", "2bw"):
        m = make_mode(mode, 6, update_every=6 if mode == "2bw" else None)
        for t in (Topology.of(plan, r) for r in range(3)):
            head = list(islice(m.iter_lowered(t, 0, 6 * 10**9), 300))  # whole, 10**9 minibatches would not fit
            assert head == m.lowered(t, 0, 600)[:300], (mode, t.rank)


def test_a_run_that_leaves_the_order_its_lowering_read_is_refused_not_run():
    """iter_lower_rank reads each stage's order from a sample; a run that leaves it where the receives depend on it
    raises instead of running a list that lower_rank would not give."""
    from pipedream_ft.schedules.comms import iter_lower_rank, lower_rank

    def parse(row: str) -> list[Action]:
        return [parse_action(t) for t in row.split()]

    placement = {0: 0, 1: 1}
    in_order = parse("0F0 0F1 0B0 0B1")
    swapped = parse("0F0 0F1 0B1 0B0")
    assert lower_rank(0, swapped, placement) is None  # whole, it is seen at once
    lazily = iter_lower_rank(0, swapped, placement, in_order)
    assert lazily is not None
    with pytest.raises(ScheduleError, match="stage 0's backward of minibatch 1 leaves its forwards' order"):
        list(lazily)
    # a stage the sample shows with no gradient to receive, that then receives one
    never = parse("0F0 0F1")
    with pytest.raises(ScheduleError, match="stage 0 receives the gradient of minibatch 0"):
        list(iter_lower_rank(0, in_order, placement, never))
    # a forward whose backward never comes
    with pytest.raises(ScheduleError, match=r"forwards without their backward \{0: \[1\]\}"):
        list(iter_lower_rank(0, parse("0F0 0F1 0B0"), placement, in_order))
    assert list(iter_lower_rank(0, in_order, placement, in_order)) == lower_rank(0, in_order, placement)
