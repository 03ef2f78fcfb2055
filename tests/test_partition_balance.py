"""Balancing a plan of several stages per process across its processes (partitioner/balance.py)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from helpers_profiles import random_profile
from partitioner import chain as chain_path
from partitioner.balance import balance_bounds, process_loads, virtual_placement
from partitioner.optimizer import partition
from partitioner.plan import PlanError
from partitioner.schedule_choice import VIRTUAL, rank_virtual, virtual_plan
from pipedream_ft.schedules import build
from profiler.profile import Layer, Profile

LOOPED_2x2 = [0, 1, 0, 1]


def chain(ms: list[float], activation: float = 0.0) -> Profile:
    layers = tuple(Layer(str(i), "Linear", m / 3, 2 * m / 3, activation, 0.0) for i, m in enumerate(ms))
    return Profile(layers, tuple((i, i + 1) for i in range(len(ms) - 1)))


def busiest(profile: Profile, plan, processes) -> float:
    loads: dict[int, float] = {}
    for s, stage in enumerate(plan.stages):
        ms = sum(profile.layers[i].forward_ms + profile.layers[i].backward_ms for i in stage.layers)
        loads[processes[s]] = loads.get(processes[s], 0.0) + ms / 1e3
    return max(loads.values())


def brute_force(ms: list[float], processes: list[int]) -> float:
    """The least busiest process over every straight plan of ``len(processes)`` stages of the chain ``ms``."""
    prefix = np.concatenate([[0.0], np.cumsum(ms)])
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(ms)), len(processes) - 1):
        best = min(best, float(process_loads(prefix, [0, *cuts, len(ms)], processes).max()))
    return best


def test_every_virtual_schedule_is_placed_as_the_schedule_runs_it():
    for name in VIRTUAL:
        for workers, v in ((2, 2), (3, 2), (2, 3)):
            if name in ("zbv", "dualpipev") and v != 2:
                with pytest.raises(PlanError, match="places 2 stages per process, not 3"):
                    virtual_placement(name, workers, v)
                continue
            built = build(name, workers, 8, None if name in ("zbv", "dualpipev") else v)
            assert virtual_placement(name, workers, v) == [built.placement[s] for s in range(workers * v)]
    with pytest.raises(PlanError, match="'1f1b' does not place several stages"):
        virtual_placement("1f1b", 2, 2)


def test_the_slowest_stage_plan_is_moved_to_where_both_processes_carry_the_same():
    """Layers of 12 ms, the last two 48: the program halves the slowest stage with [0-3] [4-5] [6] [7] (48, 24,
    48, 48) or [0-2] [3-5] [6] [7] (36, 36, 48, 48) alike; looped on 2 processes only the second is balanced
    (84 ms each, against 96 and 72), and it is the best plan of all."""
    ms = [12.0] * 6 + [48.0] * 2
    prefix = np.concatenate([[0.0], np.cumsum(ms)]) / 1e3
    bounds = balance_bounds(prefix, [0, 4, 6, 7, 8], LOOPED_2x2, lambda lo, hi: np.arange(lo + 1, hi))
    assert bounds == [0, 3, 6, 7, 8]
    assert process_loads(prefix, bounds, LOOPED_2x2).max() == pytest.approx(brute_force(ms, LOOPED_2x2) / 1e3)
    plan = partition(chain(ms), 4, 1e9, straight=True, processes=LOOPED_2x2)
    assert [list(s.layers) for s in plan.stages] == [[0, 1, 2], [3, 4, 5], [6], [7]]
    assert plan.time_per_minibatch_s == pytest.approx(0.084)  # the busiest process, over the slowest stage (48)


def test_balancing_finds_the_best_plan_of_a_small_chain_and_never_makes_the_busiest_process_busier():
    rng = random.Random(7)
    for _ in range(60):
        ms = [rng.choice([rng.uniform(1, 5), rng.uniform(5, 40)]) for _ in range(rng.randrange(6, 11))]
        workers, v = rng.choice([(2, 2), (2, 3), (3, 2)])
        name = rng.choice(VIRTUAL if v == 2 else ("interleaved_1f1b",))
        where = virtual_placement(name, workers, v)
        prof = chain(ms)
        before = partition(prof, workers * v, 1e9, straight=True)
        after = partition(prof, workers * v, 1e9, straight=True, processes=where)
        assert sorted(i for s in after.stages for i in s.layers) == list(range(len(ms)))
        assert all(list(s.layers) == sorted(s.layers) and s.layers for s in after.stages)
        assert busiest(prof, after, where) <= busiest(prof, before, where) + 1e-12, (ms, where)
        # the exact search ends well within its budget here: the best of every plan, found by enumeration
        assert busiest(prof, after, where) == pytest.approx(brute_force(ms, where) / 1e3, rel=1e-9), (ms, where)
        assert after.time_per_minibatch_s == pytest.approx(busiest(prof, after, where), rel=1e-9)


def test_out_of_budget_the_search_keeps_the_best_it_found():
    rng = random.Random(5)
    ms = [rng.uniform(1, 40) for _ in range(40)]
    prefix = np.concatenate([[0.0], np.cumsum(ms)])
    where = virtual_placement("interleaved_1f1b", 3, 3)
    dp = partition(chain(ms), 9, 1e9, straight=True)
    start = [0] + [max(s.layers) + 1 for s in dp.stages]
    everything = lambda lo, hi: np.arange(lo + 1, hi)  # noqa: E731
    cut_short = balance_bounds(prefix, start, where, everything, budget=50)
    full = balance_bounds(prefix, start, where, everything)
    loads = [process_loads(prefix, b, where).max() for b in (start, cut_short, full)]
    assert loads[2] <= loads[1] <= loads[0]
    assert len(cut_short) == len(full) == 10 and cut_short[0] == 0 and cut_short[-1] == 40


def test_a_dag_is_cut_only_where_every_edge_goes_forward():
    rng = random.Random(3)
    for _ in range(25):
        prof = random_profile(rng, rng.randrange(8, 14), dag=True)
        where = virtual_placement("interleaved_1f1b", 2, 2)
        try:
            before = partition(prof, 4, 1e9, straight=True)
        except PlanError:  # too few cut points for 4 stages
            continue
        after = partition(prof, 4, 1e9, straight=True, processes=where)
        stage_of = {i: s for s, st in enumerate(after.stages) for i in st.layers}
        assert sorted(stage_of) == list(range(len(prof.layers)))
        assert all(stage_of[u] <= stage_of[v] for u, v in prof.edges), (prof.edges, stage_of)
        assert busiest(prof, after, where) <= busiest(prof, before, where) + 1e-12
        assert after.time_per_minibatch_s <= max(before.time_per_minibatch_s, busiest(prof, before, where)) + 1e-12


def test_a_cut_does_not_move_where_a_transfer_slows_the_pipeline_more_than_balance_gains():
    """Every cut but the program's carries 100 MB at 1 GB/s (0.2 s both ways): the compute is unbalanced (the
    busiest process 84 ms) but any other cut would make a stage take 0.2 s."""
    ms = [12.0] * 6 + [48.0] * 2
    layers = [Layer(str(i), "Linear", m / 3, 2 * m / 3, 1e8 if i not in (3, 5, 6) else 1.0, 0.0)
              for i, m in enumerate(ms)]
    prof = Profile(tuple(layers), tuple((i, i + 1) for i in range(7)))
    plan = partition(prof, 4, 1e9, straight=True, processes=LOOPED_2x2)
    assert [list(s.layers) for s in plan.stages] == [[0, 1, 2, 3], [4, 5], [6], [7]]
    assert plan.time_per_minibatch_s == pytest.approx(0.096)


def with_input(ms: list[float], input_ms: float) -> Profile:
    """:func:`chain` after an ``Input`` layer of ``input_ms`` (as PipeDream's profiles time theirs)."""
    layers = (Layer("input", "Input", input_ms, 0.0, 0.0, 0.0),) + tuple(
        Layer(str(i), "Linear", m / 3, 2 * m / 3, 0.0, 0.0) for i, m in enumerate(ms))
    return Profile(layers, tuple((i, i + 1) for i in range(len(ms))))


def test_the_chain_path_balances_as_the_general_path_does(monkeypatch):
    rng = random.Random(11)
    ms = [rng.uniform(1, 4) for _ in range(40)] + [30.0, 30.0]
    where = virtual_placement("zbv", 3, 2)
    for prof in (chain(ms), with_input(ms, 20.0)):
        general = partition(prof, 6, 1e9, straight=True, processes=where)
        monkeypatch.setattr(chain_path, "CHAIN_MIN_STATES", 1)
        scalable = partition(prof, 6, 1e9, straight=True, processes=where)
        monkeypatch.undo()
        dp = partition(prof, 6, 1e9, straight=True)
        assert busiest(prof, scalable, where) == pytest.approx(busiest(prof, general, where))
        assert busiest(prof, scalable, where) < busiest(prof, dp, where)
        assert scalable.time_per_minibatch_s == pytest.approx(general.time_per_minibatch_s)
        assert scalable.time_per_minibatch_s == pytest.approx(busiest(prof, scalable, where))


def test_processes_are_refused_where_they_cannot_apply_and_ignored_under_a_memory_limit():
    prof = chain([10.0] * 8)
    with pytest.raises(PlanError, match="straight plan of one level"):
        partition(prof, 4, 1e9, processes=LOOPED_2x2)
    with pytest.raises(PlanError, match="for each of the 4 stages, got \\[0, 1\\]"):
        partition(prof, 4, 1e9, straight=True, processes=[0, 1])
    limited = partition(chain([12.0] * 6 + [48.0] * 2, 1.0), 4, 1e9, straight=True, memory_bytes=1e9,
                        processes=LOOPED_2x2)
    assert limited == partition(chain([12.0] * 6 + [48.0] * 2, 1.0), 4, 1e9, straight=True, memory_bytes=1e9)


def test_the_ranking_simulates_each_placement_on_its_own_balanced_plan():
    ms = [12.0] * 6 + [48.0] * 2
    prof = chain(ms)
    ranked = {r.name: r for r in rank_virtual(prof, 2, 4, 1e9)}
    dp = partition(prof, 4, 1e9, straight=True)
    given = {r.name: r for r in rank_virtual(prof, 2, 4, 1e9, plan=dp)}
    for name in ranked:  # each ranked with the faster of its balanced plan and the program's
        assert ranked[name].time_per_minibatch_s <= given[name].time_per_minibatch_s + 1e-12, name
        assert given[name].plan is dp and ranked[name].plan is not None
        assert ranked[name].plan is dp or ranked[name].plan == virtual_plan(prof, 2, 2, 1e9, schedule=name)
    assert ranked["interleaved_1f1b"].time_per_minibatch_s < given["interleaved_1f1b"].time_per_minibatch_s
    looped = virtual_plan(prof, 2, 2, 1e9, schedule="looped_bfs")
    v = virtual_plan(prof, 2, 2, 1e9, schedule="dualpipev")
    assert [list(s.layers) for s in looped.stages] == [[0, 1, 2], [3, 4, 5], [6], [7]]
    assert busiest(prof, v, [0, 1, 1, 0]) <= busiest(prof, dp, [0, 1, 1, 0])
    with pytest.raises(PlanError, match="the plan given has 2 stages"):
        rank_virtual(prof, 2, 4, 1e9, plan=partition(prof, 2, 1e9, straight=True))


def test_the_inputs_the_search_takes_out_count_on_the_first_stage():
    """PipeDream's profiles give their ``Input`` layer time (resnet50's: 19 ms); it always runs on stage 0."""
    ms = [12.0] * 6 + [48.0] * 2
    prof = with_input(ms, 30.0)
    plan = partition(prof, 4, 1e9, straight=True, processes=LOOPED_2x2)
    assert 0 in plan.stages[0].layers
    assert busiest(prof, plan, LOOPED_2x2) == pytest.approx(brute_force([30.0 + ms[0]] + ms[1:], LOOPED_2x2) / 1e3)
    assert plan.time_per_minibatch_s == pytest.approx(busiest(prof, plan, LOOPED_2x2))


def test_with_a_machine_the_busiest_process_pays_the_fixed_cost_of_each_of_its_stages():
    from partitioner.machine import MachineLevel, MachineProfile

    machine = MachineProfile((MachineLevel(4, 0.0, 1e12),), overhead_s=2e-3)
    plan = partition(chain([12.0] * 6 + [48.0] * 2), None, processes=LOOPED_2x2, straight=True, machine=machine)
    assert [list(s.layers) for s in plan.stages] == [[0, 1, 2], [3, 4, 5], [6], [7]]
    assert plan.settings["pipeline_time_s"] == pytest.approx(0.084 + 2 * 2e-3)  # two stages' fixed cost each
