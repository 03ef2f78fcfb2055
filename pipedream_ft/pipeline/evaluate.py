"""Evaluation through the pipeline between training runs: forward only, current weights, nothing changed.

:func:`evaluate` pushes minibatches ``0 .. steps - 1`` of an evaluation source through the stages (replica
``b % R`` of each stage runs minibatch ``b``, as in training) and the last stage computes each minibatch's loss
and, optionally, ``metric_fn(outputs, targets)``. Semantics:

* ``model.eval()``: dropout off, BatchNorm normalizes with its running statistics and does not update them;
  every stage module is put back in its previous mode afterwards;
* the current weights (the live parameters: what the next forward would read in steady state), no gradients,
  no update, no change to the data position, the weight versions, the optimizer or the data source of training;
* no random numbers consumed: the CPU (and the device's) generator states are saved and restored, so a run with
  evaluations in between trains bitwise like one without, and checkpoints resume exactly;
* forwards run under the training's autocast (mixed precision), without loss scaling;
* shapes may differ from training's and from minibatch to minibatch (a last partial batch): evaluation traffic
  has its own variable-shape channels (``"eval"``, ``"eval-tgt"``, see :mod:`pipedream_ft.pipeline.comm`);
* the values crossing stages are what training sends (:func:`~pipedream_ft.pipeline.crossing.outgoing`): tensors,
  or tuples, lists and dicts of tensors and constants (an HF block's ``(hidden, None)``, a RoPE ``(cos, sin)``),
  each minibatch's structure sent ahead of its tensors.

The source is read as in training (:mod:`pipedream_ft.pipeline.data`): a callable ``data(b)``, or an iterable
(a DataLoader...) that stage 0 iterates afresh on each call, once per minibatch, sending the targets to the
last stage. It must not be the training source (iterating it would move training's position).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import PipelineError
from .comm import Header
from .crossing import outgoing
from .data import StreamFeed, agree, make_feed, source_problem
from .executor import Executor

__all__ = ["EvalResult", "MetricFn", "evaluate", "evaluate_stages"]

MetricFn = Callable[[Any, Any], Any]
"""``metric_fn(outputs, targets)``: a number or a tensor per minibatch (a one-element tensor becomes a float)."""


@dataclass(slots=True)
class EvalResult:
    """What :meth:`PipelineTrainer.evaluate` returns on every rank."""

    loss: float
    """Mean of the per-minibatch losses."""
    losses: list[float] = field(default_factory=list)
    """Loss of each minibatch, in minibatch order."""
    metrics: list[Any] = field(default_factory=list)
    """``metric_fn``'s value for each minibatch, in minibatch order (empty without ``metric_fn``)."""


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return float(value) if value.numel() == 1 else value.cpu()
    return value


def evaluate(ex: Executor, data: Any, steps: int, metric_fn: MetricFn | None = None, *,
             training_source: Any = None) -> EvalResult:
    """Evaluate ``steps`` minibatches of ``data`` through the pipeline (see the module docstring). A collective.

    ``training_source``: the source training reads, refused as ``data`` if it is iterable.
    """
    return evaluate_stages([ex], data, steps, metric_fn, training_source=training_source)


def evaluate_stages(executors: Sequence[Executor], data: Any, steps: int, metric_fn: MetricFn | None = None, *,
                    training_source: Any = None) -> EvalResult:
    """:func:`evaluate` for a process that runs the stages of ``executors`` (in stage order). A collective."""
    records = [r for ex in executors for r in _records(ex, data, steps, metric_fn, training_source)]
    gathered = executors[0].group.all_gather_object(records)
    merged = sorted((r for part in gathered for r in part), key=lambda r: r[0])
    if [r[0] for r in merged] != list(range(steps)):
        raise PipelineError(f"evaluation of {steps} minibatches got results for {[r[0] for r in merged]}")
    losses = [r[1] for r in merged]
    return EvalResult(sum(losses) / len(losses), losses, [r[2] for r in merged] if metric_fn is not None else [])


def _records(ex: Executor, data: Any, steps: int, metric_fn: MetricFn | None, training_source: Any
             ) -> list[tuple[int, float, Any]]:
    """``(minibatch, loss, metric)`` of every minibatch this stage (the last) evaluated; none on another stage."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    topo, module, messenger = ex.topo, ex.state.module, ex.messenger
    feed = make_feed(data, topo=topo, connection=ex.connection, channel="eval-tgt")
    if isinstance(feed, StreamFeed):
        problem = source_problem(data, start=0, stop=steps, checkpointing=False, what="evaluation")
        if problem is None and data is training_source:
            problem = (f"evaluate needs its own data source: {type(data).__name__} is the one training reads, and "
                       "iterating it would move training's position")
        agree(ex.group, problem)
    last = topo.num_stages - 1
    mine = [b for b in range(steps) if b % topo.replicas[topo.stage] == topo.replica]
    was_training = module.training
    cpu_rng = torch.get_rng_state()
    dev_rng = torch.cuda.get_rng_state(ex.device) if ex.device.type == "cuda" else None
    records: list[tuple[int, float, Any]] = []
    try:
        module.eval()
        with torch.no_grad():
            for b in mine:
                if topo.is_first:
                    inputs = ex._model_inputs(feed.inputs(b))
                else:
                    peer = topo.peer(topo.stage - 1, b)
                    structure = messenger.recv_object(peer)
                    _, leaves = messenger.post_activations(peer, b, "eval").wait()
                    inputs = structure.join(leaves)
                with ex.autocast():
                    out = module(*inputs)
                if topo.is_last:
                    targets = ex._to_device(feed.targets(b))
                    with ex.autocast():
                        loss = ex.loss_fn(out, targets)
                    metric = _plain(metric_fn(out, targets)) if metric_fn is not None else None
                    records.append((b, float(loss), metric))
                else:
                    crossing = outgoing(list(out), module.output_names)
                    if isinstance(crossing, list):
                        raise PipelineError(f"values holding no tensor cannot cross stages: {crossing}")
                    structure, outs = crossing
                    peer = topo.peer(topo.stage + 1, b)
                    messenger.send_object(peer, structure)
                    messenger.send_activations(peer, Header(b), outs, "eval")
        messenger.flush()
    finally:
        module.train(was_training)
        torch.set_rng_state(cpu_rng)
        if dev_rng is not None:
            torch.cuda.set_rng_state(dev_rng, ex.device)
    return records if topo.stage == last else []
