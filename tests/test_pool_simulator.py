"""The pool simulator: exact completions, resize costs, switching policy mid-run, user policies."""

from __future__ import annotations

import sys
from typing import Sequence

import pytest

from pipedream_ft.pool import Job, JobView, PoolError, make_policy, simulate
from pipedream_ft.pool.policies import Fifo, Goodput
from pipedream_ft.pool.simulator import PolicyResult, percentile

from pool_helpers import linear

pytestmark = pytest.mark.timeout(60)


def _curves(jobs: Sequence[Job], curve: dict[int, float]) -> dict[str, dict[int, float]]:
    return {j.name: dict(curve) for j in jobs}


def _work_done(rec, curve: dict[int, float], resize_cost: float) -> float:
    """Work integrated over the allocation history, no progress for ``resize_cost`` after a resize/resume."""
    done = 0.0
    al = rec.allocations
    for k, (t, n) in enumerate(al):
        end = al[k + 1][0] if k + 1 < len(al) else rec.finish
        if n == 0:
            continue
        paid = resize_cost if k > 0 else 0.0  # every change after the first start costs the resize
        done += curve[int(n)] * max(0.0, end - t - paid)
    return done


def test_rigid_fifo_with_free_resizes_runs_each_job_exactly_its_duration() -> None:
    jobs = [Job("a", 0, "m", 2, 500.0), Job("b", 5, "m", 2, 300.0), Job("c", 7, "m", 1, 100.0)]
    r = simulate(jobs, _curves(jobs, {1: 1.0, 2: 1.7}), "fifo", devices=3, resize_cost=0)
    recs = {j.name: j for j in r.jobs}
    assert recs["a"].start == 0 and recs["a"].finish == pytest.approx(500.0)
    assert recs["b"].start == 500 and recs["b"].finish == pytest.approx(800.0)  # waits for a's devices
    assert recs["c"].start == 500 and recs["c"].finish == pytest.approx(600.0)  # no passing the head
    assert r.resizes == r.preemptions == 0
    backfilled = simulate(jobs, _curves(jobs, {1: 1.0, 2: 1.7}), "fifo", devices=3, resize_cost=0,
                          policy_options={"backfill": True})
    c = {j.name: j for j in backfilled.jobs}["c"]
    assert c.start == 7 and c.finish == pytest.approx(107.0)  # an arrival is a decision too
    assert r.makespan == pytest.approx(800.0)
    assert r.avg_jct == pytest.approx((500 + 795 + 593) / 3)
    # device-seconds held: 2x500 + 2x300 + 1x100 over 3 x 800
    assert r.utilization == pytest.approx(1700 / 2400)


@pytest.mark.parametrize("policy", ["elastic-fifo", "goodput", "round-robin", "tiresias"])
def test_completion_is_work_over_throughput_integrated_over_the_allocation_history(policy: str) -> None:
    curve = {1: 1.0, 2: 1.8, 3: 2.4, 4: 2.9}
    jobs = [Job(f"j{k}", 40.0 * k, "m", 1 + k % 3, 200.0 + 150 * k) for k in range(6)]
    cost = 7.0
    r = simulate(jobs, _curves(jobs, curve), policy, devices=4, round_s=60, resize_cost=cost,
                 policy_options={"quantum": 120.0, "thresholds": (200.0,)})
    assert (r.resizes + r.preemptions) > 0  # the costs are exercised
    for rec in r.jobs:
        assert rec.arrival <= rec.start <= rec.finish
        assert _work_done(rec, curve, cost) == pytest.approx(rec.work, rel=1e-9)


def test_a_resize_costs_its_time_with_no_progress() -> None:
    # one elastic job alone grows to 4 at once (first start, free); a second arrives at 100 and takes 2:
    # the first shrinks to 2 and pays 10 s
    jobs = [Job("a", 0, "m", 1, 1000.0), Job("b", 100, "m", 2, 100.0, min_workers=2, max_workers=2)]
    curves = {"a": linear(1, 4), "b": {2: 2.0}}
    r = simulate(jobs, curves, "elastic-fifo", devices=4, resize_cost=10)
    a = {j.name: j for j in r.jobs}["a"]
    assert a.allocations[:2] == [[0.0, 4], [100.0, 2]]
    # a's work is 1000 (1 device x 1000 s), 400 done by 100; b's first start is free: it runs 100..200
    b = {j.name: j for j in r.jobs}["b"]
    assert b.start == 100 and b.finish == pytest.approx(200.0)
    # a: 100..110 paused, 110..200 at 2/s = 180 -> 420 left; at 200 it grows back to 4, paused to 210, 105 s
    assert a.allocations[2] == [200.0, 4]
    assert a.finish == pytest.approx(210 + 420 / 4)
    assert r.resizes == 2


def test_a_policy_switched_mid_run_starts_from_the_current_allocation() -> None:
    seen: list[list[JobView]] = []

    class Recording(Goodput):
        def allocate(self, now, jobs, devices):  # type: ignore[override]
            if not seen:
                seen.append(list(jobs))
            return super().allocate(now, jobs, devices)

    curve = linear(1, 4)
    jobs = [Job("a", 0, "m", 2, 1000.0), Job("b", 10, "m", 2, 1000.0), Job("c", 20, "m", 2, 1000.0)]
    plain = simulate(jobs, _curves(jobs, curve), "fifo", devices=4, resize_cost=5)
    r = simulate(jobs, _curves(jobs, curve), "fifo", devices=4, resize_cost=5,
                 switches=[(300.0, Recording(resize_cost=5))])
    assert r.policy == "fifo>300:Recording"
    # at the switch the new policy sees exactly what fifo left: a and b on 2 each, c waiting since it arrived
    assert {(v.name, v.allocation, v.since) for v in seen[0]} == {("a", 2, 0.0), ("b", 2, 10.0), ("c", 0, 20.0)}
    before = {j.name: [x for x in j.allocations if x[0] < 300] for j in r.jobs}
    assert before == {j.name: [x for x in j.allocations if x[0] < 300] for j in plain.jobs}
    assert {j.name: j.allocations[-1] for j in r.jobs} != {j.name: j.allocations[-1] for j in plain.jobs}


def test_a_user_policy_by_import_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_pool_policy.py").write_text(
        "class Biggest:\n"
        "    '''Everything to the job with the most remaining work.'''\n"
        "    def allocate(self, now, jobs, devices):\n"
        "        j = max(jobs, key=lambda j: (j.remaining, j.name))\n"
        "        return {j.name: max(n for n in j.sizes if n <= devices)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    p = make_policy("my_pool_policy:Biggest")
    jobs = [Job("small", 0, "m", 1, 10.0), Job("big", 0, "m", 1, 100.0)]
    r = simulate(jobs, _curves(jobs, linear(1, 2)), p, devices=2, resize_cost=0)
    recs = {j.name: j for j in r.jobs}
    assert recs["big"].allocations[0] == [0.0, 2] and recs["big"].finish == pytest.approx(50.0)
    assert recs["small"].start == pytest.approx(50.0)
    with pytest.raises(PoolError, match="has no 'Nope'"):
        make_policy("my_pool_policy:Nope")
    with pytest.raises(PoolError, match="cannot import 'no_such_module_xyz'"):
        make_policy("no_such_module_xyz:X")
    sys.modules.pop("my_pool_policy", None)


def test_a_policy_that_over_commits_the_pool_is_refused_with_its_name() -> None:
    class Greedy:
        def allocate(self, now, jobs, devices):
            return {j.name: max(j.sizes) for j in jobs}

    jobs = [Job("a", 0, "m", 2, 10.0), Job("b", 0, "m", 2, 10.0)]
    with pytest.raises(PoolError, match="policy Greedy: allocated 4 devices of 3"):
        simulate(jobs, _curves(jobs, {2: 1.0}), Greedy(), devices=3)


def test_metrics_and_percentiles() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    jobs = [Job(f"j{k}", 0, "m", 1, 100.0 * (k + 1)) for k in range(4)]
    r: PolicyResult = simulate(jobs, _curves(jobs, {1: 1.0}), "fifo", devices=4)
    assert [j.finish for j in r.jobs] == pytest.approx([100, 200, 300, 400])
    assert r.p50_jct == pytest.approx(250) and r.avg_queue == 0
    d = r.to_json()
    assert {"avg_jct", "p50_jct", "p99_jct", "makespan", "avg_queue", "utilization", "resizes", "preemptions",
            "jobs"} <= set(d)
    assert {"name", "arrival", "start", "finish", "allocations"} <= set(d["jobs"][0])
    assert Fifo().allocate(0, [], 4) == {}
