"""Where a process's memory goes: its stage's weights, gradients, optimizer state, weight versions and in-flight
activations, against its peak and the plan's prediction.

:class:`MemoryReport` is one process's account (bytes), made by :func:`memory_report`:

* ``parameters``: the stage's parameters and buffers (tied copies included);
* ``gradients``: one gradient per trainable parameter (what a backward holds at its peak);
* ``optimizer``: the tensors of the optimizer's state (the tied parameters' optimizers included);
* ``stash``: the weight versions alive at once at their peak, the current one included
  (:attr:`~pipedream_ft.pipeline.executor.RankStats.peak_stash_bytes`);
* ``activations``: the peak, over the training, of the tensors the in-flight minibatches' autograd graphs saved
  (measured by :class:`ActivationMeter` with ``saved_tensors_hooks``; parameters excluded) and
  ``in_flight``, the most minibatches in flight at once;
* ``peak``: the process's peak resident memory (``VmHWM``, else ``ru_maxrss``) on the CPU, or
  ``torch.cuda.max_memory_allocated`` on a GPU; ``baseline``: its resident memory when the trainer started (the
  runtime and the interpreter, before any weight);
* ``predicted``: the plan's per-worker memory for the stage, ``(S - s) · (P + A)``
  (:func:`partitioner.cost.stage_memory`, what ``pipedream-partition --memory`` bounds) from the profile's
  parameter and activation bytes (``None`` without a profile); ``limit``: the ``--memory`` the plan was made
  under (``None`` if none).

Not in the account: the gradients of one minibatch's backward while they are added into the accumulated ones (a
second stage-sized set for a moment, in the synchronous modes), and the allocator's own slack; they show in
``peak`` (see ``benchmarks/bench_memory.py``).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .hooks import Hooks

__all__ = ["ActivationMeter", "MemoryReport", "memory_report", "peak_bytes", "resident_bytes"]


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """One process's memory, in bytes (module docstring)."""

    stage: int
    parameters: int
    gradients: int
    optimizer: int
    stash: int
    activations: int
    in_flight: int
    peak: int
    baseline: int
    predicted: float | None
    limit: float | None
    device: str

    @property
    def accounted(self) -> int:
        """What the runtime knowingly holds for the stage: weights, gradients, optimizer state, the weight versions
        (copies of the weights the runtime keeps, the current one included) and the in-flight activations."""
        return self.parameters + self.gradients + self.optimizer + self.stash + self.activations

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "accounted": self.accounted}


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """This process's resident memory now (``VmRSS``; the peak where that is not available)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else peak_bytes(torch.device("cpu"))


def peak_bytes(device: torch.device) -> int:
    """This process's peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, else its peak resident memory."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


class ActivationMeter(Hooks):
    """The bytes each forward of ``module`` saves for its backward, and the peak of their sum over the minibatches
    in flight (forwarded, not yet backwarded). Attach with :meth:`attach`; add to the trainer's hooks.
    ``weights()`` gives the tensors a forward may read as weights (parameters, weight versions): saved, they are
    not activations.

    Minibatches have one shape (the messenger refuses another), so a forward saves the same bytes every time: the
    first forward of each :meth:`~pipedream_ft.PipelineTrainer.train` call is measured, through saved-tensor hooks,
    and the others are counted at that size, with no hook on their way."""

    def __init__(self, weights: Callable[[], Iterable[torch.Tensor]] = lambda: ()) -> None:
        self.weights = weights
        self._pending = 0
        self._counting: Any = None
        self._skip: set[int] = set()
        self.live: dict[int, int] = {}
        self.peak = 0
        self.peak_in_flight = 0
        self._measure = True
        """Whether the next forward is measured (the first of a run); else it counts :attr:`per_forward`."""
        self.per_forward = 0
        """Bytes one forward saves, as measured last."""

    def attach(self, module: nn.Module) -> None:
        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in self._skip:
                self._pending += t.numel() * t.element_size()
            return t

        def pre(_module: nn.Module, _args: Any) -> None:
            self._pending = 0
            if not self._measure:
                return
            self._skip = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *self.weights()]}
            self._counting = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self._counting.__enter__()

        def post(_module: nn.Module, _args: Any, _out: Any) -> None:
            if self._counting is not None:
                self._counting.__exit__(None, None, None)
                self._counting = None

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def on_forward(self, minibatch: int, start: float, end: float) -> None:
        if self._measure:
            if not self._pending:
                return  # the forward saved nothing for a backward (no gradients): measure the next
            self.per_forward, self._pending, self._measure = self._pending, 0, False
        if self.per_forward:
            self.live[minibatch] = self.per_forward
            self.peak = max(self.peak, sum(self.live.values()))
            self.peak_in_flight = max(self.peak_in_flight, len(self.live))

    def on_backward(self, minibatch: int, start: float, end: float) -> None:
        self.live.pop(minibatch, None)

    def on_train_start(self, start: int, stop: int) -> None:
        self.live.clear()
        self._measure = True


def memory_report(*, stage: int, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer | None],
                  trainable: Iterable[torch.Tensor], stash_bytes: int, meter: ActivationMeter | None,
                  device: torch.device, baseline: int, predicted: float | None,
                  limit: float | None) -> MemoryReport:
    """This process's :class:`MemoryReport` (module docstring)."""
    state = [*module.parameters(), *module.buffers()]
    opt = [v for o in optimizers if o is not None for s in o.state.values() for v in s.values()
           if isinstance(v, torch.Tensor)]
    return MemoryReport(stage=stage, parameters=_nbytes(state), gradients=_nbytes(trainable), optimizer=_nbytes(opt),
                        stash=int(stash_bytes), activations=meter.peak if meter else 0,
                        in_flight=meter.peak_in_flight if meter else 0, peak=peak_bytes(device), baseline=baseline,
                        predicted=predicted, limit=limit, device=str(device))
