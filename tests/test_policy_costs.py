"""Policies fed with measured checkpoint costs (blocking, persist CPU, time to commit) and backpressure (busy)."""

from __future__ import annotations

import logging
import math

import pytest

from pipedream_ft.policies import AnyOf, EveryNSteps, OverheadBudget, YoungDaly, daly_interval

pytestmark = pytest.mark.timeout(60)


def test_busy_defers_a_due_checkpoint_and_logs_once(caplog) -> None:
    p = EveryNSteps(10)
    with caplog.at_level(logging.INFO, logger="pipedream_ft.policies"):
        assert p.should_save(10, 0.0)
        taken = [s for s in range(11, 40) if p.should_save(s, 0.0, busy=s < 24)]
    # due at 20, deferred at 20..23 (busy), taken at 24; then aligned to multiples of 10 again
    assert taken == [24, 30]
    assert p.deferred == 1  # one checkpoint deferred (over 4 steps)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "deferred" in warnings[0].getMessage()
    assert "step 20" in warnings[0].getMessage() and "not committed" in warnings[0].getMessage()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("stretched to 14 steps" in m for m in infos)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipedream_ft.policies"):
        assert not p.should_save(40, 0.0, busy=True) and p.should_save(41, 0.0)
    assert p.deferred == 2 and not caplog.records  # later deferrals: DEBUG only


def test_busy_never_says_yes_and_not_busy_is_unchanged() -> None:
    a, b = OverheadBudget(0.1, initial_interval_steps=3), OverheadBudget(0.1, initial_interval_steps=3)
    assert [s for s in range(1, 20) if a.should_save(s, 0.0, busy=True)] == []
    assert [s for s in range(1, 10) if b.should_save(s, 0.0)] == [3, 6, 9]


def test_overhead_budget_counts_blocking_and_background_cpu() -> None:
    p = OverheadBudget(0.01, ema_alpha=1.0)
    p.observe(step_time_s=0.03, blocking_s=0.002)
    assert p.interval_steps == math.ceil(0.002 / (0.01 * 0.03) - 1e-9)  # 7: blocking only so far
    p.observe(persist_cpu_s=0.02)
    assert p.costs.cost == pytest.approx(0.022)
    assert p.interval_steps == math.ceil(0.022 / 0.0003 - 1e-9)  # 74
    idle = OverheadBudget(0.01, ema_alpha=1.0, background_weight=0.0)  # cores to spare: only blocking counts
    idle.observe(step_time_s=0.03, blocking_s=0.002, persist_cpu_s=0.02)
    assert idle.interval_steps == 7


def test_overhead_budget_waits_for_storage_to_keep_up() -> None:
    p = OverheadBudget(0.5, ema_alpha=1.0)
    p.observe(step_time_s=0.1, blocking_s=0.001)
    assert p.interval_steps == 1
    p.observe(persist_s=1.0, commit_s=0.45)  # a checkpoint takes 1.45 s to commit: at most one per 15 steps
    assert p.interval_steps == 15
    with pytest.raises(ValueError, match="background_weight must be in"):
        OverheadBudget(0.1, background_weight=2.0)
    with pytest.raises(ValueError, match="persist_cpu_s must be >= 0"):
        p.observe(persist_cpu_s=-1.0)


def test_young_daly_uses_measured_costs_and_latency() -> None:
    p = YoungDaly(mtbf_s=3600.0, ema_alpha=1.0)
    p.observe(blocking_s=0.5, persist_cpu_s=1.5)
    assert p.delta == pytest.approx(2.0)
    assert p.interval_s == pytest.approx(daly_interval(2.0, 3600.0))
    p.observe(persist_s=400.0, commit_s=100.0)  # storage needs 500 s per checkpoint: interval at least that
    assert p.interval_s == pytest.approx(500.0)
    q = YoungDaly(mtbf_s=3600.0, ema_alpha=1.0)
    q.observe(checkpoint_cost_s=2.0)  # the older name of blocking_s
    assert q.delta == pytest.approx(2.0)


def test_composition_forwards_measured_costs() -> None:
    budget = OverheadBudget(0.5, ema_alpha=1.0)
    p = AnyOf(EveryNSteps(1000), budget)
    p.observe(step_time_s=1.0, blocking_s=0.5, persist_cpu_s=0.5, persist_s=0.1, commit_s=0.1)
    assert budget.interval_steps == 2
    assert [s for s in range(1, 9) if p.should_save(s, 0.0, busy=s == 4)] == [2, 5, 7]
    assert p.deferred == 1
