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

All functions accept numpy arrays and broadcast.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = [
    "allreduce_time",
    "first_stage_time",
    "stage_compute_time",
    "transfer_time",
    "stage_time",
    "data_parallel_time",
    "stage_memory",
    "tied_sync_time",
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
