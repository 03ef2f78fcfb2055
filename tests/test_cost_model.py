"""The measured cost model: its formulas, PipeDream's optimum when its terms are 0, exactness, refusals."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest

from helpers_profiles import PROFILES_DIR, random_profile
from partitioner import cost, partition
from partitioner.cli import main as partition_main
from partitioner.machine import (MachineError, MachineLevel, MachineProfile, fit_allreduce, load_machine,
                                 zero_machine)
from partitioner.plan import PlanError
from profiler import load_profile
from profiler.profile import Layer, Profile

pytestmark = pytest.mark.timeout(120)


def _machine(workers: int = 4, latency: float = 2e-4, bandwidth: float = 5e8, ar_latency: float = 3e-4,
             ar_bandwidth: float = 2e8, overhead: float = 1.5e-3, cores: int | None = None) -> MachineProfile:
    return MachineProfile((MachineLevel(workers, latency, bandwidth, ar_latency, ar_bandwidth),), overhead,
                          cores=cores)


def _chain(compute_ms: list[float], act: list[float], params: list[float]) -> Profile:
    layers = tuple(Layer(f"l{i}", "Linear", c / 3, 2 * c / 3, a, p)
                   for i, (c, a, p) in enumerate(zip(compute_ms, act, params)))
    return Profile(layers, tuple((i, i + 1) for i in range(len(layers) - 1)))


# -- formulas -------------------------------------------------------------------------------------------------


def test_formulas_by_hand():
    lv = MachineLevel(4, 1e-4, 1e9, 2e-4, 5e8)
    assert cost.measured_allreduce_time(1e6, 1, 2e-4, 5e8) == 0.0
    assert cost.measured_allreduce_time(1e6, 4, 2e-4, 5e8) == pytest.approx(3 * (2e-4 + 2e-3))
    assert cost.measured_transfer_time(1e6, 2, 1e-4, 1e9) == pytest.approx((1e-4 + 1e-3))
    # compute-bound later stage: (C + O + AR) / r
    t = cost.measured_stage_time(0.01, 1e6, 2, lv, 1e-3, 1e3, 1e3)
    assert t == pytest.approx((0.01 + 1e-3 + 2 * (2e-4 + 2e-3)) / 2)
    # transfer-bound: 2 (L + o / B) / r
    t = cost.measured_stage_time(1e-4, 0.0, 1, lv, 0.0, 5e7, None)
    assert t == pytest.approx(2 * (1e-4 + 0.05))
    assert cost.measured_stage_time(0.01, 1e6, 4, lv, 1e-3, 0, 0, first=True, within=2) == \
        pytest.approx((0.01 + 1e-3 + 3 * (2e-4 + 2e-3) / 2) / 4)
    # with no measured terms the measured formulas are PipeDream's
    z = MachineLevel(1, 0.0, 1e9)
    for c, p, r, oi, oo in [(0.01, 1e7, 3, 1e6, 2e6), (0.001, 0.0, 1, 5e6, 1e3)]:
        assert cost.measured_stage_time(c, p, r, z, 0.0, oi, oo) == pytest.approx(
            float(cost.stage_time(c, p, r, 1e9, oi, oo)), rel=1e-12)


def test_fold_is_exact():
    lv = MachineLevel(4, 3e-4, 1e9, 2e-4, 4e8)
    f = cost.Fold.of(lv, 1e-3)
    for o, p, r in [(1e3, 1e6, 2), (5e7, 0.0, 1), (1.0, 3e8, 4)]:
        assert float(cost.transfer_time(f.out_bytes(o), r, f.bandwidth)) == pytest.approx(
            cost.measured_transfer_time(o, r, lv.latency_s, lv.bandwidth), rel=1e-12)
        assert float(cost.allreduce_time(p + f.params_offset, r, f.bandwidth)) == pytest.approx(
            cost.measured_allreduce_time(p, r, lv.allreduce_latency_s, lv.allreduce_bandwidth), rel=1e-12)
    ident = cost.Fold.of(MachineLevel(4, 0.0, 1e9), 0.0)
    x = np.array([1.0, 7.0])
    assert ident.out_bytes(x) is x and ident.params_offset == 0 and ident.compute_offset == 0


def test_contention_bound():
    assert cost.contention_bound([0.01, 0.02], 1e-3, cores=2, workers=2) == 0.0
    assert cost.contention_bound([0.01, 0.02], 1e-3, cores=None, workers=8) == 0.0
    assert cost.contention_bound([0.01, 0.02, 0.0, 0.03], 1e-3, cores=2, workers=4) == pytest.approx(0.064 / 2)
    assert cost.contention_bound([0.01, 0.02], 1e-3, cores=1, workers=2, cpu_fraction=0.0) == pytest.approx(2e-3)


def test_fit_allreduce_recovers_parameters():
    lam, bar = 1.5e-4, 3e8
    samples = [(r, b, 4 * (r - 1) / r * (lam + b / bar)) for r in (2, 3, 4) for b in (4.0, 4e5, 4e6)]
    got_lam, got_bar = fit_allreduce(samples)
    assert got_lam == pytest.approx(lam, rel=1e-6) and got_bar == pytest.approx(bar, rel=1e-6)
    # pure latency: the bytes explain nothing, no negative bandwidth
    got_lam, got_bar = fit_allreduce([(2, 4.0, 1e-4), (2, 4e6, 0.9e-4), (4, 4.0, 1.5e-4)])
    assert got_lam > 0 and got_bar == math.inf
    with pytest.raises(MachineError, match="two samples"):
        fit_allreduce([(1, 4.0, 1e-4), (2, 4.0, 1e-4)])


# -- PipeDream's optimum when the extra terms are 0 -----------------------------------------------------------


@pytest.mark.parametrize("name,workers,bandwidth", [
    ("vgg16.graph.txt", [4], [1e9]), ("resnet18.graph.txt", [8], [2.5e9]), ("vgg16.graph.txt", [4, 2], [1e10, 1e9]),
])
def test_zero_machine_is_pipedream(name, workers, bandwidth):
    profile = load_profile(PROFILES_DIR / name)
    a = partition(profile, workers, bandwidth)
    b = partition(profile, None, machine=zero_machine(workers, bandwidth))
    assert b.time_per_minibatch_s == a.time_per_minibatch_s
    assert [(s.layers, s.replicas) for s in b.stages] == [(s.layers, s.replicas) for s in a.stages]
    assert b.data_parallel_time_s == pytest.approx(a.data_parallel_time_s, rel=1e-12)


def test_zero_machine_random_profiles():
    rng = random.Random(7)
    for _ in range(15):
        p = random_profile(rng, rng.randrange(3, 9), dag=rng.random() < 0.5)
        for w, st in ((rng.randrange(1, 6), False), (3, True)):
            try:
                a = partition(p, w, 1e9, straight=st)
            except PlanError:
                with pytest.raises(PlanError):
                    partition(p, None, machine=zero_machine([w], [1e9]), straight=st)
                continue
            b = partition(p, None, machine=zero_machine([w], [1e9]), straight=st)
            assert b.time_per_minibatch_s == a.time_per_minibatch_s


# -- exactness under measured terms ---------------------------------------------------------------------------


def _brute_force(p: Profile, m: MachineProfile) -> float:
    """Every split of a chain into stages and of the workers among them, timed by the measured formulas."""
    n, W, lv = len(p.layers), m.workers[0], m.levels[0]
    C = [(l.forward_ms + l.backward_ms) / 1e3 for l in p.layers]
    best = math.inf
    for k in range(1, min(n, W) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            for reps in itertools.product(range(1, W + 1), repeat=k):
                if sum(reps) != W:
                    continue
                worst = 0.0
                for s in range(k):
                    a, b = bounds[s], bounds[s + 1]
                    c = sum(C[a:b])
                    pb = sum(l.parameter_bytes for l in p.layers[a:b])
                    o_in = p.layers[a - 1].activation_bytes if s else 0.0
                    o_out = p.layers[b - 1].activation_bytes if s < k - 1 else None
                    t = cost.measured_stage_time(c, pb, reps[s], lv, m.overhead_s, o_in, o_out, first=s == 0)
                    worst = max(worst, float(t))
                best = min(best, worst)
    return best


def test_measured_optimum_matches_brute_force():
    rng = random.Random(3)
    for trial in range(25):
        n = rng.randrange(2, 7)
        p = _chain([rng.uniform(0.1, 20) for _ in range(n)], [rng.choice([4.0, rng.uniform(1e3, 5e6)]) for _ in range(n)],
                   [rng.choice([0.0, rng.uniform(1e3, 5e7)]) for _ in range(n)])
        m = _machine(workers=rng.randrange(1, 5), latency=rng.choice([0.0, 5e-4]), ar_latency=rng.choice([0.0, 1e-3]),
                     overhead=rng.choice([0.0, 2e-3]), ar_bandwidth=rng.choice([5e8, 1e8]))
        plan = partition(p, None, machine=m)
        assert plan.time_per_minibatch_s == pytest.approx(_brute_force(p, m), rel=1e-9), trial
        assert max(s.time_s for s in plan.stages) == pytest.approx(plan.time_per_minibatch_s, rel=1e-12)


def test_overhead_changes_the_plan():
    """A fixed cost per stage makes fewer, replicated stages pay off (4 equal layers, 4 workers)."""
    p = _chain([6.0] * 4, [4.0] * 4, [4.0] * 4)
    straight = partition(p, 4, 1e12)
    assert straight.time_per_minibatch_s == pytest.approx(6e-3, rel=1e-3)
    m = _machine(workers=4, latency=0.0, ar_latency=1e-6, overhead=4e-3, bandwidth=1e12, ar_bandwidth=1e12)
    plan = partition(p, None, machine=m)
    assert plan.time_per_minibatch_s < 6e-3 + 4e-3  # better than 4 stages each paying O
    assert plan.num_stages < 4
    assert plan.settings["machine"]["overhead_s"] == 4e-3


def test_hierarchical_machine_pays_latency_on_the_outer_level():
    profile = load_profile(PROFILES_DIR / "vgg16.graph.txt")
    base = partition(profile, [2, 2], [1e10, 1e9])
    slow = MachineProfile((MachineLevel(2, 0.0, 1e10), MachineLevel(2, 5e-2, 1e9)))
    plan = partition(profile, None, machine=slow)
    assert plan.time_per_minibatch_s >= base.time_per_minibatch_s
    assert plan.world_size == 4 and plan.settings["workers"] == [2, 2]


def test_settings_record_the_machine_and_replan_reuses_it():
    p = _chain([3.0, 9.0, 4.0, 5.0], [1e5] * 4, [1e6] * 4)
    m = _machine()
    plan = partition(p, None, machine=m)
    again = MachineProfile.from_json(json.loads(json.dumps(plan.settings["machine"])))
    assert again == m
    plan2 = partition(p, plan.settings["workers"], plan.settings["bandwidth"], machine=again)
    assert plan2.time_per_minibatch_s == plan.time_per_minibatch_s


# -- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,needle", [
    ("latency_s", float("nan"), "latency_s is nan"),
    ("bandwidth", -1.0, "bandwidth is -1.0"),
    ("allreduce_latency_s", -2e-4, "allreduce_latency_s is -0.0002"),
    ("bandwidth", 0.0, "must be finite and > 0"),
])
def test_bad_level_values_refused(tmp_path, field, value, needle):
    doc = _machine().to_json()
    doc["levels"][0][field] = value
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(MachineError, match=needle) as info:
        load_machine(path)
    assert "refused" in str(info.value) or "> 0" in str(info.value)


def test_bad_overhead_refused_by_cli(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_chain([1.0, 2.0], [4.0, 4.0], [4.0, 4.0]).to_json()))
    doc = _machine().to_json()
    doc["overhead_s"] = float("nan")
    (tmp_path / "m.json").write_text(json.dumps(doc))
    out = tmp_path / "plan.json"
    assert partition_main([str(prof), "--machine", str(tmp_path / "m.json"), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "overhead_s is nan" in err[0] and "refused" in err[0]
    assert not out.exists()
    doc["overhead_s"] = 1e-3
    doc["format"] = "other"
    (tmp_path / "m.json").write_text(json.dumps(doc))
    assert partition_main([str(prof), "--machine", str(tmp_path / "m.json"), "-o", str(out)]) == 2
    assert "format must be" in capsys.readouterr().err
    assert partition_main([str(prof), "--machine", str(tmp_path / "m.json"), "-b", "1e9", "-o", str(out)]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_cli_prints_costs_with_the_plan(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_chain([1.0, 2.0, 3.0, 4.0], [4e3] * 4, [4e3] * 4).to_json()))
    m = tmp_path / "m.json"
    _machine(cores=2).save(m)
    out = tmp_path / "plan.json"
    assert partition_main([str(prof), "--machine", str(m), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fixed cost per minibatch per stage 1.500 ms" in text and "AR(r, P)" in text
    assert "predicted time per minibatch" in text
    saved = json.loads(out.read_text())
    assert saved["settings"]["machine"]["levels"][0]["latency_s"] == 2e-4


def test_machine_and_workers_must_agree():
    p = _chain([1.0, 2.0], [4.0, 4.0], [4.0, 4.0])
    with pytest.raises(PlanError, match="levels"):
        partition(p, [2, 2], machine=_machine())
    with pytest.raises(PlanError, match="differs"):
        partition(p, [4], [1e9], machine=_machine())
    with pytest.raises(PlanError, match="needed"):
        partition(p, [4])
