"""PipeDream's partitioning dynamic program, solved exactly and fast.

The problem (Narayanan et al., SOSP'19, §3.1): cut the model's antichain states (see
:mod:`partitioner.antichain`) into a chain of stages ``(start, j_1], (j_1, j_2], ..., (j_{n-1}, last]``, give
stage ``s`` ``r_s >= 1`` replicas with ``Σ r_s`` equal to the level's worker count ``M`` (every worker is
used, as in PipeDream without ``--use_fewer_machines``), and minimise the slowest stage's time under the
cost model of :mod:`partitioner.cost`. ``straight=True`` forces ``r_s = 1`` (so exactly ``M`` stages). A stage
that holds some but not all layers of a tied group gets ``r_s = 1``: the holders of a tied parameter exchange
its gradients replica by replica, so the runtime needs equal replica counts on them (the optimum is exact
under that rule; a hierarchy whose inner levels would still replicate a holder is planned straight).

PipeDream evaluates ``A[j][m] = min_{k, m'} max(A[k][m-m'], t(k, j, m'))`` directly, ``O(S² M²)`` per level
(``O(S³ M²)`` for inner levels). The outermost level is solved here by searching the optimum value instead:

* for a threshold ``T``, the stage ``(k, j]`` is allowed with ``r`` replicas iff ``t(k, j, r) <= T``. For
  ``r >= 2`` the time is non-increasing in ``r`` (``C/r + 4P(r-1)/(B r²)`` and ``2o/(B r)`` both are), so the
  allowed replica counts are ``{1 if t(k,j,1) <= T} ∪ [ρ(k,j), ∞)``, with ``ρ`` from the root of
  ``T r² - (C + 4P/B) r + 4P/B >= 0`` and ``r >= 2o/(B T)`` (checked exactly against the cost formulas);
* the sets ``G_k`` of worker counts that can cover ``(k, last]`` are then ``{0}`` for the last state and
  ``⋃_j (G_j + 1 if allowed) ∪ [min G_j + ρ(k,j), ∞)``: bitsets, one vectorised step per state;
* the optimum is the smallest float ``T`` that is feasible. Feasibility is monotone in ``T``, so bisection
  over the ordered bit patterns of floats finds it exactly (each feasible probe also lowers the upper bound
  to the time of the plan it found).

With a memory limit the bitset becomes the least number of stages ``D[k][n]`` that cover ``(k, last]`` with
``n`` workers (a stage ``d`` places from the end needs ``d · (P + A)`` bytes, see :mod:`partitioner.cost`),
with prefix minima over ``n`` replacing the replica loop.

Hierarchical machines (``workers=[n_1, n_2, ...]``, innermost first) follow PipeDream: every inner level
computes, for every range of states, the best time with all of its ``n_l`` workers (a direct, vectorised DP
over all start states at once); the next level uses that time as the range's compute time, with its own
bandwidth and ``w = n_l``. Inner ranges are properly nested (PipeDream also lets an inner range start at a
state that is not below its end; those combinations have no physical meaning and are left out — on
PipeDream's own profiles the optimum is the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from profiler.profile import Profile

from . import cost
from .antichain import AntichainStates, linearize
from .chain import flat_upper_plan, plan_chain
from .contract import contract, place_values
from .machine import MachineProfile
from .plan import Plan, PlanError, aligned_ranks

__all__ = ["partition", "LevelProblem", "LevelSolution", "flat_problem", "solve_level", "exhaustive_level", "stage_times"]

_INF = math.inf


@dataclass
class LevelProblem:
    """One level of the search: stage times over antichain states for ``workers`` workers.

    ``first_compute[j]`` / ``first_params[j]`` describe the first stage ``(start, j]``; ``pair_compute[k, j]``
    / ``pair_params[k, j]`` the stage ``(k, j]`` (``inf`` compute where ``k`` cannot precede ``j``).
    """

    first_compute: np.ndarray
    first_params: np.ndarray
    pair_compute: np.ndarray
    pair_params: np.ndarray
    out_bytes: np.ndarray
    workers: int
    bandwidth: float
    within: int = 1
    straight: bool = False
    first_memory: np.ndarray | None = None
    """``P + A`` of the first stage ``(start, j]`` (per place from the end); None: no memory limit."""
    pair_memory: np.ndarray | None = None
    memory_bytes: float | None = None
    first_single: np.ndarray | None = None
    """Ranges ``(start, j]`` that may not be replicated (they hold part of a tied group); None: any may be."""
    pair_single: np.ndarray | None = None
    """The same for the ranges ``(k, j]``."""

    def replicable_first(self, j):
        return True if self.first_single is None else ~np.asarray(self.first_single)[j]

    def replicable_pair(self, k, j):
        return True if self.pair_single is None else ~np.asarray(self.pair_single)[k, j]

    @property
    def num_states(self) -> int:
        return len(self.first_compute)

    # -- stage times ----------------------------------------------------------------------------------

    def first_time(self, j, r):
        return cost.first_stage_time(self.first_compute[j], self.first_params[j], r, self.bandwidth, self.within)

    def out_of(self, j):
        last = self.num_states - 1
        return np.where(np.asarray(j) == last, 0.0, self.out_bytes[j])

    def pair_time(self, k, j, r):
        return cost.stage_time(self.pair_compute[k, j], self.pair_params[k, j], r, self.bandwidth,
                               self.out_bytes[k], self.out_of(j))


@dataclass(frozen=True)
class LevelSolution:
    time_s: float
    cuts: list[int]
    """Last state of each stage."""
    replicas: list[int]
    stage_times: list[float]


# ----------------------------------------------------------------------------------------------------------
# threshold search for the outermost level


class _Search:
    """Precomputed per-pair quantities for feasibility checks of one level.

    Pairs ``(k, j)`` with ``k`` preceding ``j`` are kept flat, sorted by ``k``, so the successors of ``k``
    are the slice ``lo[k]:lo[k+1]``.
    """

    def __init__(self, prob: LevelProblem) -> None:
        self.p = prob
        s = prob.num_states
        self.S = s
        self.M = prob.workers
        valid = np.isfinite(np.asarray(prob.pair_compute, float))
        kk, jj = np.nonzero(valid)  # row-major: sorted by k
        self.kk, self.jj = kk, jj
        self.lo = np.searchsorted(kk, np.arange(s + 1))
        self.C = np.asarray(prob.pair_compute, float)[kk, jj]
        self.P = np.asarray(prob.pair_params, float)[kk, jj]
        self.oin = prob.out_bytes[kk]
        self.oout = np.where(jj == s - 1, 0.0, prob.out_bytes[jj])
        bw = prob.bandwidth
        self.D = 4.0 * self.P / bw
        self.X = np.maximum(self.oin, self.oout)
        self.t1 = self.pair_time(1)
        self.valid0 = np.isfinite(prob.first_compute)
        self.C0 = np.where(self.valid0, prob.first_compute, 0.0)
        self.P0 = np.where(self.valid0, prob.first_params, 0.0)
        self.D0 = 4.0 * self.P0 / (bw * prob.within)
        self.t01 = np.where(self.valid0, self.first_time(1), _INF)
        # per-probe replica counts come from T r^2 - (C + D) r + D >= 0 and r >= 2 X / (B T): keep what is fixed
        with np.errstate(invalid="ignore", over="ignore"):
            b = self.C + self.D
            rep = np.ones(len(b), bool) if prob.pair_single is None else ~np.asarray(prob.pair_single)[kk, jj]
            self._pair_root = (b, b * b, self.D, 2.0 * self.X / bw, rep)
            b0 = self.C0 + self.D0
            rep0 = self.valid0 if prob.first_single is None else self.valid0 & ~np.asarray(prob.first_single)
            self._first_root = (b0, b0 * b0, self.D0, None, rep0)
        if prob.pair_memory is not None:
            lim = float(prob.memory_bytes)
            self.dmax = self._depth_limit(np.asarray(prob.pair_memory, float)[kk, jj], lim)
            self.dmax0 = self._depth_limit(prob.first_memory, lim)

    def pair_time(self, r, sel=slice(None)):
        p = self.p
        return cost.stage_time(self.C[sel], self.P[sel], r, p.bandwidth, self.oin[sel], self.oout[sel])

    def first_time(self, r, sel=slice(None)):
        p = self.p
        return cost.first_stage_time(self.C0[sel], self.P0[sel], r, p.bandwidth, p.within)

    @staticmethod
    def _depth_limit(unit: np.ndarray, limit: float) -> np.ndarray:
        """Largest ``d`` with ``d · unit <= limit`` (as the cost model computes it), capped at 2**30."""
        unit = np.asarray(unit, float)
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.floor(np.where(unit > 0, limit / unit, 2.0**30))
        d = np.minimum(d, 2.0**30)
        d = np.where(cost.stage_memory(unit, 0.0, d) > limit, d - 1, d)
        d = np.where(cost.stage_memory(unit, 0.0, d + 1) <= limit, np.minimum(d + 1, 2.0**30), d)
        return np.where(np.isnan(d), -1, d).astype(np.int64)

    # allowed replica counts ---------------------------------------------------------------------------

    def _rho(self, T: float, root, time_fn) -> np.ndarray:
        """Smallest ``r >= 2`` with ``time(r) <= T`` (``M + 1`` if none), exact w.r.t. ``time_fn``.

        ``root`` holds ``(b, b², D, 2X/B or None, replicable)`` with ``b = C + D``. The closed form gives the answer
        up to rounding; the counts whose estimate lies within a relative 1e-6 of a whole number are settled by
        evaluating the cost formula itself.
        """
        b, bb, D, x2, valid = root
        M = self.M
        big = M + 1
        n = np.shape(b)[0]
        if self.p.straight or M < 2 or T <= 0:
            return np.full(n, big, dtype=np.int64)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            disc = bb - (4.0 * T) * D
            flat = disc <= 0  # T r^2 - b r + D >= 0 for every r
            np.maximum(disc, 0.0, out=disc)
            est = np.sqrt(disc, out=disc)
            est += b
            est /= 2.0 * T
            est[flat] = 0.0
            if x2 is not None:
                np.maximum(est, x2 * (1.0 / T), out=est)
            est = np.where(valid & np.isfinite(est), np.minimum(est, big), big)
        # only an estimate within rounding of a count in 2..M can be off by one
        whole = np.rint(est)
        near = (np.abs(est - whole) <= 1e-6 * est) & (whole >= 2) & (whole <= M)
        idx = np.nonzero(near)[0]
        est = np.maximum(est, 2.0)
        r = np.ceil(est).astype(np.int64)
        if len(idx):
            rr = np.minimum(np.rint(est[idx]).astype(np.int64) + 2, big)
            rr = np.maximum(rr, 2)
            for _ in range(4):  # walk down from just above the estimate while the smaller count still fits
                cand = rr - 1
                live = (cand >= 2) & (cand <= M)
                t = time_fn(np.where(live, cand, 2), idx)
                rr = np.where(live & (t <= T), cand, rr)
            live = rr <= M
            t = time_fn(np.where(live, rr, 2), idx)
            rr = np.where(live & (t > T), big, rr)  # not even the upper candidate fits
            r[idx] = rr
        return np.minimum(r, big)

    def allowed(self, T: float):
        ok1 = self.t1 <= T
        rho = self._rho(T, self._pair_root, self.pair_time)
        ok01 = self.t01 <= T
        rho0 = self._rho(T, self._first_root, self.first_time)
        return ok1, rho, ok01, rho0

    # feasibility -------------------------------------------------------------------------------------

    def feasible(self, T: float):
        """Return the per-state reachability table if some plan has every stage ``<= T``, else None."""
        if self.p.pair_memory is not None:
            return self._feasible_depth(T)
        return self._feasible_bits(T)

    def _feasible_bits(self, T: float):
        S, M = self.S, self.M
        ok1, rho, ok01, rho0 = self.allowed(T)
        full = (1 << (M + 1)) - 1
        G = [0] * S
        words = (M + 64) // 64
        Gw = np.zeros((S, words), dtype=np.uint64)
        minG = np.full(S, 1 << 40, dtype=np.int64)
        G[S - 1] = 1
        Gw[S - 1, 0] = 1
        minG[S - 1] = 0
        lo, jj = self.lo, self.jj
        for k in range(S - 2, -1, -1):
            a, b = lo[k], lo[k + 1]
            if a == b:
                continue
            js = jj[a:b]
            sel = js[ok1[a:b]]
            acc = 0
            if len(sel):
                red = np.bitwise_or.reduce(Gw[sel], axis=0)
                for w in range(words - 1, -1, -1):
                    acc = (acc << 64) | int(red[w])
                acc <<= 1
            t = int(np.min(minG[js] + rho[a:b]))
            if t <= M:
                acc |= full ^ ((1 << t) - 1)
            acc &= full
            if acc:
                G[k] = acc
                minG[k] = (acc & -acc).bit_length() - 1
                for w in range(words):
                    Gw[k, w] = (acc >> (64 * w)) & 0xFFFFFFFFFFFFFFFF
        # the first stage (start, j] with r workers needs M - r in G[j]
        for j in range(S):
            g = G[j]
            if not g:
                continue
            if (ok01[j] and (g >> (M - 1)) & 1) or minG[j] <= M - rho0[j]:
                return ("bits", G, T)
        return None

    def _feasible_depth(self, T: float):
        S, M = self.S, self.M
        ok1, rho, ok01, rho0 = self.allowed(T)
        BIG = 1 << 40
        D = np.full((S, M + 1), BIG, dtype=np.int64)
        PM = np.full((S, M + 1), BIG, dtype=np.int64)
        D[S - 1, 0] = 0
        PM[S - 1] = 0
        n = np.arange(M + 1)
        for k in range(S - 2, -1, -1):
            a, b = self.lo[k], self.lo[k + 1]
            if a == b:
                continue
            js = self.jj[a:b]
            one = np.where(ok1[a:b][:, None] & (n[None, :] >= 1), D[js][:, np.maximum(n - 1, 0)], BIG)
            idx = n[None, :] - rho[a:b][:, None]
            ray = np.where(idx >= 0, PM[js[:, None], np.maximum(idx, 0)], BIG)
            cand = np.minimum(one, ray) + 1
            cand = np.where(cand <= self.dmax[a:b][:, None], cand, BIG)
            D[k] = cand.min(axis=0)
            PM[k] = np.minimum.accumulate(D[k])
        for j in range(S):
            if ok01[j] and D[j, M - 1] + 1 <= self.dmax0[j]:
                return ("depth", D, T)
            r0 = int(rho0[j])
            if r0 <= M and PM[j, M - r0] + 1 <= self.dmax0[j]:
                return ("depth", D, T)
        return None

    # candidates ---------------------------------------------------------------------------------------

    def candidates(self, lo: float, hi: float, limit: int = 2_000_000) -> np.ndarray | None:
        """Every stage time in ``(lo, hi]`` (sorted, unique), or None if there are more than ``limit``."""
        r_hi = self.allowed(hi)
        r_lo = self.allowed(lo)
        parts = []
        for t1, rh, rl, time_fn in ((self.t1, r_hi[1], r_lo[1], self.pair_time),
                                    (self.t01, r_hi[3], r_lo[3], self.first_time)):
            parts.append(t1[(t1 > lo) & (t1 <= hi)])
            cnt = np.maximum(rl - rh, 0)
            cnt = np.where(rh <= self.M, cnt, 0)
            total = int(cnt.sum())
            if total > limit:
                return None
            if total:
                idx = np.repeat(np.arange(len(cnt)), cnt)
                start = np.repeat(np.cumsum(cnt) - cnt, cnt)
                r = rh[idx] + (np.arange(total) - start)
                parts.append(time_fn(r, idx))
        vals = np.concatenate(parts) if parts else np.zeros(0)
        vals = vals[(vals > lo) & (vals <= hi)]
        return np.unique(vals)

    # plan reconstruction ------------------------------------------------------------------------------

    def witness(self, table) -> LevelSolution:
        """A plan with every stage within the table's threshold (longest stages preferred)."""
        kind, tab, T = table
        p, S, M = self.p, self.S, self.M
        ok1, rho, ok01, rho0 = self.allowed(T)

        need = [None]  # depth mode: stages still to place, which the next choice must match exactly

        def fits(j: int, n: int, depth: int) -> bool:
            if n < 0:
                return False
            if kind == "bits":
                return bool((tab[j] >> n) & 1)
            d = int(tab[j, n]) + 1
            return d <= depth and (need[0] is None or d == need[0])

        cuts: list[int] = []
        reps: list[int] = []
        prev = None
        n = M
        while True:
            found = None
            if prev is None:
                cand = [(j, bool(ok01[j]), int(rho0[j]), int(self.dmax0[j]) if kind == "depth" else 0)
                        for j in range(S)]
            else:
                a, b = self.lo[prev], self.lo[prev + 1]
                cand = [(int(self.jj[i]), bool(ok1[i]), int(rho[i]), int(self.dmax[i]) if kind == "depth" else 0)
                        for i in range(a, b)]
            for j, a1, r0, lim in sorted(cand, reverse=True):
                rs = ([1] if a1 else []) + list(range(max(r0, 2), n + 1))
                for r in rs:
                    if fits(j, n - r, lim):
                        found = (j, r)
                        break
                if found:
                    break
            assert found is not None, "feasibility table without a witness"
            j, r = found
            cuts.append(j)
            reps.append(r)
            n -= r
            if kind == "depth":
                need[0] = int(tab[j, n])
            prev = j
            if j == S - 1:
                break
        times = stage_times(p, cuts, reps)
        return LevelSolution(max(times), cuts, reps, times)


def stage_times(prob: LevelProblem, cuts: Sequence[int], reps: Sequence[int]) -> list[float]:
    """Predicted time of each stage of a level plan (``cuts`` = last state of each stage)."""
    out = []
    prev = None
    for j, r in zip(cuts, reps):
        if prev is None:
            out.append(float(prob.first_time(j, r)))
        else:
            out.append(float(prob.pair_time(prev, j, r)))
        prev = j
    return out


def _bits(x: float) -> int:
    return int(np.array(x, dtype=np.float64).view(np.int64))


def _float(b: int) -> float:
    return float(np.array(b, dtype=np.int64).view(np.float64))


def solve_level(prob: LevelProblem, lower_bound: float = 0.0,
                upper: tuple[Sequence[int], Sequence[int]] | None = None) -> LevelSolution | None:
    """The exact optimum of one level (None if no plan exists).

    ``lower_bound`` (optional) must not exceed the optimum; it only shortens the search. ``upper``
    (optional) is a plan of this level, as (last state of each stage, replicas): if nothing is faster it is
    returned after one test, else the search starts from it.
    """
    search = _Search(prob)
    if upper is not None:
        cuts, reps = [int(j) for j in upper[0]], [int(r) for r in upper[1]]
        times = stage_times(prob, cuts, reps)
        below = float(np.nextafter(max(times), -np.inf))
        table = search.feasible(below) if below >= 0 else None
        if table is None:
            return LevelSolution(max(times), cuts, reps, times)
        return _narrow(search, search.witness(table), lower_bound)
    with np.errstate(invalid="ignore"):
        cands = [search.t1, search.t01]
        if prob.workers >= 2 and not prob.straight:
            cands.append(np.where(search._pair_root[4], search.pair_time(2), _INF))
            cands.append(np.where(search._first_root[4], search.first_time(2), _INF))
    vals = np.concatenate([np.ravel(c) for c in cands])
    vals = vals[np.isfinite(vals)]
    if len(vals) == 0:
        return None
    # every plan's stages are no slower than the slowest 1- or 2-replica time of some stage
    table = search.feasible(float(vals.max()))
    if table is None:
        return None
    return _narrow(search, search.witness(table), lower_bound)


def _narrow(search: _Search, best: LevelSolution, lower_bound: float) -> LevelSolution:
    """The optimum, given a feasible plan ``best`` (bisection over float bits, then over candidate times)."""
    hi_bits = _bits(best.time_s)
    lo_bits = -1  # stands for the (infeasible) value just below +0.0
    if best.time_s > 0:
        lb = lower_bound * (1.0 - 1e-9)
        if 0 < lb < best.time_s and search.feasible(lb) is None:
            lo_bits = _bits(lb)
        else:
            table = search.feasible(0.0)
            if table is not None:
                return search.witness(table)
            lo_bits = 0
    while hi_bits - lo_bits > 1:
        if hi_bits - lo_bits < (1 << 40):  # narrow: list the remaining candidate times
            vals = search.candidates(_float(lo_bits) if lo_bits >= 0 else -1.0, _float(hi_bits))
            if vals is not None:
                lo_i, hi_i = -1, len(vals) - 1  # vals[hi_i] == current best (feasible)
                while hi_i - lo_i > 1:
                    mid = (lo_i + hi_i) // 2
                    table = search.feasible(float(vals[mid]))
                    if table is None:
                        lo_i = mid
                    else:
                        best = search.witness(table)
                        hi_i = int(np.searchsorted(vals, best.time_s))
                return best
        mid = (lo_bits + hi_bits) // 2
        table = search.feasible(_float(mid))
        if table is None:
            lo_bits = mid
        else:
            best = search.witness(table)
            hi_bits = _bits(best.time_s)
    return best


# ----------------------------------------------------------------------------------------------------------
# exhaustive reference (tests)


def exhaustive_level(prob: LevelProblem) -> float | None:
    """Brute force over every chain of states and replica split (for tests; exponential)."""
    S, M = prob.num_states, prob.workers
    best = [None]

    def rec(prev: int | None, used: int, worst: float, depth_info: list):
        for j in range(S):
            if prev is None:
                if not np.isfinite(prob.first_compute[j]):
                    continue
            elif not np.isfinite(prob.pair_compute[prev, j]):
                continue
            single = prob.straight or not (prob.replicable_first(j) if prev is None
                                           else prob.replicable_pair(prev, j))
            for r in ([1] if single else range(1, M - used + 1)):
                if used + r > M:
                    continue
                t = float(prob.first_time(j, r) if prev is None else prob.pair_time(prev, j, r))
                path = depth_info + [(prev, j, r)]
                if j == S - 1:
                    if used + r == M and _memory_ok(prob, path):
                        w = max(worst, t)
                        if best[0] is None or w < best[0]:
                            best[0] = w
                else:
                    rec(j, used + r, max(worst, t), path)

    rec(None, 0, 0.0, [])
    return best[0]


def _memory_ok(prob: LevelProblem, path) -> bool:
    if prob.pair_memory is None:
        return True
    n = len(path)
    for s, (k, j, r) in enumerate(path):
        unit = prob.first_memory[j] if k is None else prob.pair_memory[k, j]
        if cost.stage_memory(unit, 0.0, n - s) > prob.memory_bytes:
            return False
    return True


# ----------------------------------------------------------------------------------------------------------
# inner levels: best time of every range with all of a level's workers


def _inner_level(states: AntichainStates, CM: np.ndarray, PMx: np.ndarray, workers: int, bandwidth: float,
                 within: int, straight: bool):
    """``A[row, j]`` = best time of the range (row-1, j] (row 0: from the start) with exactly ``workers``.

    Returns (value matrix ``(S+1, S)``, choice arrays) where choices give, per (row, j, m), the last stage's
    start state (-1: single stage) and its replica count.
    """
    S = states.num_states
    M = workers
    prec = states.precedes
    o = states.output_bytes
    A = np.full((S + 1, S, M), _INF)
    split = np.full((S + 1, S, M), -1, dtype=np.int32)
    reps = np.zeros((S + 1, S, M), dtype=np.int32)
    rows_ok = np.zeros((S + 1, S), dtype=bool)
    rows_ok[0] = True
    rows_ok[1:] = prec
    mm = np.arange(1, M + 1)
    with np.errstate(invalid="ignore"):
        base = cost.first_stage_time(CM[:, :, None], PMx[:, :, None], mm[None, None, :], bandwidth, within)
    base = np.where(rows_ok[:, :, None] & np.isfinite(CM)[:, :, None], base, _INF)
    if straight:
        base[:, :, 1:] = _INF
    A[:] = base
    reps[:] = mm[None, None, :]
    last = S - 1
    for j in range(S):
        K = np.nonzero(prec[:, j])[0]
        rows = np.nonzero(rows_ok[:, j])[0]
        if len(K) == 0 or M < 2:
            continue
        mprime = np.arange(1, 2 if straight else M)
        with np.errstate(invalid="ignore"):
            c = cost.stage_time(CM[K + 1, j][:, None], PMx[K + 1, j][:, None], mprime[None, :], bandwidth,
                                o[K][:, None], (0.0 if j == last else o[j]))
        c = np.where(np.isfinite(CM[K + 1, j])[:, None], c, _INF)
        sub = A[np.ix_(rows, K)]  # (R, K, M)
        for m in range(1, M):
            mp = mprime[mprime <= m]
            prev = sub[:, :, m - mp]  # (R, K, len(mp))
            tot = np.maximum(prev, c[None, :, : len(mp)])
            flat = tot.reshape(len(rows), -1)
            arg = np.argmin(flat, axis=1)
            val = flat[np.arange(len(rows)), arg]
            better = val < A[rows, j, m]
            if np.any(better):
                r_b = rows[better]
                A[r_b, j, m] = val[better]
                split[r_b, j, m] = K[arg[better] // len(mp)]
                reps[r_b, j, m] = mp[arg[better] % len(mp)]
    return A[:, :, M - 1], (split, reps)


def _inner_path(choices, row: int, j: int, m: int) -> list[tuple[int, int, int]]:
    """Stages (row, end, replicas) of an inner-level range, in pipeline order."""
    split, reps = choices
    out = []
    while True:
        k = int(split[row, j, m])
        r = int(reps[row, j, m])
        if k < 0:
            out.append((row, j, r))
            break
        out.append((k + 1, j, r))
        m -= r
        j = k
    return out[::-1]


# ----------------------------------------------------------------------------------------------------------
# public entry point


def _check_inputs(workers: Sequence[int], bandwidth: Sequence[float], memory_bytes: float | None) -> None:
    if len(workers) == 0:
        raise PlanError("workers: at least one level is needed")
    if len(workers) != len(bandwidth):
        raise PlanError(f"workers has {len(workers)} levels but bandwidth has {len(bandwidth)}")
    for n in workers:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise PlanError(f"workers: each level needs a positive whole number of workers, got {n!r}")
    for b in bandwidth:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
            raise PlanError(f"bandwidth: each level needs a positive finite bandwidth in bytes/s, got {b!r}")
    if memory_bytes is not None:
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float)) \
                or not math.isfinite(memory_bytes) or memory_bytes <= 0:
            raise PlanError(f"memory_bytes must be a positive number of bytes, got {memory_bytes!r}")


def _ranges(states: AntichainStates) -> tuple[np.ndarray, np.ndarray]:
    """Compute seconds and parameter bytes of every range of states, ``(S+1, S)`` each.

    Row 0 is the first stage ``(start, j]``, row ``k+1`` the stage ``(k, j]`` (``inf`` compute where ``k``
    does not precede ``j``).
    """
    C, P = states.compute_s, states.parameter_bytes
    prec = states.precedes
    S = states.num_states
    CM = np.full((S + 1, S), _INF)
    CM[0] = C
    CM[1:] = np.where(prec, C[None, :] - C[:, None], _INF)
    PMx = np.zeros((S + 1, S))
    PMx[0] = P
    PMx[1:] = np.where(prec, P[None, :] - P[:, None], 0.0)
    return CM, PMx


def _tied_terms(states: AntichainStates, bandwidth: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Extra compute seconds and parameter bytes of every range (as :func:`_ranges`) from tied groups.

    A range that splits a group pays its sync time at ``bandwidth``; a holder without the group's first user
    gets a copy of the parameter (see :mod:`partitioner.cost`). None when the profile has no tied groups.
    """
    if len(states.tied_bytes) == 0:
        return None
    S = states.num_states
    extra_c = np.zeros((S + 1, S))
    extra_p = np.zeros((S + 1, S))
    for g in range(len(states.tied_bytes)):
        cnt = np.concatenate([[0], states.tied_counts[g]])  # row r: state r-1; row 0: before the start
        first = np.concatenate([[False], states.tied_first[g]])
        held = cnt[None, 1:] - cnt[:, None]  # layers of the group inside the range
        split = (held > 0) & (held < states.tied_sizes[g])
        copy = (held > 0) & ~(first[None, 1:] & ~first[:, None])
        extra_c += np.where(split, cost.tied_sync_time(states.tied_bytes[g], bandwidth), 0.0)
        extra_p += np.where(copy, states.tied_bytes[g], 0.0)
    valid = np.ones((S + 1, S), dtype=bool)
    valid[1:] = states.precedes
    return np.where(valid, extra_c, 0.0), np.where(valid, extra_p, 0.0)


def _unequal_tied_holders(profile: Profile, stage_layers: Sequence[Sequence[int]], replicas: Sequence[int]) -> bool:
    """Whether the stages holding a tied group (some of its layers) have different replica counts."""
    stage_of = {i: s for s, layers in enumerate(stage_layers) for i in layers}
    for g in profile.tied:
        holders = {stage_of[i] for i in g.layers if i in stage_of}
        if len(holders) > 1 and len({replicas[h] for h in holders}) > 1:
            return True
    return False


def _tied_split(states: AntichainStates) -> np.ndarray | None:
    """Ranges (as :func:`_ranges`) that hold some but not all layers of a tied group: their stage is a *holder*
    that exchanges the group's gradients with the other holders replica by replica, so it is planned with one
    replica (the runtime needs equal replica counts on all holders; one is the count every holder can have).
    None when the profile has no tied groups."""
    if len(states.tied_bytes) == 0:
        return None
    S = states.num_states
    split = np.zeros((S + 1, S), dtype=bool)
    for g in range(len(states.tied_bytes)):
        cnt = np.concatenate([[0], states.tied_counts[g]])
        held = cnt[None, 1:] - cnt[:, None]
        split |= (held > 0) & (held < states.tied_sizes[g])
    return split


def _with_tied(states: AntichainStates, bandwidth: float, CM: np.ndarray, PMx: np.ndarray, *, sync: bool = True
               ) -> tuple[np.ndarray, np.ndarray]:
    """``CM``/``PMx`` plus the tied-group copies and, with ``sync``, the sync time at ``bandwidth``."""
    terms = _tied_terms(states, bandwidth)
    if terms is None:
        return CM, PMx
    return (CM + terms[0] if sync else CM), PMx + terms[1]


def _folded(fold: cost.Fold | None, CM: np.ndarray, PMx: np.ndarray, with_compute: bool = True
            ) -> tuple[np.ndarray, np.ndarray]:
    """``CM + O`` (finite ranges, if ``with_compute``) and ``P + λ B_ar`` (ranges holding parameters) of a
    :class:`~partitioner.cost.Fold`; unchanged without one."""
    if fold is None:
        return CM, PMx
    if with_compute and fold.compute_offset:
        CM = np.where(np.isfinite(CM), CM + fold.compute_offset, CM)
    if fold.params_offset:
        PMx = np.where(PMx > 0, PMx + fold.params_offset, PMx)
    return CM, PMx


def flat_problem(states: AntichainStates, workers: int, bandwidth: float, straight: bool,
                  memory_bytes: float | None, fold: cost.Fold | None = None) -> LevelProblem:
    """The single-level problem of ``states`` for ``workers`` workers at ``bandwidth`` bytes/s (or, with a
    :class:`~partitioner.cost.Fold` of measured costs, at ``fold.bandwidth`` with folded bytes and times)."""
    CM, PMx = _with_tied(states, bandwidth if fold is None else fold.bandwidth, *_ranges(states))
    A = states.activation_bytes
    prec = states.precedes
    CMt, PMt = _folded(fold, CM, PMx)
    out = states.output_bytes if fold is None else fold.out_bytes(states.output_bytes)
    prob = LevelProblem(CMt[0].copy(), PMt[0].copy(), CMt[1:], PMt[1:], out, workers,
                        bandwidth if fold is None else fold.bandwidth, 1, straight)
    split = _tied_split(states)
    if split is not None:
        prob.first_single, prob.pair_single = split[0].copy(), split[1:]
    if memory_bytes is not None:
        prob.first_memory = PMx[0] + A
        prob.pair_memory = np.where(prec, PMx[1:] + (A[None, :] - A[:, None]), 0.0)
        prob.memory_bytes = float(memory_bytes)
    return prob


def _smallest_memory(states: AntichainStates, workers: int, bandwidth: float, straight: bool) -> float | None:
    """Least per-worker memory limit under which some plan exists (any time per minibatch)."""
    P, A = states.parameter_bytes, states.activation_bytes
    extra = float(np.sum(states.tied_bytes)) * states.num_states
    lo, hi = 0, _bits(float(states.num_states) * float(P[-1] + A[-1]) + extra + 1.0)
    prob = flat_problem(states, workers, bandwidth, straight, _float(hi))
    if _Search(prob).feasible(_INF) is None:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        prob = flat_problem(states, workers, bandwidth, straight, _float(mid))
        if _Search(prob).feasible(_INF) is None:
            lo = mid
        else:
            hi = mid
    return _float(hi)


def _levels(values: int | float | Sequence[int | float], what: str) -> list:
    """A one-level machine may be given as a scalar; numpy scalars become Python numbers."""
    if isinstance(values, (int, float, np.integer, np.floating)) and not isinstance(values, bool):
        values = [values]
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) and not isinstance(values, np.ndarray):
        raise PlanError(f"{what}: expected a number or a list of numbers (one per level), got {values!r}")
    out = []
    for v in values:
        if isinstance(v, np.integer):
            v = int(v)
        elif isinstance(v, np.floating):
            v = float(v)
        out.append(v)
    return out


def _contended(profile: Profile, machine: MachineProfile, workers: list[int], pipeline_s: float,
               stage_layers: list[list[int]], settings: dict) -> float:
    """``max(t_pipeline, Σ_s (C_s φ + O) / K)`` on a one-level machine (see :mod:`partitioner.cost`); ``φ`` is
    ``profile.meta["cpu_fraction"]`` (default 1). Records both terms in ``settings``."""
    phi = profile.meta.get("cpu_fraction", 1.0)
    if isinstance(phi, bool) or not isinstance(phi, (int, float)) or not 0 <= phi <= 1:
        raise PlanError(f"profile meta cpu_fraction must be a number in [0, 1], got {phi!r}")
    bound = 0.0
    if len(workers) == 1:
        compute = [sum(profile.layers[i].forward_ms + profile.layers[i].backward_ms for i in layers) / 1e3
                   for layers in stage_layers]
        cores = machine.effective_cores
        bound = cost.contention_bound(compute, machine.overhead_s, None if cores is None else cores, workers[0],
                                      float(phi))
    settings["pipeline_time_s"] = pipeline_s
    settings["contention_bound_s"] = bound
    return max(pipeline_s, bound)


def _balanced(profile: Profile, states: AntichainStates, prob: LevelProblem, sol: LevelSolution,
              processes: Sequence[int], overhead_s: float = 0.0) -> tuple[LevelSolution, float]:
    """``sol`` with its cuts balanced across ``processes`` (:func:`partitioner.balance.balance_bounds`) and the
    busiest process's time: its compute, and ``overhead_s`` (the runtime's fixed cost) per stage it runs. Cut
    position ``b`` is the start (0) or after state ``b - 1``."""
    from .balance import balance_bounds, layers_compute, process_loads

    compute = np.concatenate([[0.0], np.asarray(states.compute_s, dtype=np.float64) +
                              layers_compute(profile, states.removed_inputs)])  # inputs: always stage 0
    prec = states.precedes

    def between(lo: int, hi: int) -> np.ndarray:
        q = np.arange(lo + 1, hi)
        if q.size == 0:
            return q
        ok = prec[q - 1, hi - 1]
        if lo > 0:
            ok = ok & prec[lo - 1, q - 1]
        return q[ok]

    n = states.num_states  # the time of every stage (lo, hi], as the program counts it
    times = np.empty((n + 1, n + 1))
    times[0, 1:] = prob.first_time(np.arange(n), 1)
    times[1:, 1:] = prob.pair_time(np.arange(n)[:, None], np.arange(n)[None, :], 1)

    def stage_time(lo: Any, hi: Any) -> np.ndarray:
        return times[lo, hi]

    bounds = balance_bounds(compute, [0] + [c + 1 for c in sol.cuts], processes, between, stage_time,
                            lower_bound=sol.time_s)  # the program's optimum: no plan has a faster slowest stage
    cuts = [b - 1 for b in bounds[1:]]
    times = stage_times(prob, cuts, sol.replicas)
    loads = process_loads(compute, bounds, processes) + overhead_s * np.bincount(processes)
    return LevelSolution(max(times), cuts, list(sol.replicas), times), float(loads.max())


def partition(profile: Profile, workers: int | Sequence[int] | None,
              bandwidth: float | Sequence[float] | None = None, *, straight: bool = False,
              memory_bytes: float | None = None, machine: MachineProfile | None = None,
              processes: Sequence[int] | None = None) -> Plan:
    """Plan ``profile`` for ``workers`` (workers per level, innermost first) at ``bandwidth`` bytes/s per level.

    A one-level machine may be given by scalars (``partition(profile, 4, 1e9)``). Returns the plan of least
    predicted time per minibatch (PipeDream's optimum over the cuts of the profile's tensor layers: value
    layers are no cut points, see :mod:`partitioner.contract`; they are listed in ``Plan.recompute`` and
    placed with their earliest consumer). Raises :class:`PlanError` for bad settings, when no plan exists (a
    straight pipeline longer than the model has cut points), or when no plan fits ``memory_bytes`` per worker
    (the message gives the smallest limit that would).

    ``machine`` (a :class:`~partitioner.machine.MachineProfile` from ``pipedream-probe``) plans under the
    measured costs of :mod:`partitioner.cost` (latencies, measured all-reduce, the runtime's fixed cost per
    stage); ``bandwidth`` may then be None (the machine's levels give it; if given it must be the machine's) and
    ``workers`` may be None (the machine's). The plan's ``settings["machine"]`` records the profile, so a re-plan uses
    it again. With no measured terms it gives PipeDream's plan.

    ``processes`` (a straight one-level plan only): the process of each stage, for the schedules that give a
    process several stages (:func:`partitioner.balance.virtual_placement`). The program's plan is then balanced
    so that the busiest process holds the least compute it can (:mod:`partitioner.balance`), and the predicted
    time per minibatch is the busiest process's compute if that exceeds the slowest stage's time. Without a
    memory limit only (under one the program's plan, which fits, is kept).
    """
    if machine is not None:
        if bandwidth is not None and _levels(bandwidth, "bandwidth") != machine.bandwidth:
            raise PlanError(f"bandwidth {bandwidth!r} differs from the machine profile's {machine.bandwidth}: give "
                            "one or the other")
        if not isinstance(machine, MachineProfile):
            raise PlanError(f"machine must be a MachineProfile, got {type(machine).__name__}")
        workers = machine.workers if workers is None else workers
        bandwidth = machine.bandwidth
        if len(_levels(workers, "workers")) != len(machine.levels):
            raise PlanError(f"workers has {len(_levels(workers, 'workers'))} levels but the machine profile has "
                            f"{len(machine.levels)}")
    elif workers is None or bandwidth is None:
        raise PlanError("workers and bandwidth are needed (or a machine profile)")
    workers = _levels(workers, "workers")
    bandwidth = [float(b) if isinstance(b, int) and not isinstance(b, bool) else b
                 for b in _levels(bandwidth, "bandwidth")]
    _check_inputs(workers, bandwidth, memory_bytes)
    if processes is not None:
        processes = [int(p) for p in processes]
        if not straight or len(workers) != 1:
            raise PlanError("processes= balances a straight plan of one level (straight=True, one --workers)")
        if len(processes) != workers[0] or min(processes, default=0) < 0:
            raise PlanError(f"processes= must give a process (>= 0) for each of the {workers[0]} stages, got "
                            f"{processes}")
        if memory_bytes is not None:
            processes = None
    if memory_bytes is not None and len(workers) > 1:
        raise PlanError("a memory limit is supported for single-level machines only (one --workers)")
    con = contract(profile)
    search_profile = con.profile
    if memory_bytes is None and machine is None:  # long chains: the scalable exact search
        fast = plan_chain(profile, con, workers, bandwidth, straight, processes=processes)
        if fast is not None:
            return fast
    states = linearize(search_profile)
    total = int(np.prod(workers))
    settings = {"workers": list(workers), "bandwidth": list(bandwidth), "straight": bool(straight),
                "memory_bytes": memory_bytes}
    folds: list[cost.Fold | None] = [None] * len(workers)
    if machine is not None:
        settings["machine"] = machine.to_json()
        folds = [cost.Fold.of(lv, machine.overhead_s if i == 0 else 0.0) for i, lv in enumerate(machine.levels)]
    names = [l.name for l in profile.layers]
    S = states.num_states
    if S == 0:  # nothing but inputs: one stage, nothing to compute
        if straight and total > 1:
            raise PlanError(f"a straight pipeline of {total} stages needs {total} cut points; the model has none")
        return Plan.from_stages([list(range(len(names)))], [total], profile_hash=profile.structure_hash(),
                                layer_names=names, stage_times_s=[0.0], settings=settings,
                                recompute=con.value_layers)
    dp_time = cost.data_parallel_time(states.compute_s[-1], states.parameter_bytes[-1], workers, bandwidth) \
        if machine is None else cost.measured_data_parallel_time(states.compute_s[-1], states.parameter_bytes[-1],
                                                                machine, workers)

    choices = []
    if len(workers) == 1:
        prob = flat_problem(states, workers[0], bandwidth[0], straight, memory_bytes, folds[0])
    else:
        # inner levels: a range's time is its best time one level in (innermost: its compute); tied groups
        # add their parameter copies at every level and their sync time at the outermost only
        prec = states.precedes
        CM, PMx = _ranges(states)
        if folds[0] is not None:  # the fixed cost per stage, once, on the innermost ranges
            CM, _ = _folded(folds[0], CM, PMx)
        within = 1
        for lvl, (n, b) in enumerate(zip(workers[:-1], bandwidth[:-1])):
            fold = folds[lvl]
            b = b if fold is None else fold.bandwidth
            CMb, PMb = _with_tied(states, b, CM, PMx, sync=False)
            PMb = _folded(fold, CMb, PMb, with_compute=False)[1]
            lst = states if fold is None else replace(states, output_bytes=fold.out_bytes(states.output_bytes))
            V, ch = _inner_level(lst, CMb, PMb, n, b, within, straight)
            choices.append(ch)
            CM = np.where(np.isfinite(V), V, _INF)
            within = n
        fold = folds[-1]
        b = bandwidth[-1] if fold is None else fold.bandwidth
        CMb, PMb = _with_tied(states, b, CM, PMx)
        PMb = _folded(fold, CMb, PMb, with_compute=False)[1]
        out = states.output_bytes if fold is None else fold.out_bytes(states.output_bytes)
        prob = LevelProblem(CMb[0].copy(), PMb[0].copy(), np.where(prec, CMb[1:], _INF),
                            np.where(prec, PMb[1:], 0.0), out, workers[-1], b, within, straight)
    lower = 0.0
    if len(workers) == 1:  # Σ C_s / Σ r_s <= max C_s / r_s <= the optimum
        lower = float(states.compute_s[-1]) / workers[0]
    upper = None
    if len(workers) == 1 and memory_bytes is None and machine is None:  # cuts between blocks first
        upper = flat_upper_plan(states, workers[0], bandwidth[0], straight)
    sol = solve_level(prob, lower, upper)
    busiest = 0.0
    if sol is not None and processes is not None and len(workers) == 1 and len(sol.cuts) > 1:
        sol, busiest = _balanced(search_profile, states, prob, sol, processes,
                                 machine.overhead_s if machine is not None else 0.0)
    if sol is None:
        if memory_bytes is not None:
            need = _smallest_memory(states, workers[0], bandwidth[0], straight)
            if need is not None:
                raise PlanError(
                    f"no plan fits the memory limit of {memory_bytes:.6g} bytes per worker; "
                    f"the smallest plan needs {need:.6g} bytes per worker"
                )
        if straight:
            raise PlanError(f"no straight pipeline of {total} stages exists: the model's layers allow at most "
                            f"{states.longest_chain()} stages in a row")
        raise PlanError("no plan exists for these settings")

    # expand the outer plan through the inner levels
    # (row, end, replicas multiplier, outer stage time, [replicas, inner plan] entry of the level plan tree)
    tree: list[list] = []
    ranges = []
    prev = None
    for j, r, t in zip(sol.cuts, sol.replicas, sol.stage_times):
        tree.append([r, None])
        ranges.append((0 if prev is None else prev + 1, j, r, t, tree[-1]))
        prev = j
    per_level = [len(ranges)]
    for lvl in range(len(workers) - 2, -1, -1):
        nxt = []
        for row, j, mult, t, entry in ranges:
            entry[1] = []
            for row2, j2, r2 in _inner_path(choices[lvl], row, j, workers[lvl] - 1):
                entry[1].append([r2, None])
                nxt.append((row2, j2, mult * r2, t, entry[1][-1]))
        ranges = nxt
        per_level.append(len(ranges))
    cuts = [j for _, j, _, _, _ in ranges]
    stage_of: list[int | None] = [None] * len(names)
    for s, layers in enumerate(states.stage_layers(cuts, search_profile)):
        for i in layers:
            for orig in con.members[i]:
                stage_of[orig] = s
    stage_of_all = place_values(profile, stage_of, len(cuts))
    stage_layers: list[list[int]] = [[] for _ in cuts]
    for i, s in enumerate(stage_of_all):
        stage_layers[s].append(i)
    settings["stages_per_level"] = per_level[::-1]
    replicas = [m for _, _, m, _, _ in ranges]
    if not straight and _unequal_tied_holders(profile, stage_layers, replicas):
        # the outermost level plans holders with one replica; an inner level may still have replicated one:
        # plan the hierarchy without replication, which the runtime can always run
        assert len(workers) > 1, "a one-level plan replicated a tied holder"
        try:
            return partition(profile, workers, bandwidth, straight=True, memory_bytes=memory_bytes, machine=machine)
        except PlanError as exc:
            raise PlanError(f"the stages holding a tied parameter need equal replica counts, which this hierarchy's "
                            f"best plan does not give them, and without replication: {exc}") from None
    predicted = max(sol.time_s, busiest)
    if machine is not None:
        predicted = _contended(profile, machine, workers, predicted, stage_layers, settings)
    return Plan.from_stages(
        stage_layers,
        replicas,
        profile_hash=profile.structure_hash(),
        layer_names=names,
        stage_times_s=[t for _, _, _, t, _ in ranges],
        ranks=aligned_ranks(workers, tree),
        time_per_minibatch_s=predicted,
        data_parallel_time_s=dp_time,
        settings=settings,
        recompute=con.value_layers,
    )
