"""Tied parameters: one logical parameter used by layers of several stages (GPT-2's ``lm_head.weight is wte.weight``).

As in Megatron-LM and DeepSpeed, every stage that uses the parameter (a *holder*) keeps a copy, and the copies
are kept bitwise equal: at *tied update* ``k`` every holder steps its own optimizer for the parameter (a
separate optimizer made by the same factory, so its state is the same on every holder) with the same gradient,
the sum of all holders' gradients of update ``k`` added in holder order.

**Which version a holder reads.** Gradients reach the stages in reverse order, so the *first* holder (the lowest
stage) is the last to have its gradient of update ``k``. To avoid stalling the others, every holder reads the
tied parameter as the first holder's stage would read its own weights:

* ``stash``: the forward and backward of minibatch ``b`` use the tied parameter after
  ``max(0, b - (S - 1 - s1))`` tied updates (in update rounds with replicated holders), ``s1`` being the first
  holder's stage — the first holder's own weight-stashing rule. A later holder applies tied update ``k`` only
  when a forward needs it; by then the first holder's gradient of ``k`` has been sent (causally, before the
  activations of that minibatch), so nobody waits in steady state.
* ``vertical``: the version stage 0 used for the minibatch, like every other weight.
* ``flush``: all holders apply the window's tied update at the window's update (synchronous SGD; exact).
* ``2bw``: the version every weight of the minibatch's window reads (one tied update behind); the first holder
  applies tied update ``k`` at its update ``k``, the others when a forward needs it, as in ``stash``.

The mode states the rule (:meth:`~pipedream_ft.pipeline.modes.Mode.tied_version`).

At a checkpoint cut every holder first applies every tied update before the cut, so all parts hold the same
tied state. Holder stages must have equal replica counts; replica ``r`` of each holder exchanges with replica
``r`` of the others, after the replicas' own gradient all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from partitioner.plan import PlanError

from ..errors import PipelineSetupError
from . import optimstep
from .connection import Connection
from .modes import Mode
from .topology import Topology
from .versions import Version, VersionStore

__all__ = ["TiedSpec", "TiedParameters", "find_tied", "tie_declared", "TIED_SLOT"]

TIED_SLOT = 17
"""Message slots from here on carry tied gradients (activation slots are 0..16)."""


@dataclass(frozen=True, slots=True)
class TiedSpec:
    """A parameter used by layers of more than one stage."""

    name: str
    """Its first name in the model (``model.named_parameters()``): the name checkpoints keep it under."""
    stages: tuple[int, ...]
    """The stages that use it (holders), ascending."""
    shape: tuple[int, ...]


def _layer_parameters(ml: Any, layer: Any) -> list[nn.Parameter]:
    if layer.op == "module":
        return list(ml.root.get_submodule(layer.target).parameters())
    if layer.op == "attr":
        owner_path, _, attr = layer.target.rpartition(".")
        value = getattr(ml.root.get_submodule(owner_path) if owner_path else ml.root, attr)
        return [value] if isinstance(value, nn.Parameter) else []
    return []


def find_tied(ml: Any, executed: Sequence[Sequence[int]]) -> list[TiedSpec]:
    """The parameters the layers of more than one stage use (``executed[s]``: the layers stage ``s`` runs)."""
    first_name: dict[int, str] = {}
    for name, p in ml.root.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), name)
    users: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for s, run in enumerate(executed):
        for i in run:
            for p in _layer_parameters(ml, ml.layers[i]):
                users.setdefault(id(p), set()).add(s)
                params[id(p)] = p
    specs = [TiedSpec(first_name.get(pid, f"<param {pid}>"), tuple(sorted(st)), tuple(params[pid].shape))
             for pid, st in users.items() if len(st) > 1]
    return sorted(specs, key=lambda t: t.name)


def tie_declared(model: nn.Module, groups: Sequence[Sequence[str]]) -> None:
    """Make each group of parameter names one parameter (the first name's): declared ties between parameters
    that are distinct objects. Raises :class:`PipelineSetupError` naming a missing name or a shape mismatch."""
    for group in groups:
        names = list(group)
        if len(names) < 2:
            raise PipelineSetupError(f"a tied group needs at least two parameter names, got {names}")
        try:
            params = [model.get_parameter(n) for n in names]
        except AttributeError as exc:
            raise PipelineSetupError(f"tied parameter not found in the model: {exc}") from None
        first = params[0]
        for name, p in zip(names[1:], params[1:]):
            if p.shape != first.shape or p.dtype != first.dtype:
                raise PipelineSetupError(
                    f"tied parameters {names[0]} ({list(first.shape)}, {first.dtype}) and {name} "
                    f"({list(p.shape)}, {p.dtype}) differ in shape or dtype; they cannot be one parameter")
            owner_path, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_path) if owner_path else model
            owner._parameters[attr] = first


class _Group:
    """One tied parameter as this rank holds it."""

    def __init__(self, spec: TiedSpec, index: int, param: nn.Parameter, names: list[str], topo: Topology,
                 mode: Mode, optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.spec = spec
        self.index = index
        self.param = param
        self.names = names
        """Its names in this stage's module (the first is given to ``functional_call``; the others follow)."""
        self.first = spec.stages[0]
        self.is_first = topo.stage == self.first
        replicas = {topo.replicas[s] for s in spec.stages}
        if len(replicas) > 1:
            raise PlanError(f"tied parameter {spec.name} is used by stages {list(spec.stages)} with replica counts "
                            f"{[topo.replicas[s] for s in spec.stages]}; its holders need equal replica counts "
                            "(plan with --straight, or keep those layers in one stage)")
        self.partners = {s: topo.plan.stages[s].ranks[topo.replica] for s in spec.stages if s != topo.stage}
        """The rank of every other holder stage this rank exchanges gradients with."""
        self.optimizer = optimizer_factory([param])
        self.scheduler: Any = None
        """Its LR scheduler (built by the trainer's ``scheduler_factory``), stepped after each tied update."""
        self.keep = mode.tied_kept(topo, self.first)
        self.versions = VersionStore([param], keep=self.keep)
        self.grads: dict[int, dict[int, torch.Tensor]] = {}
        """Gradients of pending tied updates: update -> holder stage -> gradient."""
        self.recvs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}

    @property
    def applied(self) -> int:
        return self.versions.current.updates


class TiedParameters:
    """This stage's tied parameters and the protocol that keeps their copies equal (see the module docstring)."""

    def __init__(self, specs: Sequence[TiedSpec], objects: dict[str, nn.Parameter], module: nn.Module,
                 topo: Topology, mode: Mode,
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
                 connection: Connection) -> None:
        """``specs``: every tied parameter of the plan (the same list, in the same order, on every rank);
        ``objects[spec.name]``: the parameter object (this rank's copy); ``module``: this rank's stage."""
        self.topo = topo
        self.mode = mode
        self.connection = connection
        self.defer = False
        """Flush mode on a process of several stages: :meth:`on_update` only sends; the caller applies the tied
        update with :meth:`drain` once every stage of the process has sent (a holder on the same process sends
        its gradient in its own update, which may come after this one)."""
        names_of: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
        self.groups: list[_Group] = []
        for index, spec in enumerate(specs):
            if topo.stage not in spec.stages:
                continue
            param = objects[spec.name]
            if id(param) not in names_of:
                raise PipelineSetupError(f"stage {topo.stage} should hold tied parameter {spec.name}, but its "
                                         "layers do not use it")
            self.groups.append(_Group(spec, index, param, names_of[id(param)], topo, mode, optimizer_factory))
        self.ids = {id(g.param) for g in self.groups}
        self._slots: dict[tuple[int, int], int] = {}
        for g in self.groups:
            for stage in g.partners:
                shared = sorted(h.index for h in self.groups if stage in h.partners)
                slot = TIED_SLOT + shared.index(g.index)
                if slot > 31:
                    raise PlanError(f"stages {topo.stage} and {stage} share more than {31 - TIED_SLOT + 1} tied "
                                    "parameters; keep some of their layers together")
                self._slots[(g.index, stage)] = slot

    def __bool__(self) -> bool:
        return bool(self.groups)

    def attach_schedulers(self, factory: Callable[[torch.optim.Optimizer], Any]) -> None:
        """Give every tied parameter's optimizer a scheduler from ``factory``: stepped after each tied update, so
        the tied parameter follows the same learning-rate schedule as the stage's own parameters."""
        from .scheduler import build_scheduler

        for g in self.groups:
            g.scheduler = build_scheduler(factory, g.optimizer)

    def links(self) -> list[tuple[int, str]]:
        """``(peer, "tied")`` for every rank this one exchanges tied gradients with."""
        return sorted({(peer, "tied") for g in self.groups for peer in g.partners.values()})

    # -- versions -------------------------------------------------------------------------------------------

    def _version_number(self, g: _Group, minibatch: int) -> int | None:
        """Tied updates minibatch ``minibatch`` reads (None: the current version)."""
        return self.mode.tied_version(self.topo, g.first, minibatch)

    def tensors_for(self, minibatch: int) -> tuple[dict[str, torch.Tensor], list[Version]]:
        """The tied tensors the forward of ``minibatch`` reads (by name) and their versions; applies the tied
        updates that have become due on a later holder first."""
        params: dict[str, torch.Tensor] = {}
        versions = []
        for g in self.groups:
            want = self._version_number(g, minibatch)
            if want is not None:
                self._apply_until(g, want)
                version = g.versions.get(want)
            else:
                version = g.versions.current
            params[g.names[0]] = version.tensors[0]
            versions.append(version)
        return params, versions

    # -- updates --------------------------------------------------------------------------------------------

    def on_update(self, round_: int) -> None:
        """This stage's update ``round_`` just took the gradients: send this holder's tied gradients to the other
        holders, and apply the tied update now (the first holder, or every holder in flush mode)."""
        together = self.mode.tied_updates_together
        for g in self.groups:
            grad = g.param.grad
            grad = torch.zeros_like(g.param) if grad is None else grad.detach().clone()
            g.param.grad = None
            g.grads.setdefault(round_, {})[self.topo.stage] = grad
            for stage, peer in g.partners.items():
                self.connection.messenger.send_tensor(peer, round_, self._slots[(g.index, stage)], grad, "tied")
                self._post(g, round_, stage)
            if (together and not self.defer) or (g.is_first and not together):
                self._apply_until(g, round_ + 1)

    def drain(self, updates: int) -> None:
        """Apply every tied update before ``updates`` (a checkpoint cut, or the end of a run)."""
        for g in self.groups:
            self._apply_until(g, updates)

    def _post(self, g: _Group, round_: int, stage: int) -> None:
        key = (round_, stage)
        if key not in g.recvs:
            buf = torch.empty_like(g.param)
            peer = g.partners[stage]
            messenger = self.connection.messenger
            g.recvs[key] = (messenger.recv_tensor(peer, round_, self._slots[(g.index, stage)], buf, "tied"), buf)

    def _apply_until(self, g: _Group, updates: int) -> None:
        while g.applied < updates:
            k = g.applied
            grads = g.grads.get(k, {})
            if self.topo.stage not in grads:
                raise RuntimeError(f"tied parameter {g.spec.name}: update {k} is due before this stage computed its "
                                   "gradient (a schedule error)")
            for stage, peer in g.partners.items():
                if stage not in grads:
                    self._post(g, k, stage)
                    work, buf = g.recvs.pop((k, stage))
                    self.connection.messenger.wait(work,
                                                   f"tied gradient of {g.spec.name}, update {k}, from rank {peer}")
                    grads[stage] = buf
                else:
                    g.recvs.pop((k, stage), None)
            total = None
            for stage in g.spec.stages:  # the same sum, in the same order, on every holder
                total = grads[stage].clone() if total is None else total.add_(grads[stage])
            g.param.grad = total
            optimstep.step(g.optimizer)
            optimstep.zero_grad(g.optimizer)
            if g.scheduler is not None:
                g.scheduler.step()
            g.versions.publish()
            del g.grads[k]

    # -- checkpoint parts -------------------------------------------------------------------------------------

    def capture(self, frozen: Callable[[Any], Any] = lambda value: value) -> dict[str, Any]:
        return {g.spec.name: {"optimizer": g.optimizer.state_dict(), "updates": g.applied,
                              "versions": {u: frozen(v.tensors[0]) for u, v in g.versions.history.items()},
                              "scheduler": g.scheduler.state_dict() if g.scheduler is not None else None}
                for g in self.groups}

    def release(self) -> None:
        """Forget pending gradient exchanges (the group they were on is gone)."""
        for g in self.groups:
            g.recvs.clear()
            g.grads.clear()

    def restore(self, state: dict[str, Any]) -> None:
        for g in self.groups:
            if g.spec.name not in state:
                raise PipelineSetupError(f"the checkpoint has no state for tied parameter {g.spec.name}")
            part = state[g.spec.name]
            g.optimizer.load_state_dict(part["optimizer"])
            if g.scheduler is not None and part.get("scheduler") is not None:
                g.scheduler.load_state_dict(part["scheduler"])
            g.versions = VersionStore([g.param], updates=int(part["updates"]), keep=g.keep)
            for u, t in part["versions"].items():
                g.versions.add(Version(int(u), (t.to(g.param.device).requires_grad_(g.param.requires_grad),)))
            g.grads.clear()
            g.recvs.clear()

    def reset(self, updates: int) -> None:
        """Start over at ``updates`` tied updates with the current weights (a re-planned start)."""
        for g in self.groups:
            g.versions = VersionStore([g.param], updates=updates, keep=g.keep)
            g.versions.floor = updates
            g.grads.clear()
            g.recvs.clear()

