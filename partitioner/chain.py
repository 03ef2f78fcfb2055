"""Exact planning of chain-like profiles at cluster scale (10,000 layers, 1,024 workers in 3 levels).

**When it applies.** The live layers (PipeDream's ``Input`` sources and ``__getitem__`` sinks taken out, see
:mod:`partitioner.antichain`) in profile order form a path: layer ``t`` feeds layer ``t+1``, whatever skip
edges come on top (residual streams, ``i -> i+2``). Then every downset is a prefix, the antichain states are
the positions ``0 < q <= S`` of a cut ("after the ``q``-th live layer", ``0`` being the start), every state
precedes every later one, and a stage is a range ``(p, q]`` with compute ``C[q] - C[p]`` and parameters
``P[q] - P[p]`` from prefix sums: :func:`chain_states` builds them in ``O(layers + edges)``, with exactly the
totals and cut sizes :func:`~partitioner.antichain.linearize` gives (the same sums, in the same order).

**The search.** Levels ``n_1, ..., n_L`` (innermost first) give ``N = n_1 ... n_L`` workers; ``U_l =
n_1 ... n_l`` workers form a level-``l`` machine. Count the workers a plan has used so far from the start:
a plan whose level-``l`` stages (``l >= 2``) each run on one machine (``r_l = 1``) is a path of
*innermost* stages ``(p, q]`` with ``v`` workers, from count ``u`` to ``u + v``, never across a multiple of
``U_1`` (a stage's workers are on one machine), where a count that is a multiple of ``U_h`` marks the end of
a level-``(h+1)`` stage. Which stage is the first of its range at each level, and so which transfers it
pays (:mod:`partitioner.cost`: the first stage of a range pays none, a later one ``2 o / (B_l r)`` for the
cut before it and after it, except after the model's last layer), follows from the counts alone. For a
threshold ``T`` the positions a count ``u`` can reach form a boolean vector; a stage with ``v`` workers
from position ``p`` covers exactly the ends ``q`` in ``(p, hi_v(p)]`` allowed by the transfer masks
(compute ``(C + 4 (v-1) P / (B_1 v)) / v`` grows with ``q``), so each ``(u, v)`` step is a few vectorised
operations, restricted to the band of positions whose prefix compute ``u`` workers can carry
(``C[q] <= u T`` and ``C[S] - C[q] <= (N - u) T``). The optimum of these plans is the least feasible
``T``: found by exponential and bisection search, then by binary search over the stage times left in the
bracket (the optimum is one of them), each test exact against the cost formulas.

**Replicated machines.** A level-``l`` stage (``l >= 2``) on ``r_l >= 2`` machines is not among those
plans. They are ruled out, exactly, by a relaxation: the same search at the threshold just below the
optimum found, with such stages allowed wherever their compute lower bound
``(C / U_{l-1} + 4 (r_l - 1) P / (B_l r_l n_{l-1})) / r_l <= T`` holds and their transfers free. If even
that finds no plan, no plan of the full dynamic program beats the optimum found, and it is the optimum
of :func:`partitioner.optimizer.partition`'s program; otherwise :func:`solve_chain` says it cannot decide
(``None``) and the caller uses the general path. With ``straight=True`` (one worker per stage) nothing is
replicated and the search is exact as it stands.

**Upper bounds for any profile.** The states of a general profile that are comparable with every other state
(the cuts between blocks, for a ResNet) form a chain of their own; :func:`flat_upper_plan` plans a one-level
machine on it, and :func:`partitioner.optimizer.solve_level` starts from that plan: one test of the full
program just below its time shows whether anything is faster (for PipeDream's resnet101 on 32 workers it is
the optimum, found in a fraction of the general search's time).

Tied parameter groups and memory limits are not handled here (the general path plans them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from profiler.profile import Profile

from . import cost

__all__ = ["ChainStates", "ChainSolution", "chain_states", "solve_chain", "plan_chain", "comparable_chain",
           "flat_upper_plan", "CHAIN_MIN_STATES", "SCALABLE"]

_SLACK = 1e-9  # relative slack of the pruning bounds (they must never cut a plan the exact tests accept)


@dataclass(frozen=True)
class ChainStates:
    """The states of a chain-like profile as prefix sums over cut positions ``0..S``."""

    live: np.ndarray
    """Profile indices of the live layers, in order: position ``q`` cuts after ``live[q-1]``."""
    compute: np.ndarray
    """``(S+1,)``: Σ (forward_ms + backward_ms) / 1000 of the first ``q`` live layers (``compute[0] = 0``)."""
    params: np.ndarray
    """``(S+1,)``: Σ parameter_bytes of the first ``q`` live layers."""
    cut_bytes: np.ndarray
    """``(S+1,)``: bytes crossing a cut at position ``q`` (0 at the start and after the last layer)."""
    removed_inputs: tuple[int, ...]
    removed_sinks: tuple[int, ...]

    @property
    def num_states(self) -> int:
        return len(self.live)

    def stage_layers(self, bounds: Sequence[int], profile: Profile) -> list[list[int]]:
        """Profile layers of the stages ``(bounds[i], bounds[i+1]]``: removed inputs join the first stage,
        removed sinks the stage of their latest predecessor (as :meth:`AntichainStates.stage_layers`)."""
        stages = [self.live[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
        owner = {layer: s for s, layers in enumerate(stages) for layer in layers}
        for layer in self.removed_inputs:
            stages[0].append(layer)
            owner[layer] = 0
        preds = profile.predecessors()
        for layer in sorted(self.removed_sinks):
            s = max((owner[p] for p in preds[layer] if p in owner), default=len(stages) - 1)
            stages[s].append(layer)
            owner[layer] = s
        return [sorted(s) for s in stages]


def chain_states(profile: Profile) -> ChainStates | None:
    """The :class:`ChainStates` of ``profile``, or None if its live layers do not form a path (or it has
    tied parameters)."""
    layers = profile.layers
    n = len(layers)
    if profile.tied or n == 0:
        return None
    preds = profile.predecessors()
    succs = profile.successors()
    gone = np.zeros(n, dtype=bool)
    removed_inputs = [i for i in range(n) if not preds[i] and layers[i].description.startswith("Input")]
    gone[removed_inputs] = True
    removed_sinks = [i for i in range(n) if not gone[i] and layers[i].description.startswith("__getitem__")
                     and not any(not gone[v] for v in succs[i])]
    gone[removed_sinks] = True
    live = np.flatnonzero(~gone)
    S = len(live)
    if S == 0:
        return None
    pos = np.full(n, -1, dtype=np.int64)
    pos[live] = np.arange(S)
    last_reader = np.zeros(S, dtype=np.int64)  # position (1-based) of the last live successor, 0 if none
    for t, i in enumerate(live.tolist()):
        nxt = [pos[v] for v in succs[i] if not gone[v]]
        if t + 1 < S and (t + 1) not in nxt:
            return None  # not a path
        last_reader[t] = max(nxt) + 1 if nxt else 0
    fwd = np.array([(layers[i].forward_ms + layers[i].backward_ms) / 1000.0 for i in live.tolist()])
    par = np.array([float(layers[i].parameter_bytes) for i in live.tolist()])
    act = np.array([float(layers[i].activation_bytes) for i in live.tolist()])
    compute = np.concatenate([[0.0], np.cumsum(fwd)])
    params = np.concatenate([[0.0], np.cumsum(par)])
    # a cut at position q (after live layer q-1) carries layer q-1 itself and every earlier layer read after
    # the cut: layer t (0-based) is carried by the cuts t+1 .. last_reader[t]-1, added in ascending layer
    # order per cut as linearize sums them
    cut = np.zeros(S + 1)
    carried: list[list[int]] = [[] for _ in range(S + 1)]
    for t in range(S):
        carried[t + 1].append(t)
        for q in range(t + 2, int(last_reader[t])):
            carried[q].append(t)
    acts = act.tolist()
    for q in range(1, S + 1):
        members = sorted(carried[q])
        cut[q] = float(sum(acts[t] for t in members))
    for inp in profile.inputs:  # an input a layer after the cut reads crosses it too
        readers = [pos[r] for r in inp.readers if not gone[r]]
        if inp.bytes and readers:
            cut[1:max(readers) + 1] += float(inp.bytes)
    cut[0] = 0.0
    cut[S] = 0.0
    return ChainStates(live, compute, params, cut, tuple(removed_inputs), tuple(removed_sinks))


@dataclass(frozen=True)
class ChainSolution:
    time_s: float
    """Predicted time per minibatch (the slowest stage)."""
    bounds: list[int]
    """Cut positions ``0 = b_0 < b_1 < ... = S``: innermost stage ``i`` is ``(b_i, b_{i+1}]``."""
    replicas: list[int]
    """Workers of each innermost stage (all on one machine)."""
    stage_times: list[float]
    """Each innermost stage's time under the cost model (compute and transfers at the innermost level)."""
    probes: int
    """Threshold tests the search made (for benchmarks)."""


class _Chain:
    """Threshold tests for one chain and one machine hierarchy."""

    def __init__(self, cs: ChainStates, workers: Sequence[int], bandwidth: Sequence[float], straight: bool):
        self.cs = cs
        self.n = [int(x) for x in workers]
        self.B = [float(b) for b in bandwidth]
        self.L = len(self.n)
        self.U = [1]
        for x in self.n:
            self.U.append(self.U[-1] * x)
        self.N = self.U[-1]
        self.S = cs.num_states
        self.straight = straight
        self.C = cs.compute
        self.P = cs.params
        self.o = cs.cut_bytes
        self.pos = np.arange(self.S + 1)
        self.vmax = 1 if straight else self.n[0]
        self.probes = 0
        # per count u: the level whose stage a count ends (h), and the levels >= 2 whose transfer a cut there
        # pays: as the end of a non-first stage (arrival) or the start of the next one (departure)
        self.arrive_lv: list[tuple[int, ...]] = []
        self.depart_lv: list[int | None] = []
        for u in range(self.N + 1):
            h = max((l for l in range(1, self.L + 1) if u % self.U[l] == 0), default=0)
            arr = tuple(l for l in range(2, min(h + 1, self.L) + 1) if (u - self.U[l - 1]) % self.U[l] != 0) \
                if 0 < u < self.N and h >= 1 else ()
            self.arrive_lv.append(arr)
            self.depart_lv.append(h + 1 if 0 < u < self.N and h >= 1 else None)

    # stage tests -----------------------------------------------------------------------------------------

    def _compute_time(self, p, q, v):
        return cost.stage_compute_time(self.C[q] - self.C[p], self.P[q] - self.P[p], v, self.B[0])

    def _hi(self, T: float, v: int) -> np.ndarray:
        """``hi[p]``: the last ``q`` with the compute of ``(p, q]`` on ``v`` workers ``<= T`` (``p`` if none)."""
        a = 4.0 * (v - 1) / (self.B[0] * v)
        F = self.C + a * self.P
        est = np.searchsorted(F, F + T * v, side="right") - 1
        est = np.clip(est, self.pos, self.S)
        for _ in range(64):  # settle rounding against the cost formula itself (monotone in q)
            over = (est > self.pos) & (self._compute_time(self.pos, est, v) > T)
            if not over.any():
                break
            est = np.where(over, est - 1, est)
        for _ in range(64):
            nxt = np.minimum(est + 1, self.S)
            under = (nxt > est) & (self._compute_time(self.pos, nxt, v) <= T)
            if not under.any():
                break
            est = np.where(under, nxt, est)
        return est

    def _his(self, T: float) -> np.ndarray:
        """``_hi`` for every ``v`` in ``1..vmax`` at once, ``(vmax, S+1)``."""
        V = self.vmax
        vs = np.arange(1, V + 1)
        a = 4.0 * (vs - 1) / (self.B[0] * vs)
        F = self.C[None, :] + a[:, None] * self.P[None, :]
        est = np.stack([np.searchsorted(F[i], F[i] + T * vs[i], side="right") for i in range(V)]) - 1
        pos = self.pos[None, :]
        est = np.clip(est, pos, self.S)
        v2 = vs[:, None]
        for _ in range(64):  # settle rounding against the cost formula itself (monotone in q)
            over = (est > pos) & (cost.stage_compute_time(self.C[est] - self.C[pos], self.P[est] - self.P[pos],
                                                          v2, self.B[0]) > T)
            if not over.any():
                break
            est = np.where(over, est - 1, est)
        for _ in range(64):
            nxt = np.minimum(est + 1, self.S)
            under = (nxt > est) & (cost.stage_compute_time(self.C[nxt] - self.C[pos], self.P[nxt] - self.P[pos],
                                                           v2, self.B[0]) <= T)
            if not under.any():
                break
            est = np.where(under, nxt, est)
        return est

    def _tables(self, T: float):
        V = self.vmax
        hi = self._his(T)
        vs = np.arange(1, V + 1)[:, None]
        tr = cost.transfer_time(self.o[None, :], vs, self.B[0])  # (V, S+1)
        ok_in = tr <= T
        ok_out = ok_in.copy()
        ok_out[:, self.S] = True  # nothing is sent after the last layer
        lv_ok = [None, None] + [cost.transfer_time(self.o, 1, self.B[l - 1]) <= T for l in range(2, self.L + 1)]
        for m in lv_ok[2:]:
            m[self.S] = True
        return hi, ok_in, ok_out, lv_ok

    def _rep_hi(self, T: float, l: int, r: int, first: bool) -> np.ndarray:
        """Relaxation of a level-``l`` stage on ``r`` machines: last ``q`` with its compute lower bound ``<= T``.

        The bound is ``(C / U_{l-1} + 4 (r-1) P / (B_l r) [/ n_{l-1} for the first stage of its range]) / r``.
        """
        Um = self.U[l - 1]
        a = 4.0 * (r - 1) * Um / (self.B[l - 1] * r * (self.n[l - 2] if first else 1))
        F = self.C + a * self.P
        lim = F + T * r * Um * (1.0 + _SLACK) + 1e-300
        return np.maximum(np.searchsorted(F, lim, side="right") - 1, self.pos)

    # reachability ------------------------------------------------------------------------------------------

    def reach(self, T: float, relaxed: bool = False, keep: bool = False):
        """Whether some plan has every stage ``<= T``; with ``keep``, the reachable positions per count."""
        self.probes += 1
        S, N, n1 = self.S, self.N, self.n[0]
        hi, ok_in, ok_out, lv_ok = self._tables(T)
        plain = np.zeros((N + 1, S + 1), dtype=bool)
        rep = np.zeros((N + 1, S + 1), dtype=bool) if relaxed else None
        plain[0, 0] = True
        C = self.C
        total = C[S]
        Tm = T * (1.0 + _SLACK)
        kept = [] if keep else None
        rep_hi = {}
        if relaxed:
            for l in range(2, self.L + 1):
                for r in range(2, self.n[l - 1] + 1):
                    for first in (False, True):
                        rep_hi[(l, r, first)] = self._rep_hi(T, l, r, first)
                    # its own transfers, when it is not the first of its range (2 o / (B_l r) at both ends)
                    rep_hi[(l, r, "ok")] = cost.transfer_time(self.o, r, self.B[l - 1]) <= T * (1.0 + _SLACK)
        us = np.arange(N + 1, dtype=float)
        # band of positions u workers can have covered (every stage takes at least its compute / its workers)
        with np.errstate(invalid="ignore"):
            band_a = np.searchsorted(C, total - (N - us) * Tm, side="left").tolist()
            band_b = np.searchsorted(C, us * Tm, side="right").tolist()  # exclusive
        in_all = bool(ok_in.all())
        out_all = bool(ok_out.all())
        # the most workers one stage takes: with nothing reachable for that long, nothing is reachable after
        jump = N if relaxed else n1
        last_live = 0
        for u in range(N):
            if u - last_live > jump and not keep:
                break
            qa, qb = band_a[u], band_b[u]
            R = plain[u]
            for l in self.arrive_lv[u]:
                R &= lv_ok[l]
            if rep is not None:
                R |= rep[u]
            R[:qa] = False
            R[qb:] = False
            R[S] = False  # nothing starts after the last layer
            if keep:
                kept.append(R.copy())
            idx = np.flatnonzero(R)
            if len(idx) == 0:
                continue
            last_live = u
            if rep is not None and u % n1 == 0:
                for l in range(2, self.L + 1):
                    Um = self.U[l - 1]
                    if u % Um:
                        break
                    k = (u % self.U[l]) // Um
                    for r in range(2, self.n[l - 1] - k + 1):
                        first = u % self.U[l] == 0
                        h2 = rep_hi[(l, r, first)][idx]
                        mask = None
                        if not first:
                            ok = rep_hi[(l, r, "ok")].copy()
                            ok[S] = True
                            h2 = np.where(ok[idx], h2, -1)
                            mask = ok[None, :]
                        self._spread(idx, h2[None, :], rep[u + r * Um: u + r * Um + 1], mask, monotone=first)
            dep = self.depart_lv[u]
            if dep is not None:
                idx = idx[lv_ok[dep][idx]]
                if len(idx) == 0:
                    continue
            g = u % n1
            V = min(self.vmax, n1 - g)
            ends = hi[:V, idx]  # (V, k)
            if g and not in_all:  # not the first stage of its machine: pays the transfers at both of its ends
                ends = np.where(ok_in[:V, idx], ends, -1)
            self._spread(idx, ends, plain[u + 1: u + V + 1], None if g == 0 or out_all else ok_out[:V],
                         monotone=g == 0 or in_all)
        if keep:
            R = plain[N].copy()
            for l in self.arrive_lv[N]:
                R &= lv_ok[l]
            kept.append(R)
        ok = bool(plain[N, S] or (rep is not None and rep[N, S]))
        return ok, (kept, hi, ok_in, ok_out, lv_ok) if keep else None

    @staticmethod
    def _spread(idx: np.ndarray, ends: np.ndarray, out: np.ndarray, mask: np.ndarray | None, *,
                monotone: bool) -> None:
        """``out[v, q] |= (some p in idx with p < q <= ends[v, p])`` (``ends`` non-decreasing in ``p`` where
        valid, ``-1`` where not; ``monotone``: no ``-1``), masked by ``mask[v, q]``."""
        pm = ends if monotone else np.maximum.accumulate(ends, axis=1)
        top = int(pm[:, -1].max())
        lo = int(idx[0]) + 1
        if top < lo:
            return
        qs = np.arange(lo, top + 1)
        nxt = np.minimum(np.append(idx[1:], top), top)
        at = np.repeat(np.arange(len(idx)), np.maximum(nxt - idx, 0))  # the last start before q
        cov = pm[:, at] >= qs[None, :]
        if mask is not None:
            cov &= mask[: len(cov), lo: top + 1]
        out[: len(cov), lo: top + 1] |= cov

    # plan reconstruction -------------------------------------------------------------------------------

    def witness(self, T: float):
        ok, info = self.reach(T, keep=True)
        assert ok
        kept, hi, ok_in, ok_out, lv_ok = info
        n1 = self.n[0]
        q, u = self.S, self.N
        bounds, reps = [q], []
        while u > 0:
            found = None
            for v in range(1, min(self.vmax, u - (u - 1) // n1 * n1) + 1):
                w = u - v
                if (w % n1) + v > n1:
                    continue
                R = kept[w]
                cand = np.flatnonzero(R[:q])
                dep = self.depart_lv[w]
                if dep is not None:
                    cand = cand[lv_ok[dep][cand]]
                cand = cand[hi[v - 1, cand] >= q]
                if w % n1:
                    cand = cand[ok_in[v - 1, cand]]
                    if not ok_out[v - 1, q]:
                        cand = cand[:0]
                if len(cand):
                    found = (int(cand[-1]), v)
                    break
            assert found is not None, "reachability without a witness"
            p, v = found
            bounds.append(p)
            reps.append(v)
            q, u = p, u - v
        bounds.reverse()
        reps.reverse()
        return bounds, reps

    def stage_time(self, p: int, q: int, v: int, first: bool) -> float:
        t = float(self._compute_time(p, q, v))
        if not first:
            t = max(t, float(cost.transfer_time(self.o[p], v, self.B[0])))
            if q < self.S:
                t = max(t, float(cost.transfer_time(self.o[q], v, self.B[0])))
        return t

    def candidates(self, lo: float, hi_T: float, limit: int) -> np.ndarray | None:
        """Every stage time in ``(lo, hi_T]`` (sorted, unique), or None if there are more than ``limit``."""
        parts = []
        for v in range(1, self.vmax + 1):
            a = self._hi(lo, v) if lo >= 0 else self.pos.copy()
            b = self._hi(hi_T, v)
            cnt = b - a
            total = int(cnt.sum())
            if total > limit:
                return None
            if total:
                p = np.repeat(self.pos, cnt)
                start = np.repeat(np.cumsum(cnt) - cnt, cnt)
                q = np.repeat(a, cnt) + 1 + (np.arange(total) - start)
                parts.append(self._compute_time(p, q, v))
            parts.append(cost.transfer_time(self.o, v, self.B[0]))
        for l in range(2, self.L + 1):
            parts.append(cost.transfer_time(self.o, 1, self.B[l - 1]))
        vals = np.concatenate(parts)
        vals = vals[(vals > lo) & (vals <= hi_T)]
        vals = np.unique(vals)
        return vals if len(vals) <= limit else None


def solve_chain(cs: ChainStates, workers: Sequence[int], bandwidth: Sequence[float], *,
                straight: bool = False) -> ChainSolution | None:
    """The optimum of PipeDream's (hierarchical) program on a chain, or None when it cannot be decided here.

    Raises ValueError if no plan exists at all (fewer positions than a straight pipeline needs).
    ``workers``/``bandwidth`` per level, innermost first, as :func:`partitioner.optimizer.partition` takes them.
    """
    ch = _Chain(cs, workers, bandwidth, straight)
    S, N = ch.S, ch.N
    if straight and S < N:
        raise ValueError(f"a straight pipeline of {N} stages needs {N} cut points; the model has {S}")
    total = float(cs.compute[S])
    # every stage takes at least its compute over its workers, so no plan beats total / N
    lb = total / N * (1.0 - 1e-9)
    lo = lb if lb > 0 else -1.0  # below lo: infeasible (-1 stands for just below 0)
    # a one-level machine always has a plan unless straight (one stage on every worker)
    if (straight or ch.L > 1) and not ch.reach(math.inf)[0]:  # no plan without machines shared by a stage
        if straight or ch.L == 1:
            raise ValueError("no plan exists for these settings")
        return None
    T = total / N * 1.01 if total > 0 else 0.0  # total / N itself needs a perfect balance
    step = 0.02
    hi_T = None
    while hi_T is None:
        if ch.reach(T)[0]:
            hi_T = T
        else:
            lo = T
            T = max(T * (1.0 + step), 1e-300)
            step *= 2.0
            if not math.isfinite(T):
                raise ValueError("no plan exists for these settings")
    while True:
        vals = ch.candidates(lo, hi_T, 200_000)
        if vals is not None:
            break
        mid = 0.5 * (lo + hi_T) if lo > 0 else hi_T * 0.5
        if ch.reach(mid)[0]:
            hi_T = mid
        else:
            lo = mid
    # the optimum is the least feasible candidate (hi_T is feasible and every plan's time is a candidate)
    a, b = -1, len(vals) - 1
    if len(vals) == 0 or vals[-1] < hi_T:
        vals = np.append(vals, hi_T)
        b = len(vals) - 1
    while b - a > 1:
        m = (a + b) // 2
        if ch.reach(float(vals[m]))[0]:
            b = m
        else:
            a = m
    best = float(vals[b])
    bounds, reps = ch.witness(best)
    times = []
    for i, v in enumerate(reps):
        u_before = sum(reps[:i])
        times.append(ch.stage_time(bounds[i], bounds[i + 1], v, u_before % ch.n[0] == 0))
    # the slowest innermost stage, or a level >= 2 transfer at a machine boundary
    time_s = max(max(times), _boundary_time(ch, bounds, reps))
    if not straight and ch.L >= 2:
        below = float(np.nextafter(time_s, -np.inf))
        if below >= 0 and ch.reach(below, relaxed=True)[0]:
            return None  # a plan with a stage replicated across machines might be faster: not decided here
    return ChainSolution(time_s, bounds, reps, times, ch.probes)


def _boundary_time(ch: _Chain, bounds: list[int], reps: list[int]) -> float:
    """Largest level >= 2 transfer term the plan pays at its machine boundaries."""
    worst = 0.0
    u = 0
    for i, v in enumerate(reps):
        u += v
        q = bounds[i + 1]
        if q >= ch.S:
            break
        for l in ch.arrive_lv[u]:
            worst = max(worst, float(cost.transfer_time(ch.o[q], 1, ch.B[l - 1])))
        dep = ch.depart_lv[u]
        if dep is not None:
            worst = max(worst, float(cost.transfer_time(ch.o[q], 1, ch.B[dep - 1])))
    return worst


CHAIN_MIN_STATES = 256
"""Chains with at least this many states are planned here (smaller ones by the general path, as before)."""

SCALABLE = True
"""False switches this module's paths off (:func:`plan_chain` and :func:`flat_upper_plan` give None): the
general path alone, for benchmarks."""

_DENSE_BYTES = 2.0e9
"""Largest working memory (estimated) the general path is given when this path cannot decide."""


def plan_chain(profile: Profile, con, workers: Sequence[int], bandwidth: Sequence[float], straight: bool,
               *, min_states: int | None = None, processes: Sequence[int] | None = None):
    """The plan of ``profile`` by :func:`solve_chain`, or None when the general path should plan it.

    ``con`` is ``contract(profile)`` (planning runs on its tensor layers). Returns None if the contracted
    profile is no chain, has fewer than ``min_states`` states (default :data:`CHAIN_MIN_STATES`), or the
    search cannot decide and the general path fits in memory; raises :class:`~partitioner.plan.PlanError`
    when no plan exists or the general path would not fit either. ``processes``: balance the straight one-level
    plan across them (see :func:`partitioner.optimizer.partition`).
    """
    from .contract import place_values
    from .plan import Plan, PlanError, aligned_ranks

    if not SCALABLE:
        return None
    if min_states is None:
        min_states = CHAIN_MIN_STATES
    cs = chain_states(con.profile)
    if cs is None or cs.num_states < min_states:
        return None
    try:
        sol = solve_chain(cs, workers, bandwidth, straight=straight)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    S = cs.num_states
    if sol is None:
        need = 16.0 * (S + 1) * S * max(workers)
        if need <= _DENSE_BYTES:
            return None
        raise PlanError(
            f"cannot plan {S} states on workers {list(workers)}: a stage replicated across machines might be "
            f"fastest, and the exact search for it needs about {need / 2**30:.1f} GiB; give more bandwidth to "
            "the outer levels or fewer levels")
    predicted = sol.time_s
    if processes is not None and len(workers) == 1 and len(sol.bounds) > 2:
        from .balance import balance_bounds, layers_compute, process_loads

        ch = _Chain(cs, workers, bandwidth, straight)

        def stage_time(lo, hi):  # ch.stage_time, element-wise
            t = ch._compute_time(lo, hi, 1)
            t = np.where(np.asarray(lo) > 0, np.maximum(t, cost.transfer_time(ch.o[lo], 1, ch.B[0])), t)
            later = (np.asarray(lo) > 0) & (np.asarray(hi) < ch.S)  # the first stage pays no transfer
            return np.where(later, np.maximum(t, cost.transfer_time(ch.o[hi], 1, ch.B[0])), t)

        first = layers_compute(con.profile, cs.removed_inputs)  # the inputs taken out join the first stage
        compute = cs.compute + np.where(np.arange(len(cs.compute)) > 0, first, 0.0)
        bounds = balance_bounds(compute, sol.bounds, processes, lambda lo, hi: np.arange(lo + 1, hi), stage_time,
                                lower_bound=sol.time_s)
        times = [ch.stage_time(p, q, 1, i == 0) for i, (p, q) in enumerate(zip(bounds[:-1], bounds[1:]))]
        predicted = max(max(times), float(process_loads(compute, bounds, processes).max()))
        sol = ChainSolution(max(times), bounds, list(sol.replicas), times, sol.probes)
    n1 = int(workers[0])
    ch_levels = [int(n) for n in workers]
    # the machine tree: every level >= 2 stage runs on one machine; innermost stages fill each machine
    units = [1]
    for n in ch_levels:
        units.append(units[-1] * n)
    leaves: list[list] = []  # innermost plans, one per level-1 machine
    cur: list = []
    used = 0
    for v in sol.replicas:
        cur.append((v, None))
        used += v
        if used % n1 == 0:
            leaves.append(cur)
            cur = []
    tree: list = leaves
    for n in ch_levels[1:]:
        tree = [[(1, tree[i + k]) for k in range(n)] for i in range(0, len(tree), n)]
    (top,) = tree
    # each innermost stage's time: its own, or a machine-boundary transfer next to it
    ch = _Chain(cs, workers, bandwidth, straight)
    times = list(sol.stage_times)
    u = 0
    for i, v in enumerate(sol.replicas[:-1]):
        u += v
        q = sol.bounds[i + 1]
        terms = [float(cost.transfer_time(ch.o[q], 1, ch.B[l - 1])) for l in ch.arrive_lv[u]]
        if ch.depart_lv[u] is not None:
            terms.append(float(cost.transfer_time(ch.o[q], 1, ch.B[ch.depart_lv[u] - 1])))
        if terms:
            times[i] = max(times[i], max(terms))
            times[i + 1] = max(times[i + 1], max(terms))
    stage_of: list[int | None] = [None] * len(profile.layers)
    for s, layers in enumerate(cs.stage_layers(sol.bounds, con.profile)):
        for i in layers:
            for orig in con.members[i]:
                stage_of[orig] = s
    stage_of_all = place_values(profile, stage_of, len(sol.replicas))
    stage_layers: list[list[int]] = [[] for _ in sol.replicas]
    for i, s in enumerate(stage_of_all):
        stage_layers[s].append(i)
    settings = {"workers": list(workers), "bandwidth": list(bandwidth), "straight": bool(straight),
                "memory_bytes": None,
                "stages_per_level": [len(sol.replicas)] + [units[-1] // units[l - 1] for l in range(2, len(units))]}
    return Plan.from_stages(
        stage_layers, list(sol.replicas), profile_hash=profile.structure_hash(),
        layer_names=[l.name for l in profile.layers], stage_times_s=times, time_per_minibatch_s=predicted,
        data_parallel_time_s=cost.data_parallel_time(float(cs.compute[S]), float(cs.params[S]), workers, bandwidth),
        settings=settings, recompute=con.value_layers, ranks=aligned_ranks(workers, top))


def comparable_chain(states) -> tuple[ChainStates, np.ndarray] | None:
    """The states of an :class:`~partitioner.antichain.AntichainStates` comparable with every other state, as
    a chain (position ``q`` is state ``index[q-1]``), or None if it has tied groups or no states.

    A plan cut only at such states is a plan of the full program with the same time (same sums, same
    formulas), so the chain's optimum bounds the full optimum from above.
    """
    S = states.num_states
    if S == 0 or len(states.tied_bytes):
        return None
    prec = states.precedes
    index = np.flatnonzero((prec | prec.T).sum(axis=1) == S - 1)
    if len(index) == 0 or index[-1] != S - 1:
        return None
    compute = np.concatenate([[0.0], states.compute_s[index]])
    params = np.concatenate([[0.0], states.parameter_bytes[index]])
    cut = np.concatenate([[0.0], states.output_bytes[index]])
    cut[-1] = 0.0
    return ChainStates(index, compute, params, cut, (), ()), index


def flat_upper_plan(states, workers: int, bandwidth: float, straight: bool
                    ) -> tuple[list[int], list[int]] | None:
    """An optimal plan among those cutting only at states comparable with all others (see
    :func:`comparable_chain`), as (last state of each stage, replicas), or None if there is none or the
    profile has fewer than :data:`CHAIN_MIN_STATES` states."""
    if not SCALABLE or states.num_states < CHAIN_MIN_STATES:  # small: the general search is quick anyway
        return None
    found = comparable_chain(states)
    if found is None:
        return None
    cs, index = found
    try:
        sol = solve_chain(cs, [workers], [bandwidth], straight=straight)
    except ValueError:
        return None
    return [int(index[q - 1]) for q in sol.bounds[1:]], list(sol.replicas)
