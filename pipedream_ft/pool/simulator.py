"""A discrete-event simulator of a shared pool: the same policy objects, on a workload, with no processes.

Events are arrivals, completions and scheduling rounds (every ``round_s`` seconds; a policy is also asked at an
arrival or a completion). A job progresses at its allocation's predicted throughput; a resize, or resuming a
preempted job, costs ``resize_cost`` seconds during which the job holds its new devices but makes no progress
(the first start costs nothing). Completion times are exact (no time step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from .errors import PoolError
from .job import Job, JobView
from .policy import Policy, check_allocation, make_policy

__all__ = ["JobRecord", "PolicyResult", "percentile", "simulate", "job_sizes"]


@dataclass
class JobRecord:
    """One job's run: ``allocations`` is ``[[time, workers], ...]`` from its first start (0 = preempted)."""

    name: str
    model: str
    arrival: float
    work: float
    start: float | None = None
    finish: float | None = None
    allocations: list[list[float]] = field(default_factory=list)
    resizes: int = 0
    preemptions: int = 0
    queued: float = 0.0
    paused: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "arrival": self.arrival, "start": self.start,
                "finish": self.finish, "jct": None if self.finish is None else self.finish - self.arrival,
                "work": self.work, "allocations": [[t, int(n)] for t, n in self.allocations],
                "resizes": self.resizes, "preemptions": self.preemptions, "queued": self.queued}


@dataclass
class PolicyResult:
    """The metrics of one policy's run (seconds; ``utilization`` in 0..1) and its jobs."""

    policy: str
    avg_jct: float
    p50_jct: float
    p99_jct: float
    makespan: float
    avg_queue: float
    utilization: float
    productive_utilization: float
    resizes: int
    preemptions: int
    decisions: int
    jobs: list[JobRecord]

    def to_json(self) -> dict[str, Any]:
        return {"avg_jct": self.avg_jct, "p50_jct": self.p50_jct, "p99_jct": self.p99_jct,
                "makespan": self.makespan, "avg_queue": self.avg_queue, "utilization": self.utilization,
                "productive_utilization": self.productive_utilization, "resizes": self.resizes,
                "preemptions": self.preemptions, "decisions": self.decisions,
                "jobs": [j.to_json() for j in self.jobs]}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, as numpy's default."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def job_sizes(job: Job, devices: int) -> range:
    """The sizes a job may be given: ``min_workers..max_workers``, 1..``devices`` where not given."""
    lo = job.min_workers if job.min_workers is not None else 1
    hi = min(job.max_workers if job.max_workers is not None else devices, devices)
    return range(lo, hi + 1)


class _State:
    __slots__ = ("job", "rec", "curve", "rate_of", "remaining", "alloc", "since", "attained", "started",
                 "paused_until", "done_at")

    def __init__(self, job: Job, curve: Mapping[int, float], work: float) -> None:
        self.job = job
        self.curve = MappingProxyType(dict(curve))
        self.rec = JobRecord(job.name, job.model, job.arrival, work)
        self.remaining = work
        self.alloc = 0
        self.since = job.arrival
        self.attained = 0.0
        self.started = False
        self.paused_until = -math.inf
        self.done_at = math.inf

    def view(self) -> JobView:
        j = self.job
        sizes = self.curve
        return JobView(j.name, j.arrival, j.workers, min(sizes), max(sizes), j.priority, self.alloc, self.since,
                       self.attained, self.remaining, self.rec.work, self.started, sizes)

    def project(self, now: float) -> None:
        self.done_at = (max(now, self.paused_until) + self.remaining / self.curve[self.alloc]
                        if self.alloc else math.inf)


def simulate(jobs: Sequence[Job], curves: Mapping[str, Mapping[int, float]], policy: str | Policy, *,
             devices: int, round_s: float = 60.0, resize_cost: float = 30.0,
             switches: Sequence[tuple[float, str | Policy]] = (), policy_options: Mapping[str, Any] | None = None,
             name: str | None = None, on_decision: Callable[[float, dict[str, int]], None] | None = None
             ) -> PolicyResult:
    """Run ``policy`` on ``jobs``. ``curves[job name]`` maps each size the job may be given to minibatches per
    second (it must hold the job's ``workers``); a job's work is ``duration x curves[name][workers]``.
    ``switches`` are ``(time, policy)``: from the first round at or after ``time`` that policy decides,
    starting from the current allocation."""
    if devices < 1:
        raise PoolError(f"devices must be >= 1, got {devices}")
    if not round_s > 0:
        raise PoolError(f"round_s must be > 0, got {round_s}")
    if not resize_cost >= 0:
        raise PoolError(f"resize_cost must be >= 0, got {resize_cost}")
    opts = dict(policy_options or {})
    opts.setdefault("resize_cost", resize_cost)

    def build(p: str | Policy) -> tuple[str, Policy]:
        return (p, make_policy(p, **opts)) if isinstance(p, str) else (type(p).__name__, p)

    label, current = build(policy)
    pending_switches = sorted(((float(t), build(p)) for t, p in switches), key=lambda s: s[0])
    label = name or "".join([label] + [f">{t:g}:{n}" for t, (n, _) in pending_switches])
    states: list[_State] = []
    for job in jobs:
        curve = curves.get(job.name)
        if not curve or job.workers not in curve:
            raise PoolError(f"job {job.name}: no throughput for its {job.workers} workers")
        states.append(_State(job, curve, job.duration * curve[job.workers]))
    arrivals = sorted(states, key=lambda s: (s.job.arrival, s.job.name))
    nxt_arrival = 0
    active: list[_State] = []
    done: list[_State] = []
    now = arrivals[0].job.arrival if arrivals else 0.0
    next_round = math.ceil(now / round_s) * round_s
    busy = productive = 0.0
    resizes = preemptions = decisions = 0
    idle_rounds = 0
    while nxt_arrival < len(arrivals) or active:
        t_arr = arrivals[nxt_arrival].job.arrival if nxt_arrival < len(arrivals) else math.inf
        t_done = min((s.done_at for s in active), default=math.inf)
        if not active:
            next_round = max(next_round, math.ceil(t_arr / round_s) * round_s)
        t = min(t_arr, t_done, next_round)
        # progress up to t
        for s in active:
            if s.alloc:
                dt = t - now
                busy += s.alloc * dt
                s.attained += s.alloc * dt
                run = t - max(now, s.paused_until)
                if run > 0:
                    productive += s.alloc * run
                    s.remaining -= s.curve[s.alloc] * run
                    s.rec.paused += dt - run
                else:
                    s.rec.paused += dt
            else:
                s.rec.queued += t - now
        now = t
        decide = False
        finished = [s for s in active if s.done_at <= now]
        for s in finished:
            s.remaining = 0.0
            s.rec.finish = s.done_at
            active.remove(s)
            done.append(s)
            decide = True
        while nxt_arrival < len(arrivals) and arrivals[nxt_arrival].job.arrival <= now:
            s = arrivals[nxt_arrival]
            s.since = s.job.arrival
            active.append(s)
            nxt_arrival += 1
            decide = True
        if now >= next_round:
            next_round += round_s
            while pending_switches and pending_switches[0][0] <= now:
                _, (_, current) = pending_switches.pop(0)
            decide = True
        if not decide or not active:
            continue
        views = [s.view() for s in active]
        want = check_allocation(label, current.allocate(now, views, devices), views, devices)
        decisions += 1
        if on_decision is not None:
            on_decision(now, want)
        for s in active:
            a, b = s.alloc, want.get(s.job.name, 0)
            if a == b:
                continue
            if b == 0:
                preemptions += 1
                s.rec.preemptions += 1
                s.since = now
            elif a == 0:
                if s.started:
                    s.paused_until = now + resize_cost
                else:
                    s.started = True
                    s.rec.start = now
                s.since = now
            else:
                resizes += 1
                s.rec.resizes += 1
                s.paused_until = now + resize_cost
            s.alloc = b
            s.rec.allocations.append([now, b])
            s.project(now)
        if any(s.alloc for s in active) or nxt_arrival < len(arrivals):
            idle_rounds = 0
        else:
            idle_rounds += 1
            if idle_rounds > 100_000:
                raise PoolError(f"policy {label}: {len(active)} jobs wait forever with the pool idle (e.g. "
                                f"{active[0].job.name})")
    recs = [s.rec for s in states]
    jcts = [r.finish - r.arrival for r in recs]  # type: ignore[operator]
    first = min(r.arrival for r in recs)
    makespan = max(r.finish for r in recs) - first  # type: ignore[type-var]
    cap = devices * makespan
    return PolicyResult(label, sum(jcts) / len(jcts), percentile(jcts, 50), percentile(jcts, 99), makespan,
                        sum(r.queued for r in recs) / len(recs), busy / cap if cap else 0.0,
                        productive / cap if cap else 0.0, resizes, preemptions, decisions, recs)
