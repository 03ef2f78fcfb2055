"""Our schedules against torch.distributed.pipelining's, without a process group.

torch computes a class's ``pipeline_order`` in its constructor from the stages' ``num_stages``,
``group_size``, ``group_rank`` and ``submod`` alone, so plain stand-in objects are enough (no module, no
process group, nothing run). Compared: the compute actions of every rank, in order (torch's idle slots,
``REDUCE_GRAD`` and, for DualPipeV, the grouping of overlapped pairs left out).
"""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as tps

from pipedream_ft.schedules import (SCHEDULES, Action, add_communication, build, dualpipev, from_csv, gpipe,
                                    interleaved_1f1b, interleaved_zero_bubble, looped_bfs, one_f_one_b, to_csv,
                                    zb_h1, zbv)

pytestmark = pytest.mark.timeout(120)


def stub_stages(ranks, stages, total):
    return [SimpleNamespace(num_stages=total, group_size=ranks, group_rank=0, stage_index=s, submod=None)
            for s in stages]


def compute(order):
    out = {}
    for rank, acts in sorted(order.items()):
        seq = []
        for a in acts:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):  # DualPipeV's OVERLAP_F_B: its forward, then its backward
                if sub.computation_type.value in ("F", "B", "I", "W"):
                    seq.append(str(sub))
        out[rank] = seq
    return out


def ours(schedule):
    return {r: [str(a) for a in acts] for r, acts in schedule.items()}


def torch_single(cls, ranks, n):
    return compute(cls(stub_stages(ranks, [0], ranks)[0], n).pipeline_order)


def torch_multi(cls, ranks, local_stages, total, n):
    return compute(cls(stub_stages(ranks, local_stages, total), n).pipeline_order)


def rounds_ok(ranks, n):
    return n % max(1, n // ranks) == 0


GRID = [(r, n) for r in (1, 2, 3, 4, 5) for n in range(1, 13)]


def test_gpipe():
    for ranks, n in GRID:
        assert ours(gpipe(ranks, n)) == torch_single(tps.ScheduleGPipe, ranks, n), (ranks, n)


def test_one_f_one_b():
    for ranks, n in GRID:
        if n < ranks:
            continue  # torch's 1F1B needs n >= ranks
        mine, theirs = ours(one_f_one_b(ranks, n)), torch_single(tps.Schedule1F1B, ranks, n)
        for r in range(ranks - 1):
            assert mine[r] == theirs[r], (ranks, n, r)
        # torch 2.13's table numbers the last rank's forwards from 1 (3F1..3F8 for 8 microbatches: its warm-up
        # counter starts one ahead when there is no warm-up); its runtime does not read the table. Same order.
        fixed = [a if "F" not in a else str(Action(ranks - 1, "F", int(a.split("F")[1]) - 1))
                 for a in theirs[ranks - 1]]
        assert mine[ranks - 1] in (theirs[ranks - 1], fixed), (ranks, n)


def test_zb_h1():
    # torch's interleaved zero-bubble class with one stage per rank is ZB-H1
    for ranks, n in GRID:
        if rounds_ok(ranks, n):
            assert ours(zb_h1(ranks, n)) == torch_multi(tps.ScheduleInterleavedZeroBubble, ranks, [0], ranks, n)


@pytest.mark.parametrize("v", [1, 2, 3])
def test_looped(v):
    for ranks, n in GRID:
        if not rounds_ok(ranks, n):
            continue
        local, total = [k * ranks for k in range(v)], v * ranks
        assert ours(interleaved_1f1b(ranks, v, n)) == torch_multi(tps.ScheduleInterleaved1F1B, ranks, local, total,
                                                                  n), (ranks, n)
        assert ours(interleaved_zero_bubble(ranks, v, n)) == torch_multi(tps.ScheduleInterleavedZeroBubble, ranks,
                                                                         local, total, n), (ranks, n)
        assert ours(looped_bfs(ranks, v, n)) == torch_multi(tps.ScheduleLoopedBFS, ranks, local, total, n), (ranks, n)


def test_rounds_refused_like_torch():
    with pytest.raises(ValueError, match="multiple of the rounds"):
        interleaved_1f1b(4, 2, 10 + 1)
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        tps.ScheduleInterleaved1F1B(stub_stages(4, [0, 4], 8), 11)


def test_zbv():
    for ranks, n in GRID:
        assert ours(zbv(ranks, n)) == torch_multi(tps.ScheduleZBVZeroBubble, ranks, [0, 2 * ranks - 1], 2 * ranks,
                                                  n), (ranks, n)


def test_dualpipev():
    for ranks, n in GRID:
        if n >= 2 * ranks:  # DualPipeV's requirement, ours and torch's
            assert ours(dualpipev(ranks, n)) == torch_multi(tps.ScheduleDualPipeV, ranks, [0, 2 * ranks - 1],
                                                            2 * ranks, n), (ranks, n)


@pytest.mark.parametrize("name", [s for s in SCHEDULES if s != "pipedream"])
def test_communication_pass_matches_torch(name):
    for ranks, n in [(2, 4), (3, 6), (4, 8), (4, 10)]:
        sched, placement = build(name, ranks, n)
        theirs = tps._add_send_recv(
            {r: [tps._Action(a.stage, tps._ComputationType(a.kind.value), a.index) for a in acts]
             for r, acts in sched.items()},
            stage_to_rank=lambda s: placement[s], num_stages=len(placement))
        assert ours(add_communication(sched, placement)) == {r: [str(a) for a in acts] for r, acts in theirs.items()}


def test_torch_reads_our_actions_and_tables():
    sched, placement = build("interleaved_zero_bubble", 2, 4)
    lowered = add_communication(sched, placement)
    for acts in from_csv(to_csv(lowered)).values():
        for a in acts:
            t = tps._Action.from_str(str(a))
            assert (t.stage_index, t.computation_type.value, t.microbatch_index) == (a.stage, a.kind.value, a.index)
