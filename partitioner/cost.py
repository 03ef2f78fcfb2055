"""PipeDream's cost model (``optimizer_graph_hierarchical.py`` with ``--activation_compression_ratio 1``).

Notation for one level of the machine hierarchy: ``B`` is its bandwidth in bytes/s, a stage has ``r``
replicas (data-parallel workers), ``C`` is the stage's compute time per minibatch in seconds (the sum of
``forward + backward`` of its layers; at an outer level, the best time of the inner level on that range),
``P`` its parameter bytes, ``o_in``/``o_out`` the bytes crossing the cuts before/after it, and ``w`` the
number of workers inside one machine of this level (1 at the innermost level).

* **first stage** of a pipeline (it receives nothing)::

      t_first = (C + 4 (r-1) P / (B r) / w) / r

* **any later stage**::

      t = max( (C + 4 (r-1) P / (B r)) / r,      # compute + weight all-reduce, shared by r replicas
               2 o_in / (B r),                   # receive activations, send gradients back
               2 o_out / (B r) )                 # send activations, receive gradients (not after the last)

  (PipeDream divides the all-reduce by ``w`` only for the first stage; this keeps that.)

``4 (r-1) P / (B r)`` is the time of a ring all-reduce of ``P`` bytes over ``r`` workers (each sends and
receives ``2 (r-1)/r · P`` bytes, for weights going out and gradients coming back). The pipeline's time per
minibatch is that of its slowest stage.

* **data parallelism** of the whole model (compute ``C``, parameters ``P``) on levels ``(n_1, B_1), ...``
  (innermost first)::

      t_0 = C;   t_l = (t_{l-1} + 4 (n_l - 1) P / (B_l n_l) / n_{l-1}) / n_l     (n_0 = 1)

* **memory** per worker of stage ``s`` (0-based) in an ``S``-stage 1F1B pipeline: it keeps up to ``S - s``
  versions of its weights (weight stashing) and the activations of up to ``S - s`` minibatches in flight::

      need = (S - s) · (P + A)

  where ``A`` is the sum of the stage's layers' ``activation_bytes``. Replication does not lower it (each
  replica holds the whole stage). Optimizer state and gradient buffers are not counted.

* **tied parameters** (a parameter ``P_g`` shared by several layers, e.g. GPT-2's embedding and output head):
  a stage that holds some but not all of a group's layers (so the group is split across stages) must add
  its gradient to the other holders' before each update. It pays PipeDream's all-reduce formula with
  ``r = 2`` holders on top of its compute::

      C += 4 (2-1) P_g / (B 2) = 2 P_g / B          (per split group the stage holds)

  (two holders whatever their real number, so the term depends on the stage alone and the dynamic program
  stays exact). A holder that does not hold the group's first user (whose ``parameter_bytes`` counts the
  parameter) keeps a copy of it: ``P += P_g`` for its weight all-reduce among replicas and its memory. On a
  hierarchical machine the copies count at every level, the sync time at the outermost level only (its
  stages, its bandwidth: a split there is what crosses the slowest links; a group split only inside one
  outer stage is not charged, which keeps each level's program exact).

* **measured costs** (a :class:`~partitioner.machine.MachineProfile` from ``pipedream-probe``): per level a
  transfer latency ``L`` and bandwidth ``B``, an all-reduce latency ``λ`` and bandwidth ``B_ar``, and the
  runtime's fixed cost per minibatch per stage ``O``. A stage then takes::

      t_first = (C + O + AR(r, P) / w) / r
      t       = max( (C + O + AR(r, P)) / r,
                     2 (L + o_in / B) / r,
                     2 (L + o_out / B) / r )          (no output term for the last stage)
      AR(r, P) = 4 (r-1)/r · (λ + P / B_ar)           (0 for r = 1 or P = 0)

  ``O`` is added once per stage, to the compute of the innermost ranges (an outer level's compute is an
  inner plan's time, which already holds it); each level uses its own ``L, B, λ, B_ar``. With ``L = λ = O =
  0`` and ``B_ar = B`` this is PipeDream's model. The program solves it unchanged through an exact change of
  variables (:class:`Fold`): bandwidth ``B_ar``, output bytes ``(o + L B) · B_ar / B``, parameter bytes
  ``P + λ B_ar`` (for time only; memory keeps ``P``), compute ``C + O``; then
  ``2 o' / (B_ar r) = 2 (L + o / B) / r`` and ``4 (r-1) P' / (B_ar r) = AR(r, P)``.

* **CPU contention**: with ``W`` workers on a machine of ``K < W`` cores, the processes share the cores; the
  whole pipeline cannot finish a minibatch faster than its CPU work divided by the cores::

      t >= Σ_s (C_s · φ + O) / K                      (every stage runs each minibatch once)

  where ``φ`` is the fraction of compute that uses a core (``profile.meta["cpu_fraction"]``, default 1; 0
  for the benchmark's sleep layers) and ``K`` the cores the machine's workers measurably got together
  (``MachineProfile.effective_cores``). :func:`contention_bound` gives it; on a one-level machine the
  planner reports ``max(t_pipeline, bound)`` as the prediction (the bound is applied to the program's
  optimum, not searched: the plan minimises ``t_pipeline``).

All functions accept numpy arrays and broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .machine import MachineLevel, MachineProfile

__all__ = [
    "allreduce_time",
    "first_stage_time",
    "stage_compute_time",
    "transfer_time",
    "stage_time",
    "data_parallel_time",
    "stage_memory",
    "tied_sync_time",
    "measured_allreduce_time",
    "measured_transfer_time",
    "measured_stage_time",
    "measured_data_parallel_time",
    "contention_bound",
    "Fold",
]



def allreduce_time(parameter_bytes, replicas, bandwidth: float):
    """``4 (r-1) P / (B r)``: ring all-reduce of the weights (0 for one replica)."""
    return (4 * (replicas - 1) * parameter_bytes) / (bandwidth * replicas)


def first_stage_time(compute_s, parameter_bytes, replicas, bandwidth: float, within: int = 1):
    """``(C + 4 (r-1) P / (B r) / w) / r``: the first stage, which has no input transfer."""
    return (compute_s + allreduce_time(parameter_bytes, replicas, bandwidth) / within) / replicas


def stage_compute_time(compute_s, parameter_bytes, replicas, bandwidth: float):
    """``(C + 4 (r-1) P / (B r)) / r``: compute and all-reduce of a later stage."""
    return (compute_s + allreduce_time(parameter_bytes, replicas, bandwidth)) / replicas


def transfer_time(nbytes, replicas, bandwidth: float):
    """``2 o / (B r)``: activations one way and gradients back, shared by ``r`` replicas."""
    return (2.0 * nbytes) / (bandwidth * replicas)


def stage_time(compute_s, parameter_bytes, replicas, bandwidth: float, in_bytes, out_bytes):
    """A later stage's time: ``max(compute + all-reduce, input transfer, output transfer)``.

    Pass ``out_bytes = 0`` for the pipeline's last stage.
    """
    return np.maximum(
        np.maximum(stage_compute_time(compute_s, parameter_bytes, replicas, bandwidth),
                   transfer_time(in_bytes, replicas, bandwidth)),
        transfer_time(out_bytes, replicas, bandwidth),
    )


def data_parallel_time(compute_s: float, parameter_bytes: float, workers: Sequence[int],
                       bandwidth: Sequence[float]) -> float:
    """Time per minibatch of plain data parallelism over all levels (innermost first)."""
    t = float(compute_s)
    within = 1
    for n, b in zip(workers, bandwidth):
        t = (t + allreduce_time(parameter_bytes, n, b) / within) / n
        within = n
    return float(t)


def stage_memory(parameter_bytes, activation_bytes, stages_from_end):
    """Bytes one worker of a stage needs: ``(S - s) · (P + A)``, ``stages_from_end = S - s``."""
    return stages_from_end * (parameter_bytes + activation_bytes)


def tied_sync_time(parameter_bytes, bandwidth: float):
    """``4 (r-1) P / (B r)`` with ``r = 2``: a stage's share of syncing a tied parameter split across stages."""
    return allreduce_time(parameter_bytes, 2, bandwidth)


# ----------------------------------------------------------------------------------------------------------
# measured costs (a machine profile)


def measured_allreduce_time(parameter_bytes, replicas, latency_s: float, bandwidth: float):
    """``AR(r, P) = 4 (r-1)/r · (λ + P / B_ar)``: a measured ring all-reduce (0 for one replica, and for a
    stage without parameters, which has nothing to all-reduce)."""
    t = 4.0 * (replicas - 1) / replicas * (latency_s + parameter_bytes / bandwidth)
    return np.where(np.asarray(parameter_bytes) > 0, t, 0.0) if latency_s else t


def measured_transfer_time(nbytes, replicas, latency_s: float, bandwidth: float):
    """``2 (L + o / B) / r``: activations one way and gradients back, each paying the latency."""
    return 2.0 * (latency_s + nbytes / bandwidth) / replicas


def measured_stage_time(compute_s, parameter_bytes, replicas, level: MachineLevel, overhead_s: float, in_bytes,
                        out_bytes, *, first: bool = False, within: int = 1):
    """A stage's time under measured costs (see the module docstring).

    ``first``: the pipeline's first stage, ``(C + O + AR / w) / r`` (``in_bytes``, ``out_bytes`` ignored);
    otherwise ``max((C + O + AR) / r, 2 (L + o_in / B) / r, 2 (L + o_out / B) / r)`` with the output term
    left out when ``out_bytes`` is None (the last stage).
    """
    ar = measured_allreduce_time(parameter_bytes, replicas, level.allreduce_latency_s, level.allreduce_bandwidth)
    if first:
        return (compute_s + overhead_s + ar / within) / replicas
    t = (compute_s + overhead_s + ar) / replicas
    t = np.maximum(t, measured_transfer_time(in_bytes, replicas, level.latency_s, level.bandwidth))
    if out_bytes is None:
        return t
    return np.maximum(t, measured_transfer_time(out_bytes, replicas, level.latency_s, level.bandwidth))


def measured_data_parallel_time(compute_s: float, parameter_bytes: float, machine: MachineProfile,
                                workers: Sequence[int] | None = None) -> float:
    """Plain data parallelism under measured costs: ``t_0 = C + O``;
    ``t_l = (t_{l-1} + AR_l(n_l, P) / n_{l-1}) / n_l``."""
    workers = list(workers) if workers is not None else machine.workers
    t = float(compute_s) + machine.overhead_s
    within = 1
    for n, lv in zip(workers, machine.levels):
        ar = measured_allreduce_time(parameter_bytes, n, lv.allreduce_latency_s, lv.allreduce_bandwidth)
        t = (t + ar / within) / n
        within = n
    return float(t)


def contention_bound(stage_compute_s: Sequence[float], overhead_s: float, cores: float | None, workers: int,
                     cpu_fraction: float = 1.0) -> float:
    """``Σ_s (C_s · φ + O) / K`` when ``W > K`` workers share ``K`` cores, else 0 (``K`` may be a measured,
    fractional number of cores)."""
    if cores is None or workers <= cores:
        return 0.0
    return float(sum(c * cpu_fraction + overhead_s for c in stage_compute_s)) / cores


@dataclass(frozen=True, slots=True)
class Fold:
    """The change of variables that lets PipeDream's program solve the measured model exactly (one level).

    Give the program ``bandwidth``, output bytes ``o · bytes_scale + bytes_offset``, parameter bytes (for
    time) ``P + params_offset`` and compute ``C + compute_offset``; its formulas then equal the measured
    ones: ``2 o' / (B_ar r) = 2 (L + o / B) / r``, ``4 (r-1)(P + λ B_ar) / (B_ar r) = AR(r, P)``. With no
    measured terms the fold is the identity (``bytes_scale`` exactly 1.0, offsets 0).
    """

    bandwidth: float
    bytes_scale: float
    bytes_offset: float
    params_offset: float
    compute_offset: float

    @staticmethod
    def of(level: MachineLevel, overhead_s: float) -> Fold:
        bar = float(level.allreduce_bandwidth)
        scale = 1.0 if bar == level.bandwidth else bar / level.bandwidth
        return Fold(bar, scale, level.latency_s * bar, level.allreduce_latency_s * bar, float(overhead_s))

    def out_bytes(self, nbytes):
        if self.bytes_scale == 1.0 and self.bytes_offset == 0.0:
            return nbytes
        return np.asarray(nbytes, float) * self.bytes_scale + self.bytes_offset
