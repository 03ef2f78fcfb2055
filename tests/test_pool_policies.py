"""Each built-in policy's decisions on small hand-made cases, with the expected allocation spelled out."""

from __future__ import annotations

import pytest

from pipedream_ft.pool import PoolError, check_allocation, make_policy
from pipedream_ft.pool.policies import ElasticFifo, Fifo, Goodput, RoundRobin, Tiresias

from pool_helpers import linear, view

pytestmark = pytest.mark.timeout(30)


# fifo ---------------------------------------------------------------------------------------------------------

def test_fifo_starts_in_arrival_order_at_requested_size_and_does_not_pass_the_head() -> None:
    jobs = [view("a", arrival=0, workers=4, alloc=4), view("b", arrival=1, workers=4),
            view("c", arrival=2, workers=1)]
    assert Fifo().allocate(10, jobs, 6) == {"a": 4}  # b needs 4, only 2 free: c waits behind it


def test_fifo_with_backfill_starts_a_later_job_that_fits() -> None:
    jobs = [view("a", arrival=0, workers=4, alloc=4), view("b", arrival=1, workers=4),
            view("c", arrival=2, workers=1), view("d", arrival=3, workers=2)]
    assert Fifo(backfill=True).allocate(10, jobs, 7) == {"a": 4, "c": 1, "d": 2}


def test_fifo_keeps_running_jobs_at_their_size_and_orders_by_priority_then_arrival() -> None:
    jobs = [view("a", arrival=0, workers=2, alloc=3, curve={2: 2.0, 3: 3.0}), view("b", arrival=1, workers=2),
            view("c", arrival=2, workers=2, priority=1)]
    assert Fifo().allocate(10, jobs, 5) == {"a": 3, "c": 2}


# elastic-fifo ---------------------------------------------------------------------------------------------------

def test_elastic_fifo_admits_at_min_and_deals_the_rest_evenly_in_arrival_order() -> None:
    jobs = [view("a", arrival=0, workers=2, curve=linear(1, 8)), view("b", arrival=1, workers=2, curve=linear(2, 8)),
            view("c", arrival=2, workers=1, curve=linear(1, 1))]
    # mins 1 + 2 + 1 = 4; 3 more: a -> 2, then a and b tie at 2 -> a 3 (earlier), then b 3
    assert ElasticFifo().allocate(0, jobs, 7) == {"a": 3, "b": 3, "c": 1}


def test_elastic_fifo_shrinks_running_jobs_to_admit_the_head_and_stops_at_the_first_that_does_not_fit() -> None:
    jobs = [view("a", arrival=0, workers=4, alloc=8, curve=linear(2, 8)),
            view("b", arrival=1, workers=4, curve=linear(4, 8)), view("c", arrival=2, workers=1, curve=linear(3, 8))]
    # a 2 + b 4 = 6 of 8; c needs 3: not admitted; 2 left: a 3, a 4 (a holds fewer than b each time)
    assert ElasticFifo().allocate(0, jobs, 8) == {"a": 4, "b": 4}


def test_elastic_fifo_never_grows_a_job_past_its_largest_size() -> None:
    jobs = [view("a", workers=2, curve=linear(1, 3))]
    assert ElasticFifo().allocate(0, jobs, 16) == {"a": 3}


# round-robin ----------------------------------------------------------------------------------------------------

def test_round_robin_preempts_an_expired_slice_for_a_waiting_job() -> None:
    jobs = [view("a", arrival=0, workers=2, alloc=2, since=0), view("b", arrival=5, workers=2, alloc=2, since=300),
            view("c", arrival=10, workers=2, since=10)]
    rr = RoundRobin(quantum=600)
    assert rr.allocate(599, jobs, 4) == {"a": 2, "b": 2}  # nobody expired yet
    assert rr.allocate(600, jobs, 4) == {"b": 2, "c": 2}  # a's slice is over: c in, a to the back


def test_round_robin_keeps_an_expired_job_when_everything_fits() -> None:
    jobs = [view("a", workers=2, alloc=2, since=0), view("b", arrival=1, workers=1)]
    assert RoundRobin(quantum=600).allocate(1200, jobs, 4) == {"a": 2, "b": 1}


def test_round_robin_serves_the_queue_in_order_without_passing_the_head() -> None:
    jobs = [view("a", workers=3, since=0), view("b", arrival=1, workers=1, since=1),
            view("p", arrival=0, workers=1, alloc=1, since=0, attained=600)]
    # a (waiting since 0) needs 3 of 2 free after p expired and went to the back: nothing passes a
    assert RoundRobin(quantum=600).allocate(700, jobs, 2) == {}


# tiresias -------------------------------------------------------------------------------------------------------

def test_tiresias_serves_least_attained_queue_first_and_preempts_the_rest() -> None:
    jobs = [view("old", arrival=0, workers=4, alloc=4, since=0, attained=4 * 2000),  # 8000 >= 3200: queue 1
            view("new", arrival=100, workers=4, since=100)]  # 0: queue 0
    assert Tiresias().allocate(2100, jobs, 4) == {"new": 4}


def test_tiresias_within_a_queue_is_fifo_and_skips_jobs_that_do_not_fit() -> None:
    jobs = [view("a", arrival=0, workers=3), view("b", arrival=1, workers=3), view("c", arrival=2, workers=1)]
    assert Tiresias().allocate(5, jobs, 4) == {"a": 3, "c": 1}


def test_tiresias_promotes_a_starved_job_to_the_first_queue() -> None:
    # s ran 1000 s on 4 devices (4000 device-s: queue 1) and has waited 8000 s >= 8 x 1000 s: promoted
    jobs = [view("s", arrival=0, workers=4, since=2000, attained=4000, started=True),
            view("q", arrival=50, workers=4, alloc=4, since=2000, attained=0.0)]
    t = Tiresias()
    assert t.allocate(9999, jobs, 4) == {"q": 4}
    assert t.allocate(10000, jobs, 4) == {"s": 4}


# goodput --------------------------------------------------------------------------------------------------------

def test_goodput_gives_devices_only_where_the_curve_still_gains() -> None:
    flat = {1: 1.0, 2: 2.0, 3: 2.5, 4: 2.5, 5: 2.5, 6: 2.5}  # stops scaling at 3
    jobs = [view("flat", workers=1, curve=flat, remaining=1000)]
    assert Goodput().allocate(0, jobs, 6) == {"flat": 3}


def test_goodput_prefers_the_better_scaling_job_for_the_extra_devices() -> None:
    good = linear(1, 4)
    poor = {1: 1.0, 2: 1.2, 3: 1.3, 4: 1.35}
    jobs = [view("good", workers=1, curve=good, remaining=1000), view("poor", workers=1, curve=poor, remaining=1000)]
    # both admitted at 1; the three left all go to "good" (gain 1 per device against at most 0.2)
    assert Goodput(remaining_exponent=1.0).allocate(0, jobs, 5) == {"good": 4, "poor": 1}


def test_goodput_favours_the_job_nearer_completion_when_curves_are_equal() -> None:
    c = linear(1, 4)
    jobs = [view("long", workers=1, curve=c, remaining=10_000), view("short", workers=1, curve=c, remaining=100)]
    assert Goodput(remaining_exponent=1.0).allocate(0, jobs, 5) == {"long": 1, "short": 4}


def test_goodput_does_not_grow_a_running_job_when_the_resize_cost_exceeds_the_gain() -> None:
    c = linear(1, 2)
    # on 1: 50 s left; on 2: 25 s + a 30 s resize = 55 s: stays
    stay = [view("a", workers=1, alloc=1, curve=c, remaining=50)]
    assert Goodput(resize_cost=30).allocate(0, stay, 2) == {"a": 1}
    # on 1: 100 s left; on 2: 50 s + 30 s = 80 s: grows
    grow = [view("a", workers=1, alloc=1, curve=c, remaining=100)]
    assert Goodput(resize_cost=30).allocate(0, grow, 2) == {"a": 2}


def test_goodput_admits_a_new_job_at_its_minimum_before_others_grow() -> None:
    c = linear(1, 8)
    jobs = [view("run", workers=4, alloc=4, curve=c, remaining=1e6), view("new", arrival=5, workers=4, curve=c,
                                                                          remaining=1e6)]
    assert Goodput(resize_cost=0).allocate(10, jobs, 5) == {"run": 4, "new": 1}
    # with only the running job's devices, a one-device job nearer completion is admitted first and "run" is
    # left the 3 others (a resize) rather than kept whole
    jobs[1] = view("new", arrival=5, workers=1, curve={1: 1.0}, remaining=100)
    assert Goodput(resize_cost=0).allocate(10, jobs, 4) == {"new": 1, "run": 3}
    # a job no nearer completion does not displace it
    jobs[1] = view("new", arrival=5, workers=1, curve={1: 1.0}, remaining=2e6)
    assert Goodput(resize_cost=0).allocate(10, jobs, 4) == {"run": 4}


def test_goodput_gives_a_starving_job_its_minimum_first() -> None:
    c = linear(1, 4)
    jobs = [view("busy", workers=4, alloc=4, curve=c, remaining=10), view("waits", workers=2, since=0,
                                                                      curve={2: 2.0, 3: 3.0}, remaining=1e9)]
    g = Goodput(resize_cost=0, starve_s=3600, admit_first=False)
    assert g.allocate(3599, jobs, 4) == {"busy": 4}
    assert g.allocate(3600, jobs, 4) == {"waits": 2, "busy": 2}


# the interface --------------------------------------------------------------------------------------------------

def test_make_policy_by_name_passes_the_options_its_class_takes() -> None:
    p = make_policy("round-robin", quantum=30.0, resize_cost=5.0, backfill=True)
    assert isinstance(p, RoundRobin) and p.quantum == 30.0
    assert make_policy("fifo", backfill=True).backfill is True  # type: ignore[attr-defined]
    with pytest.raises(PoolError, match="unknown policy 'lifo'"):
        make_policy("lifo")


def test_check_allocation_refuses_sizes_the_job_does_not_allow_and_overcommitment() -> None:
    jobs = [view("a", workers=2, curve={2: 2.0, 4: 4.0})]
    with pytest.raises(PoolError, match="job a: size 3 is not allowed"):
        check_allocation("p", {"a": 3}, jobs, 8)
    with pytest.raises(PoolError, match="allocated 4 devices of 2"):
        check_allocation("p", {"a": 4}, jobs, 2)
    with pytest.raises(PoolError, match="unknown job 'x'"):
        check_allocation("p", {"x": 1}, jobs, 2)
    assert check_allocation("p", {"a": 0}, jobs, 2) == {}
