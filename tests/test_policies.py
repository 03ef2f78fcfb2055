"""Checkpoint policies: decisions for spelled-out step/time sequences, formulas, composition, SIGTERM."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedream_ft.policies import (
    AllOf,
    AnyOf,
    CheckpointPolicy,
    EveryNSteps,
    EveryTSeconds,
    Never,
    OverheadBudget,
    PreemptionHandler,
    YoungDaly,
    daly_interval,
    young_interval,
)

pytestmark = pytest.mark.timeout(60)


def decisions(policy: CheckpointPolicy, calls: list[tuple[int, float]]) -> list[int]:
    """The steps at which ``policy`` says to save."""
    return [step for step, now in calls if policy.should_save(step, now)]


def test_never() -> None:
    assert decisions(Never(), [(s, float(s)) for s in range(100)]) == []


def test_every_n_steps() -> None:
    p = EveryNSteps(3)
    assert decisions(p, [(s, 0.0) for s in range(0, 11)]) == [3, 6, 9]
    # Aligned to multiples of n, also after a restart from an arbitrary step.
    p.reset(0.0, step=7)
    assert decisions(p, [(s, 0.0) for s in range(7, 13)]) == [9, 12]
    assert p.last_save_step == 12


def test_every_t_seconds() -> None:
    p = EveryTSeconds(10)
    calls = [(1, 0.0), (2, 5.0), (3, 10.0), (4, 15.0), (5, 19.9), (6, 20.0), (7, 29.0)]
    assert decisions(p, calls) == [3, 6]  # clock starts at the first query (t=0)
    p.reset(100.0)
    assert decisions(p, [(8, 105.0), (9, 110.0), (10, 115.0)]) == [9]
    p.record_save(11, 118.0)  # e.g. an emergency save
    assert decisions(p, [(12, 127.0), (13, 128.0)]) == [13]


def test_young_and_daly_formulas() -> None:
    assert young_interval(2.0, 100.0) == pytest.approx(20.0)
    assert young_interval(10.0, 1000.0) == pytest.approx(math.sqrt(20000.0))
    # Daly: sqrt(2 d M) (1 + sqrt(d/2M)/3 + (d/2M)/9) - d
    assert daly_interval(2.0, 100.0) == pytest.approx(20.0 * (1 + 0.1 / 3 + 0.01 / 9) - 2.0)
    assert daly_interval(10.0, 1000.0) == pytest.approx(
        math.sqrt(20000.0) * (1 + math.sqrt(0.005) / 3 + 0.005 / 9) - 10.0
    )
    assert daly_interval(300.0, 100.0) == 100.0  # delta >= 2M: checkpoint every M
    assert daly_interval(200.0, 100.0) == 100.0
    assert daly_interval(0.0, 100.0) == 0.0
    with pytest.raises(ValueError, match="mtbf_s must be > 0, got 0.0"):
        young_interval(1.0, 0.0)


def test_young_daly_decisions_with_configured_values() -> None:
    p = YoungDaly(mtbf_s=100.0, checkpoint_cost_s=2.0, formula="young")
    assert p.interval_s == pytest.approx(20.0)
    calls = [(1, 0.0), (2, 19.0), (3, 20.0), (4, 39.0), (5, 40.0), (6, 59.9), (7, 60.0)]
    assert decisions(p, calls) == [3, 5, 7]
    d = YoungDaly(mtbf_s=100.0, checkpoint_cost_s=2.0)
    assert d.formula == "daly" and d.interval_s == pytest.approx(daly_interval(2.0, 100.0))


def test_young_daly_measured_cost_and_observed_mtbf() -> None:
    p = YoungDaly(mtbf_s=100.0, fallback_interval_s=50.0, ema_alpha=0.5)
    assert p.delta is None and p.interval_s == 50.0  # cost unknown: fallback
    p.observe(checkpoint_cost_s=2.0)
    assert p.delta == 2.0 and p.interval_s == pytest.approx(daly_interval(2.0, 100.0))
    p.observe(checkpoint_cost_s=4.0)
    assert p.delta == pytest.approx(3.0)  # EMA, alpha 0.5
    q = YoungDaly(checkpoint_cost_s=2.0, formula="young", fallback_interval_s=30.0)
    q.reset(0.0)
    assert q.mtbf is None and q.interval_s == 30.0
    q.observe(failure=True, now=50.0)
    q.observe(failure=True, now=100.0)
    assert q.mtbf == pytest.approx(50.0) and q.interval_s == pytest.approx(math.sqrt(200.0))
    with pytest.raises(ValueError, match="needs now="):
        q.observe(failure=True)
    r = YoungDaly(mtbf_s=100.0, checkpoint_cost_s=2.0, min_interval_s=25.0)
    assert r.interval_s == 25.0


def test_overhead_budget_adapts() -> None:
    p = OverheadBudget(0.1, initial_interval_steps=4, ema_alpha=1.0)
    assert decisions(p, [(s, 0.0) for s in range(1, 5)]) == [4]
    p.observe(step_time_s=1.0, checkpoint_cost_s=0.2)  # 0.2 / (n * 1.0) <= 0.1  ->  n = 2
    assert p.interval_steps == 2
    assert decisions(p, [(s, 0.0) for s in range(5, 9)]) == [6, 8]
    p.observe(checkpoint_cost_s=0.5)  # cost went up: n = 5
    assert p.interval_steps == 5
    assert decisions(p, [(s, 0.0) for s in range(9, 19)]) == [13, 18]
    p.observe(step_time_s=10.0)  # slow steps: checkpoint every step is within budget
    assert p.interval_steps == 1
    capped = OverheadBudget(0.01, max_interval_steps=50, ema_alpha=1.0)
    capped.observe(step_time_s=0.01, checkpoint_cost_s=1.0)
    assert capped.interval_steps == 50


@settings(max_examples=200, deadline=None)
@given(
    cost=st.floats(1e-4, 100.0),
    step_time=st.floats(1e-4, 100.0),
    frac=st.floats(1e-3, 1.0),
)
def test_overhead_budget_interval_is_the_smallest_within_budget(cost: float, step_time: float, frac: float) -> None:
    p = OverheadBudget(frac, ema_alpha=1.0)
    p.observe(step_time_s=step_time, checkpoint_cost_s=cost)
    n = p.interval_steps
    assert cost / (n * step_time) <= frac * (1 + 1e-6)
    if n > 1:
        assert cost / ((n - 1) * step_time) > frac * (1 - 1e-6)


def test_any_of() -> None:
    p = AnyOf(EveryNSteps(5), EveryTSeconds(10))
    calls = [(s, 3.0 * s) for s in range(1, 16)]
    assert decisions(p, calls) == [5, 9, 10, 14, 15]


def test_all_of() -> None:
    p = AllOf(EveryNSteps(2), EveryTSeconds(5))
    assert decisions(p, [(s, float(s)) for s in range(1, 13)]) == [6, 12]


def test_composition_forwards_observations() -> None:
    budget = OverheadBudget(0.5, ema_alpha=1.0)
    p = AnyOf(Never(), budget)
    p.observe(step_time_s=1.0, checkpoint_cost_s=1.0)
    assert budget.interval_steps == 2
    assert decisions(p, [(s, 0.0) for s in range(1, 7)]) == [2, 4, 6]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 2.0), st.booleans()), min_size=1, max_size=40))
def test_policies_are_deterministic(events: list[tuple[float, float, bool]]) -> None:
    def make() -> CheckpointPolicy:
        return AnyOf(YoungDaly(checkpoint_cost_s=0.5, fallback_interval_s=7.0), OverheadBudget(0.2), EveryNSteps(13))

    runs = []
    for _ in range(2):
        p, now, out = make(), 0.0, []
        for step, (dt, cost, fail) in enumerate(events, start=1):
            now += dt
            p.observe(step_time_s=dt, checkpoint_cost_s=cost, failure=fail, now=now)
            out.append(p.should_save(step, now))
        runs.append(out)
    assert runs[0] == runs[1]


def test_validation_messages() -> None:
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        EveryNSteps(0)
    with pytest.raises(TypeError, match="n must be an int, got float 2.5"):
        EveryNSteps(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="t must be > 0, got 0.0"):
        EveryTSeconds(0)
    with pytest.raises(ValueError, match="mtbf_s must be > 0, got -1.0"):
        YoungDaly(mtbf_s=-1)
    with pytest.raises(ValueError, match="checkpoint_cost_s must be >= 0, got -2.0"):
        YoungDaly(checkpoint_cost_s=-2)
    with pytest.raises(ValueError, match="formula must be 'daly' or 'young', got 'x'"):
        YoungDaly(formula="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_fraction must be in \(0, 1\], got 1.5"):
        OverheadBudget(1.5)
    with pytest.raises(ValueError, match="max_fraction must be > 0, got 0.0"):
        OverheadBudget(0)
    with pytest.raises(ValueError, match="needs at least one policy"):
        AnyOf()
    with pytest.raises(TypeError, match="policy 1 must be a CheckpointPolicy"):
        AllOf(Never(), 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        EveryNSteps(2).should_save(-1, 0.0)
    with pytest.raises(ValueError, match="now must be a finite number, got nan"):
        EveryNSteps(2).should_save(1, float("nan"))
    with pytest.raises(ValueError, match="step_time_s must be >= 0, got -1.0"):
        OverheadBudget().observe(step_time_s=-1.0)
    with pytest.raises(ValueError, match="grace_s must be > 0, got 0.0"):
        PreemptionHandler(grace_s=0)


def test_preemption_handler_sigterm_sets_flag_and_restores_old_handler() -> None:
    calls: list[int] = []

    def previous(signum: int, frame: object) -> None:
        calls.append(signum)

    original = signal.signal(signal.SIGTERM, previous)
    fake_now = [1000.0]
    try:
        h = PreemptionHandler(grace_s=30.0, clock=lambda: fake_now[0])
        assert not h.requested and h.fits(29.0) and not h.fits(31.0)
        with h:
            assert h.installed and signal.getsignal(signal.SIGTERM) == h._handle
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not h.requested and time.monotonic() < deadline:
                time.sleep(0.01)
            assert h.requested and h.requested_at == 1000.0 and h.signum == signal.SIGTERM
            assert calls == []  # the handler only sets the flag
            fake_now[0] = 1012.0
            assert h.remaining_s() == pytest.approx(18.0)
            assert h.fits(17.5) and not h.fits(18.5)
            assert h.fits(10.0, now=1015.0) and not h.fits(16.0, now=1015.0)
        assert not h.installed and signal.getsignal(signal.SIGTERM) is previous
        h.clear()
        assert not h.requested
    finally:
        signal.signal(signal.SIGTERM, original)


def test_preemption_handler_margin_and_main_thread_only() -> None:
    import threading

    h = PreemptionHandler(grace_s=30.0, margin_s=5.0, clock=lambda: 0.0)
    assert h.remaining_s() == 25.0 and not h.fits(26.0)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            h.install()
        except ValueError as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join(5)
    assert errors and "main thread" in str(errors[0])
    with pytest.raises(ValueError, match=r"margin_s must be < grace_s \(30.0\), got 30.0"):
        PreemptionHandler(grace_s=30.0, margin_s=30.0)
