"""Forward, backward and update of one stage replica — the PipeDream core, knowing nothing of checkpoints.

The executor runs the actions a :class:`~pipedream_ft.pipeline.modes.Mode` schedules, on a
:class:`~pipedream_ft.pipeline.state.StageState`, talking to its neighbours through a
:class:`~pipedream_ft.pipeline.comm.Messenger`:

* ``F b``: read the inputs (stage 0: from the feed, see :mod:`pipedream_ft.pipeline.data`; else: the
  activations of ``b`` from the previous stage), run the stage with the weight version the mode picks, with the
  RNG seeded from (seed, stage, ``b``), under :attr:`Executor.autocast`; send the outputs on (the last stage
  computes the loss, with the targets from the feed).
* ``B b``: differentiate with respect to that same version and the inputs; accumulate the parameter gradients;
  send the input gradients back.
* ``I b`` then, later, ``W b``: the same backward split in two (zero-bubble schedules): ``I`` sends the input
  gradients back, ``W`` accumulates the parameter gradients (see :mod:`~pipedream_ft.pipeline.splitbackward`).
* ``U j``: all-reduce gradients among the stage's replicas, apply them (:attr:`Executor.step`: the optimizer step,
  or :class:`~pipedream_ft.pipeline.stepper.Stepper`'s clipping, loss scaling and LR schedule), publish a new
  weight version.

**Cuts.** A minibatch can carry *cut flags* in its activation header: stage 0 asks ``decide(b)`` at its forward
of ``b``, and a non-zero answer marks a cut at ``b + 1`` that travels with the activations to every later
stage (and, through the gradient all-reduce, to the replicas that did not run ``b``). After its update for the
last minibatch before the cut each rank calls ``on_cut(cut, flags)``: that is where a checkpoint is taken, with
nobody stopping to agree. The flags mean nothing here (:mod:`pipedream_ft.ft.cuts` owns them): the executor
only asks ``stops(flags)`` whether the job stops at the cut, and then runs no minibatch after it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch
from torch.utils._pytree import tree_leaves

from ..errors import PipelineSetupError
from ..schedules.actions import Action, Kind
from .colocated import Handoff
from .comm import Header, Messenger, RecvHandle, TensorSpec
from .connection import Connection
from .crossing import Structure, outgoing
from .data import bind_inputs
from .group import CommGroup
from .hooks import Hooks
from .losses import LossLog, cuda_marker
from . import engine, optimstep
from .modes import Mode
from .reparam import Reparametrized
from .splitbackward import WeightBackward, input_backward
from .state import StageState
from .topology import Topology
from .versions import Version

__all__ = ["DataFn", "Executor", "RankStats", "agree_preflight", "mix_seed"]

FAILED = 1
"""The pre-flight header's flag: the upstream stage failed its pre-flight check."""

DataFn = Callable[[int], tuple[Any, Any]]
"""``data(b) -> (inputs, targets)`` of minibatch ``b``; every rank must see the same stream."""


class Feed(Protocol):
    """What the executor reads minibatches from (see :mod:`pipedream_ft.pipeline.data`)."""

    def inputs(self, b: int, *, preflight: bool = False) -> Any: ...

    def targets(self, b: int, *, preflight: bool = False) -> Any: ...


@dataclass(slots=True)
class RankStats:
    """Where one rank's time went, and what it held."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    update_s: float = 0.0
    wait_s: float = 0.0
    """Time blocked waiting for activations or gradients."""
    minibatches: int = 0
    peak_stash_versions: int = 0
    """Most weight versions alive at once (the current one included)."""
    peak_stash_bytes: int = 0
    """Bytes of those versions."""

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RankStats.__slots__}  # type: ignore[attr-defined]


@dataclass(slots=True)
class _InFlight:
    version: Version
    tied: list[Version]
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    loss: torch.Tensor | None
    grad_recv: RecvHandle | None
    header: Header


_RUNS = {Kind.B: "backward", Kind.I: "backward_input", Kind.W: "backward_weight", Kind.U: "update",
         Kind.RECV_F: "post_activation_recv", Kind.SEND_F: "send_activations", Kind.RECV_B: "post_gradient_recv",
         Kind.SEND_B: "send_input_grads"}
"""The method that runs each action kind besides ``F`` (which also reads the feed)."""
_F = Kind.F
"""Read once: an enum member read off its class costs a lookup, and every action asks."""


def mix_seed(seed: int, stage: int, minibatch: int) -> int:
    """The RNG seed of ``minibatch``'s forward on ``stage``: reproducible across restarts."""
    x = (seed * 1_000_003 + stage) * 1_000_000_007 + minibatch
    return x % (2**63 - 1)


def agree_preflight(group: CommGroup, errors: Sequence[str | None]) -> None:
    """Every rank's pre-flight lines (``errors``: one per stage of this rank) gathered: the first raised on every
    rank as :class:`PipelineSetupError` (marked agreed). A collective."""
    problems = [e for part in group.all_gather_object(list(errors)) for e in part if e]
    if problems:
        agreed = PipelineSetupError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        agreed.agreed = True
        raise agreed


def _tensors(values: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(values) if isinstance(x, torch.Tensor)]


def _ranges(idx: Sequence[int]) -> str:
    out: list[str] = []
    for i in sorted(idx):
        if out and out[-1].endswith(f"-{i - 1}"):
            out[-1] = out[-1].rsplit("-", 1)[0] + f"-{i}"
        elif out and out[-1] == str(i - 1):
            out[-1] = f"{i - 1}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


class Executor:
    """Runs one stage replica's actions (see the module docstring)."""

    def __init__(self, topo: Topology, state: StageState, mode: Mode, *, connection: Connection,
                 device: torch.device, loss_fn: Callable[[Any, Any], torch.Tensor], seed: int, hooks: Hooks,
                 step: Callable[[], None] | None = None,
                 autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 loss_factor: Callable[[], float] | None = None,
                 decide: Callable[[int], int] | None = None,
                 on_cut: Callable[[int, int], None] | None = None,
                 stops: Callable[[int], bool] | None = None,
                 colocated: frozenset[int] = frozenset(), handoff: Handoff | None = None) -> None:
        if colocated and handoff is None:
            raise ValueError("stages on this process (colocated) need the handoff between them")
        self.topo = topo
        self.rank = topo.rank
        """The rank of the process that runs this stage (for the lines it says; set by a process of several)."""
        self.state = state
        self.mode = mode
        self.connection = connection
        """Where the current epoch's messenger and groups come from."""
        self.device = device
        self.loss_fn = loss_fn
        self.seed = seed
        self.hooks = hooks
        self.stats = RankStats()
        self.losses = LossLog(marker=cuda_marker if device.type == "cuda" else None)
        """``(minibatch, loss)`` of every minibatch this rank (the last stage) computed in the current run."""
        self.decide = decide
        """Stage 0: the cut flags for minibatch ``b`` (0: no cut after it)."""
        self.on_cut = on_cut
        """Called after the update that completes the minibatches before a cut, with ``(cut, flags)``."""
        self.stops: Callable[[int], bool] = stops if stops is not None else (lambda flags: False)
        """Whether the job stops at a cut with these flags."""
        self.cuts: dict[int, int] = {}
        """Cuts announced to this rank and not yet reached: cut -> flags."""
        self.stop_at: int | None = None
        """A cut after which the job stops (a preemption): minibatches from there on are not run."""
        self.preflight_done = False
        self._in_structure: Structure | None = None
        """Structure of the values this stage receives (learned at the pre-flight)."""
        self._out_structure: Structure | None = None
        """Structure of the values this stage sends (fixed at the pre-flight, checked at every send)."""
        self._inflight: dict[int, _InFlight] = {}
        self._weight_jobs: dict[int, tuple[WeightBackward | None, list[torch.Tensor]]] = {}
        """Minibatches whose ``I`` ran and whose ``W`` has not."""
        self._act_recv: dict[int, RecvHandle] = {}
        self._grads_out: dict[int, list[torch.Tensor]] = {}
        """Input gradients computed and not yet sent (``B``/``I`` ran, ``SEND_B`` has not)."""
        self._reparam: Reparametrized | None = None
        self.handoff = handoff
        """Where this stage and the other stages of its process hand each other activations and gradients."""
        self._local_prev = topo.stage - 1 in colocated
        """The previous stage runs on this process: its activations come from the handoff (no RECV_F)."""
        self._local_next = topo.stage + 1 in colocated
        """The next stage runs on this process: the outputs go to the handoff (no SEND_F), its gradients come
        from there (no RECV_B)."""
        self._generator = torch.cuda.default_generators[self.device.index or 0] if self.device.type == "cuda" \
            else torch.default_generator
        self.step: Callable[[], None] = step if step is not None else self._step
        """Applies the summed gradients: the optimizer step (then ``zero_grad``) unless given another (the
        :class:`~pipedream_ft.pipeline.stepper.Stepper`'s clipping, loss scaling and LR schedule)."""
        self.autocast = autocast
        """The context of every forward and loss (mixed precision, :mod:`pipedream_ft.pipeline.precision`)."""
        self.loss_factor: Callable[[], float] = loss_factor if loss_factor is not None else (lambda: 1.0)
        """A further factor on each loss before its backward (the float16 loss scale)."""

    @property
    def _reparametrized(self) -> Reparametrized:
        """The stage's module, run on a weight version (made once per module)."""
        r = self._reparam
        if r is None or r.module is not self.state.module:
            r = self._reparam = Reparametrized(self.state.module)
        return r

    @property
    def messenger(self) -> Messenger:
        return self.connection.messenger

    @property
    def group(self) -> CommGroup:
        return self.connection.group

    # -- inputs ---------------------------------------------------------------------------------------------

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=True)
        if isinstance(value, (list, tuple)):
            return type(value)(self._to_device(v) for v in value)
        if isinstance(value, dict):
            return {k: self._to_device(v) for k, v in value.items()}
        return value

    def _model_inputs(self, inputs: Any) -> list[Any]:
        return self._to_device(bind_inputs(inputs, self.state.module.input_names))  # a tuple, a value or a dict

    # -- pre-flight -----------------------------------------------------------------------------------------

    def preflight(self, data: Feed) -> None:
        """Push one minibatch forward through every stage (no gradients, eval mode) before training.

        Every link learns its tensor shapes and the structure of the values crossing it, and a stage that
        cannot take what the previous one sends — or a mismatch between the data and the model — stops every
        rank with one message naming it. A collective.
        """
        agree_preflight(self.group, [self.preflight_check(data)])
        self.preflight_done = True

    def preflight_check(self, data: Feed) -> str | None:
        """This stage's part of :meth:`preflight`, without the agreement: its messages to and from its
        neighbours, and the line naming what is wrong here (``None``: nothing)."""
        topo, module = self.topo, self.state.module
        error: str | None = None
        failed_upstream = False
        was_training = module.training
        outs: list[torch.Tensor] = []
        structure: Structure | None = None
        inputs: list[Any] | None = None
        try:
            module.eval()
            if topo.is_first:
                inputs = self._model_inputs(data.inputs(self.state.position, preflight=True))
            else:
                received = []
                for peer in topo.peers(topo.stage - 1):
                    upstream = self.messenger.recv_object(peer)
                    header, tensors = self.messenger.post_activations(peer, -1).wait()
                    assert header is not None
                    if header.flags & FAILED or upstream is None:
                        failed_upstream = True
                    else:
                        self._in_structure = upstream
                        received.append(upstream.join(tensors))
                inputs = received[0] if received else []
            if not failed_upstream:
                with torch.no_grad(), self.autocast():
                    out = module(*inputs)
                    if topo.is_last:
                        loss = self.loss_fn(out, self._to_device(data.targets(self.state.position, preflight=True)))
                if topo.is_last:
                    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                        raise PipelineSetupError(f"loss_fn must return a scalar tensor, got {loss!r:.80}")
                else:
                    crossing = outgoing(list(out), module.output_names)  # as check_plan and evaluate send
                    if isinstance(crossing, list):
                        raise PipelineSetupError(
                            f"values holding no tensor cannot cross stages: {crossing}; the plan should have them "
                            "recomputed (plan the model again with this version's pipedream-partition)")
                    structure, outs = crossing
        except Exception as exc:  # any failure here is reported collectively below
            what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            shapes = ", ".join(str(TensorSpec.of(t)) for t in _tensors(inputs)) if inputs is not None else "?"
            error = (f"stage {topo.stage} (rank {self.rank}, layers {_ranges(topo.layers)}) "
                     f"cannot run on its input [{shapes}]: {what}")
        finally:
            module.train(was_training)
        if not topo.is_last:
            failed = bool(error or failed_upstream)
            self._out_structure = None if failed else structure
            for peer in topo.peers(topo.stage + 1):
                self.messenger.send_object(peer, self._out_structure)
                self.messenger.send_activations(peer, Header(-1, 0, FAILED if failed else 0), [] if failed else outs)
            self.messenger.flush()
        return error

    # -- actions ------------------------------------------------------------------------------------------

    def run(self, action: Action, data: Feed) -> None:
        """Run one action of this stage's lowered list (see the module docstring): compute, update, or one of the
        sends and receives that connect it to its neighbours. An action of another stage is refused with
        :class:`PipelineSetupError` naming it."""
        if action.stage != self.topo.stage:
            raise PipelineSetupError(f"action {action} is for stage {action.stage}, but rank {self.rank} "
                                     f"runs stage {self.topo.stage}")
        kind = action.kind
        if kind is _F:
            self.forward(action.index, data)
        else:
            getattr(self, _RUNS[kind])(action.index)

    def send_activations(self, b: int) -> None:
        """``SEND_F b``: send minibatch ``b``'s outputs (and its header) to the next stage."""
        rec = self._inflight.get(b)
        if rec is None:
            self._unmatched(b, "SEND_F", "its forward did not run")
            return
        self.messenger.send_activations(self.topo.peer(self.topo.stage + 1, b), rec.header, rec.outputs)

    def post_gradient_recv(self, b: int) -> None:
        """``RECV_B b``: post the receive of the gradient of minibatch ``b``'s outputs (ahead of its backward)."""
        rec = self._inflight.get(b)
        if rec is None:
            self._unmatched(b, "RECV_B", "its forward did not run")
            return
        specs = [TensorSpec.of(t) for t in rec.outputs if t.is_floating_point()]
        rec.grad_recv = self.messenger.post_gradients(self.topo.peer(self.topo.stage + 1, b), b, specs)

    def send_input_grads(self, b: int) -> None:
        """``SEND_B b``: send the gradient of minibatch ``b``'s inputs, computed by its ``B`` or ``I``, to the
        previous stage."""
        grads = self._grads_out.pop(b, None)
        if grads is None:
            self._unmatched(b, "SEND_B", "its backward did not run")
            return
        self.messenger.send_gradients(self.topo.peer(self.topo.stage - 1, b), b, grads)

    def _unmatched(self, b: int, what: str, why: str) -> None:
        """A send or receive of a minibatch this attempt does not run (after the cut the job stops at) is
        skipped; any other is a lowering error."""
        if self.stop_at is not None and b >= self.stop_at:
            return
        raise PipelineSetupError(f"stage {self.topo.stage}: {what} of minibatch {b} comes before anything to "
                                 f"send or receive ({why}): the lowered schedule is out of order")

    def post_activation_recv(self, b: int) -> None:
        """Post the receive of minibatch ``b``'s activations (ahead of its forward)."""
        if not self.topo.is_first and b not in self._act_recv and (self.stop_at is None or b < self.stop_at):
            self._act_recv[b] = self.messenger.post_activations(self.topo.peer(self.topo.stage - 1, b), b)

    def _waited(self, handle: RecvHandle, what: str) -> None:
        self.stats.wait_s += handle.wait_s
        if handle.wait_s > 0:
            end = time.time()
            self.hooks.on_wait(what, handle.minibatch, handle.peer, end - handle.wait_s, end)

    def _cut(self, b: int, flags: int) -> None:
        self.cuts[b + 1] = flags
        if self.stops(flags):
            self.stop_at = b + 1

    def forward(self, b: int, data: Feed) -> None:
        if self.stop_at is not None and b >= self.stop_at:
            return  # the job stops at the cut before: this minibatch is for the next attempt
        topo, state = self.topo, self.state
        leaves: list[torch.Tensor] = []
        if topo.is_first:
            inputs = self._model_inputs(data.inputs(b))
            flags = self.decide(b) if self.decide is not None else 0
            if flags:
                self._cut(b, flags)
            tag = self.mode.version_for(topo, state.versions, b, 0).updates
            header = Header(b, tag, flags)
        else:
            if self._local_prev:  # handed over by the previous stage on this process: its own tensors, detached
                assert self.handoff is not None
                header, sent = self.handoff.take(("act", topo.stage, b),
                                                 f"stage {topo.stage}: the forward of minibatch {b}")
                leaves = [t.detach() for t in sent]
            else:
                handle = self._act_recv.pop(b, None)
                if handle is None:
                    raise PipelineSetupError(f"stage {topo.stage}: the forward of minibatch {b} runs before its "
                                             "RECV_F: the lowered schedule is out of order")
                header, leaves = handle.wait()
                self._waited(handle, "activation")
            assert header is not None and self._in_structure is not None
            leaves = [t.requires_grad_() if t.is_floating_point() else t for t in leaves]
            inputs = self._in_structure.join(leaves)
            if header.flags:
                self._cut(b, header.flags)
        t0 = time.perf_counter()
        w0 = time.time()
        version = self.mode.version_for(topo, state.versions, b, header.tag)
        params = {} if version is state.versions.current and state.versions.live else \
            dict(zip(state.param_names, version.tensors))  # the live weights need no swapping in
        tied_versions: list[Version] = []
        if state.tied:
            tied_params, tied_versions = state.tied.tensors_for(b)
            params.update(tied_params)
        gen = self._generator
        saved = gen.get_state()
        gen.manual_seed(mix_seed(self.seed, topo.stage, b))  # this forward's RNG, reproducible
        try:
            with self.autocast():
                out = self._reparametrized(params, tuple(inputs))
        finally:
            gen.set_state(saved)  # the caller's RNG stream is left as it was
        loss = None
        outputs: list[torch.Tensor] = []
        if topo.is_last:
            targets = self._to_device(data.targets(b))
            with self.autocast():
                loss = self.loss_fn(out, targets)
            self.losses.add(b, loss)
            scale = self.mode.loss_scale() * self.loss_factor()
            if scale != 1.0:
                loss = loss * scale
        else:
            structure, outputs = Structure.split(list(out))
            assert self._out_structure is not None
            if structure is not self._out_structure and structure != self._out_structure:
                self._out_structure.check(structure, state.module.output_names, b)
        self._inflight[b] = _InFlight(version, tied_versions, leaves, outputs, loss, None, header)
        if self._local_next:
            assert self.handoff is not None
            self.handoff.put(("act", topo.stage + 1, b), (header, outputs), f"minibatch {b}'s activations")
        self.stats.forward_s += time.perf_counter() - t0
        self.hooks.on_forward(b, w0, time.time())
        self._note_stash()

    def backward(self, b: int) -> None:
        """``B``: the whole backward of minibatch ``b``; the input gradient goes to the previous stage."""
        if self.stop_at is not None and b >= self.stop_at:
            return
        rec = self._inflight.pop(b)
        roots, grads = self._output_grads(rec)
        t0 = time.perf_counter()
        w0 = time.time()
        wrt_params, targets = self._weights(rec)
        wrt_inputs = self._grad_inputs(rec)
        wrt = wrt_params + wrt_inputs
        if roots and wrt and len(wrt_params) == len(targets) and all(w is t for w, t in zip(wrt_params, targets)):
            # the forward read the live weights themselves: autograd adds each weight's gradient into its ``grad``
            # as it goes, so no second copy of the stage's gradients ever exists (a flush window accumulates)
            engine.backward(roots, grads, wrt)
            in_grads = [t.grad for t in wrt_inputs]
            for t in wrt_inputs:
                t.grad = None
            self._send_input_grads(b, wrt_inputs, in_grads)
        else:
            if roots and wrt:
                got = engine.grad(roots, wrt, grads)
            else:
                got = (None,) * len(wrt)
            self._accumulate(targets, got[: len(wrt_params)])
            self._send_input_grads(b, wrt_inputs, got[len(wrt_params):])
        self.stats.backward_s += time.perf_counter() - t0
        self.stats.minibatches += 1
        self.hooks.on_backward(b, w0, time.time())

    def backward_input(self, b: int) -> None:
        """``I``: the input gradient of minibatch ``b`` only, sent to the previous stage; the weight gradient waits
        for :meth:`backward_weight` (see :mod:`~pipedream_ft.pipeline.splitbackward`)."""
        if self.stop_at is not None and b >= self.stop_at:
            return
        rec = self._inflight.pop(b)
        roots, grads = self._output_grads(rec)
        t0 = time.perf_counter()
        w0 = time.time()
        wrt_params, targets = self._weights(rec)
        wrt_inputs = self._grad_inputs(rec)
        if roots:
            in_grads, job = input_backward(roots, grads, wrt_inputs, wrt_params)
        else:
            in_grads, job = (None,) * len(wrt_inputs), None
        self._send_input_grads(b, wrt_inputs, in_grads)
        self._weight_jobs[b] = (job, targets)
        self.stats.backward_s += time.perf_counter() - t0
        self.hooks.on_backward(b, w0, time.time())

    def backward_weight(self, b: int) -> None:
        """``W``: the weight gradient of minibatch ``b``, whose :meth:`backward_input` ran."""
        if self.stop_at is not None and b >= self.stop_at:
            return
        job, targets = self._weight_jobs.pop(b)
        t0 = time.perf_counter()
        w0 = time.time()
        if job is not None:
            self._accumulate(targets, job.run())
        self.stats.backward_s += time.perf_counter() - t0
        self.stats.minibatches += 1
        self.hooks.on_weight_backward(b, w0, time.time())

    def _output_grads(self, rec: _InFlight) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The roots of a backward and their gradients (the loss; or the outputs, whose gradients this waits for)."""
        if self.topo.is_last:
            assert rec.loss is not None
            return [rec.loss], [None]
        if self._local_next:  # handed back by the next stage on this process
            assert self.handoff is not None
            b = rec.header.minibatch
            received = self.handoff.take(("grad", self.topo.stage, b), f"stage {self.topo.stage}: the backward of "
                                         f"minibatch {b}")
        else:
            if rec.grad_recv is None:
                raise PipelineSetupError(f"stage {self.topo.stage}: the backward of minibatch "
                                         f"{rec.header.minibatch} runs before its RECV_B: the lowered schedule is out "
                                         "of order")
            _, received = rec.grad_recv.wait()
            self._waited(rec.grad_recv, "gradient")
        floats = [t for t in rec.outputs if t.is_floating_point()]
        pairs = [(o, g) for o, g in zip(floats, received) if o.requires_grad]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _weights(self, rec: _InFlight) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The weight tensors the forward used (its version's, tied ones included) and the parameters their
        gradients go to."""
        state = self.state
        wrt_params = [t for t in rec.version.tensors if t.requires_grad]
        targets = state.live_params
        if state.tied:
            live = [(g.param, v.tensors[0]) for g, v in zip(state.tied.groups, rec.tied) if g.param.requires_grad]
            wrt_params += [t for _, t in live]
            targets = targets + [p for p, _ in live]
        return wrt_params, targets

    def _grad_inputs(self, rec: _InFlight) -> list[torch.Tensor]:
        if self.topo.is_first:
            return []
        return [t for t in rec.inputs if t.is_floating_point() and t.requires_grad]

    def _accumulate(self, targets: list[torch.Tensor], got: Sequence[torch.Tensor | None]) -> None:
        """Add one backward's weight gradients to the parameters' ``grad``. A fresh gradient becomes the ``grad``
        itself; one that is a view, or shares its storage with another of the same backward (autograd may hand the
        same tensor to two parameters), is copied first, since later minibatches add into it in place."""
        seen: set[int] = set()
        for p, g in zip(targets, got):
            if g is None:
                continue
            ptr = g.untyped_storage().data_ptr()
            if p.grad is None:
                shared = ptr in seen or g._base is not None
                p.grad = g.detach() if self.mode.asynchronous or not shared else g.detach().clone()
            else:
                p.grad.add_(g)
            seen.add(ptr)

    def _send_input_grads(self, b: int, wrt_inputs: list[torch.Tensor], got: Sequence[torch.Tensor | None]) -> None:
        """Keep the input gradients of ``b`` for its ``SEND_B``."""
        if not self.topo.is_first:
            grads = [g if g is not None else torch.zeros_like(t) for t, g in zip(wrt_inputs, got)]
            if self._local_prev:
                assert self.handoff is not None
                self.handoff.put(("grad", self.topo.stage - 1, b), grads, f"minibatch {b}'s input gradients")
            else:
                self._grads_out[b] = grads

    def update(self, round_: int) -> None:
        topo, state = self.topo, self.state
        t0 = time.perf_counter()
        w0 = time.time()
        live = state.all_live_params
        round_end = (round_ + 1) * self.mode.update_unit(topo)
        flags = self.cuts.get(round_end, 0)
        if self.group.replica is not None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in live]
            on_host = self.group.flags_on_host
            # else the flags are filled on the device: a tensor built from a Python list would wait for a copy
            flat = torch.cat([g.reshape(-1) for g in grads] +
                             ([] if on_host else [torch.full((1,), float(flags), device=self.device)]))
            work = self.group.replica_allreduce(flat)
            among = f"update {round_} among replicas {list(topo.stage_ranks)}"
            if on_host:  # the sum of the flags on the host, while the device reduces the gradients
                flag_work, summed = self.group.replica_flags(flags)  # type: ignore[misc]
                self.messenger.wait(flag_work, f"cut flags of {among}")
                marks = int(summed[0])
            self.messenger.wait(work, f"gradient all-reduce of {among}")
            if not on_host:
                marks = int(float(flat[-1]))
                flat = flat[:-1]
            if self.mode.asynchronous:
                flat /= topo.replicas[topo.stage]
            offset = 0
            for p in live:
                n = p.numel()
                p.grad = flat[offset: offset + n].view_as(p).clone()
                offset += n
            if marks and not flags:
                # the replica that ran the marked minibatch tells the others through the all-reduce
                flags = self.cuts[round_end] = marks
        self.step()
        state.versions.publish()
        if state.tied:
            state.tied.on_update(round_)
            if flags:  # every holder's tied state at a cut is the same: apply every tied update before it
                state.tied.drain(round_ + 1)
        self.stats.update_s += time.perf_counter() - t0
        self.hooks.on_update(round_, round_end, w0, time.time())
        if flags and self.on_cut is not None:
            del self.cuts[round_end]
            self.on_cut(round_end, flags)

    def _step(self) -> None:
        if self.state.optimizer is not None:
            optimstep.step(self.state.optimizer)
            optimstep.zero_grad(self.state.optimizer)

    def _note_stash(self) -> None:
        versions = self.state.versions
        alive = {id(r.version): r.version for r in self._inflight.values()}
        alive.update({id(v): v for v in versions.history.values()})
        alive[id(versions.current)] = versions.current
        n = len(alive)
        if n > self.stats.peak_stash_versions:
            self.stats.peak_stash_versions = n
            live = versions.current if versions.live else None  # the live weights themselves: no copy held
            self.stats.peak_stash_bytes = sum(v.nbytes for v in alive.values() if v is not live)

    # -- results ----------------------------------------------------------------------------------------------

    def gather_losses(self) -> list[float]:
        """Every minibatch's loss of the current run, in minibatch order, on every rank. A collective."""
        gathered = self.group.all_gather_object(self.losses.pairs() if self.topo.is_last else [])
        merged = sorted(x for part in gathered if part for x in part)
        return [loss for _, loss in merged]

    def abandon(self) -> None:
        """Forget in-flight minibatches, pending receives and cuts: the group they were on failed. Drops every
        reference to its pending operations."""
        self._inflight.clear()
        self._weight_jobs.clear()
        self._act_recv.clear()
        self._grads_out.clear()
        self.cuts.clear()
        self.state.drop_gradients()  # of a backward whose update will never come
        self.stop_at = None
        if self.state.tied:
            self.state.tied.release()
        self.preflight_done = False

    def rewind(self, position: int) -> None:
        """Training goes on from ``position``: forget the losses of the minibatches that will be computed again."""
        self.losses.keep_before(position)

