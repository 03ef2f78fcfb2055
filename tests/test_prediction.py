"""Predictions that hold, checked by measurement on the sleep model (ratios, not timing thresholds).

Two straight 4-stage sleep pipelines, 10/20 ms and 30/60 ms per layer, run on 4 gloo ranks; the plans'
predicted times per minibatch must rank them as measured, and how far apart the plans predict them must match
how far apart they run, within generous bounds (a loaded machine adds to both runs alike). The contention bound
is checked on its own.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from partitioner import partition  # noqa: E402
from partitioner.machine import MachineLevel, MachineProfile  # noqa: E402
from profiler.profile import Profile  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

MACHINE = MachineProfile((MachineLevel(4, 5e-5, 4e9, 2e-4, 2e9),), overhead_s=6e-4, cores=2)


def _sleep_profile(fwd: float, bwd: float) -> Profile:
    from profiler.layers import structure_profile
    from sleep_model import sleep_model

    prof = structure_profile(sleep_model(4, fwd, bwd))
    layers = tuple(dataclasses.replace(l, forward_ms=fwd, backward_ms=bwd, activation_bytes=8 * 64 * 4)
                   for l in prof.layers)
    return Profile(layers, prof.edges, {"cpu_fraction": 0.0}, prof.tied, prof.inputs)


def test_sleep_predictions_rank_and_their_gap_holds():
    from bench_prediction import CASES, run_plans

    # sleeps long against the runtime's own per-minibatch work, which a loaded machine stretches
    fast, slow = _sleep_profile(10.0, 20.0), _sleep_profile(30.0, 60.0)
    plans = [partition(p, None, machine=MACHINE, straight=True) for p in (fast, slow)]
    predicted = [p.time_per_minibatch_s for p in plans]
    assert predicted[0] == pytest.approx(30e-3 + 6e-4 + 0, rel=1e-9)  # slowest stage: C + O
    cases = [dataclasses.replace(CASES["sleep-2/4"], name="sleep-10/20", minibatches=48),
             dataclasses.replace(CASES["sleep-2/4"], name="sleep-30/60", minibatches=24)]
    # each run twice, alternating, and the faster of each kept: a burst of load from elsewhere on the machine
    # (another test's processes starting) lands on one run, not on both; and within a run the median minibatch,
    # which a burst of load on some minibatches does not move (a CI run beside a CPU hog measured a mean of 60 ms
    # for 31 predicted in the fast case, and only 43 ms between the cases for 60). The four runs share one world
    # of processes, started once.
    runs = run_plans([(c, p) for _ in range(2) for c, p in zip(cases, plans)])
    measured = [min(r["median_s"] for r in runs[i::2]) for i in range(2)]
    assert measured[1] > measured[0]
    # what the plans predict apart (the stages' compute) is what the runs take apart; a loaded machine stretches
    # the runtime's own cost per minibatch (MACHINE's 0.6 ms, measured idle) by the same in both runs, which a
    # ratio of the two would count against the prediction (a CI run under load measured 47 and 105 ms for 31 and
    # 91 predicted: 58 ms apart for 60)
    gap_pred, gap_meas = predicted[1] - predicted[0], measured[1] - measured[0]
    assert 0.75 * gap_pred <= gap_meas <= 1.25 * gap_pred, (predicted, measured)


def test_contention_bound_enters_the_prediction():
    p = _sleep_profile(2.0, 4.0)
    busy = Profile(p.layers, p.edges, {}, p.tied, p.inputs)  # the same times, but on a core
    m = dataclasses.replace(MACHINE, cpu_parallelism=1.0)
    sleepy = partition(p, None, machine=m, straight=True)
    cpu = partition(busy, None, machine=m, straight=True)
    assert sleepy.time_per_minibatch_s == pytest.approx(6.6e-3)
    # 4 stages of 6 ms compute + 0.6 ms fixed cost on one effective core
    assert cpu.time_per_minibatch_s == pytest.approx(4 * 6.6e-3)
    assert cpu.settings["pipeline_time_s"] == pytest.approx(6.6e-3)
    assert cpu.settings["contention_bound_s"] == pytest.approx(4 * 6.6e-3)
