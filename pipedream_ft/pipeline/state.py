"""A stage's whole training state, which snapshots, restores and reshards itself.

:class:`StageState` holds what a rank must get back to continue exactly where a checkpoint was cut: the stage's
weights, the weight versions its in-flight minibatches read (the stash), the optimizer state, the CPU RNG, the
data position, any user ``extra`` state (objects with ``state_dict``/``load_state_dict``) and *components*
(the data source's state, the LR scheduler, the loss scale: see :mod:`pipedream_ft.pipeline.components`).

:meth:`StageState.capture` returns a *part*: a nested dict of tensors and plain values (the checkpoint format's
unit). :meth:`StageState.restore` loads a part written by the same stage of the same plan; :meth:`StageState.reshard`
gathers this stage's layers from parts written under another plan (an elastic resize): parts name their
parameters by their original model keys and keep optimizer state per parameter, so any partition can find its
layers wherever the old one put them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import PipelineSetupError
from .components import Component
from .tied import TiedParameters
from .versions import Version, VersionStore

__all__ = ["StageState", "merge_parts"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class StageState:
    """The training state of one stage replica.

    ``keep`` is the number of weight versions older than the current one the mode may still read
    (:meth:`~pipedream_ft.pipeline.modes.Mode.versions_kept`).
    """

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, *, stage: int, replica: int,
                 keep: int, extra: dict[str, Any] | None = None, tied: TiedParameters | None = None) -> None:
        self.module = module
        self.stage = stage
        self.replica = replica
        self.keep = keep
        self.tied = tied
        """The parameters this stage shares with other stages (see :mod:`pipedream_ft.pipeline.tied`)."""
        shared = tied.ids if tied is not None else set()
        self.all_params: list[nn.Parameter] = list(module.parameters())
        self.params: list[nn.Parameter] = [p for p in self.all_params if id(p) not in shared]
        """The stage's own parameters (not tied), in optimizer order."""
        self.param_names: list[str] = [n for n, p in module.named_parameters() if id(p) not in shared]
        self.optimizer: torch.optim.Optimizer | None = optimizer_factory(self.params) if self.params else None
        """``None`` for a stage without parameters of its own (the factory is never called with nothing)."""
        self.versions = VersionStore(self.params, keep=keep, alias=keep == 0)
        self.position = 0
        """Minibatches trained so far (the data position)."""
        self.extra: dict[str, Any] = dict(extra or {})
        for name, obj in self.extra.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise PipelineSetupError(f"extra_state {name!r} ({type(obj).__name__}) has no state_dict() and "
                                         "load_state_dict(); it cannot be checkpointed")
        self.components: dict[str, Component] = {}
        """Further state captured and restored with the part (see :mod:`pipedream_ft.pipeline.components`)."""

    @property
    def live_params(self) -> list[nn.Parameter]:
        """The stage's own parameters that train (``requires_grad``), in optimizer order."""
        return [p for p in self.params if p.requires_grad]

    @property
    def all_live_params(self) -> list[nn.Parameter]:
        """Every parameter that trains here, tied ones included (what the replicas all-reduce)."""
        return [p for p in self.all_params if p.requires_grad]

    # -- checkpoint parts ---------------------------------------------------------------------------------------

    def capture(self, cut: int, frozen: Callable[[Any], Any] = lambda value: value) -> dict[str, Any]:
        """This rank's part of the checkpoint at ``cut`` (taken right after its update for minibatch ``cut - 1``).

        ``frozen`` wraps the values whose tensors are never modified afterwards (weight versions, and the
        weights themselves, which right after an update are the newest version), so that a snapshot may refer to
        them instead of copying (see :func:`pipedream_ft.checkpoint.snapshot.immutable`).
        """
        versions = {u: frozen(list(v.tensors)) for u, v in self.versions.saved().items()}
        current = {} if self.versions.predicted or self.versions.live else \
            {id(p): t for p, t in zip(self.params, self.versions.current.tensors)}  # live weights: copied
        if self.tied:
            current.update({id(g.param): g.versions.current.tensors[0] for g in self.tied.groups})
        live = {n: p for n, p in self.module.named_parameters(remove_duplicate=False)}
        model = {k: frozen(current[id(live[k])]) if k in live and id(live[k]) in current else v
                 for k, v in self.module.state_dict().items()}
        state: dict[str, Any] = {
            "position": cut,
            "updates": self.versions.current.updates,
            "stage": self.stage,
            "replica": self.replica,
            "model": model,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "param_names": list(self.param_names),
            "versions": versions,
            "rng": torch.get_rng_state(),
            "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
            "tied": self.tied.capture(frozen) if self.tied else {},
            "components": {name: c.capture(cut) for name, c in self.components.items()},
        }
        device = self.params[0].device if self.params else torch.device("cpu")
        if device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(device)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Load a part written by this same stage replica under this same plan."""
        if state.get("stage") != self.stage or state.get("replica") != self.replica:
            raise PipelineSetupError(
                f"checkpoint part is for stage {state.get('stage')} replica {state.get('replica')}, "
                f"not stage {self.stage} replica {self.replica}"
            )
        self.drop_gradients()
        self.module.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.versions = VersionStore(self.params, updates=int(state["updates"]), keep=self.keep,
                                     alias=self.keep == 0)
        device = self.params[0].device if self.params else torch.device("cpu")
        for u, tensors in state["versions"].items():
            self.versions.add(Version(int(u), tuple(t.to(device).requires_grad_(p.requires_grad)
                                                    for t, p in zip(tensors, self.params))))
        self.position = int(state["position"])
        if self.tied:
            self.tied.restore(state.get("tied", {}))
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        self._load_extra([state])
        for name, c in self.components.items():
            c.restore(state.get("components", {}).get(name))

    def reshard(self, parts: Sequence[dict[str, Any]], cut: int, *, updates_per_round: int, window: int) -> int:
        """Load the checkpoint at ``cut`` written under another plan, gathering this stage's layers from the old
        stages' ``parts``. The pipeline restarts at the first minibatch ``>= cut`` that is a multiple of
        ``window``; returns it. ``updates_per_round``: minibatches per update on this stage."""
        merged = merge_parts(parts, self.param_names, list(self.module.state_dict()))
        self.drop_gradients()
        self.module.load_state_dict(merged["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(merged["optimizer"])
        start = -(-cut // window) * window
        self.versions = VersionStore(self.params, updates=start // updates_per_round, keep=self.keep,
                                     alias=self.keep == 0)
        self.versions.floor = self.versions.current.updates
        if self.tied:
            for g in self.tied.groups:
                g.optimizer.load_state_dict(_single_param_state(parts, g.spec.name, g.optimizer))
            self.tied.reset(self.versions.current.updates)
        self.position = start
        torch.set_rng_state(parts[0]["rng"])
        self._load_extra(parts)
        for name, c in self.components.items():
            c.reshard([p.get("components", {}).get(name) for p in parts])
        return start

    def drop_gradients(self) -> None:
        """Forget every gradient accumulated into the parameters (tied ones included): a rollback must not carry
        the gradient of a minibatch whose update never happened into the redone one."""
        for p in self.all_params:
            p.grad = None

    def _load_extra(self, parts: Sequence[dict[str, Any]]) -> None:
        for name, obj in self.extra.items():
            source = next((p["extra"][name] for p in parts if name in p.get("extra", {})), None)
            if source is None:
                have = sorted(set().union(*(p.get("extra", {}) for p in parts)))
                raise PipelineSetupError(f"checkpoint has no extra state {name!r} (it has {have})")
            obj.load_state_dict(source)


def _per_param_states(parts: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every parameter's optimizer state in the old parts, by name, and the hyper-parameters of a group."""
    states: dict[str, Any] = {}
    hyper: dict[str, Any] = {}
    for part in parts:
        optim, names = part.get("optimizer"), part.get("param_names")
        if optim is not None and names is not None and optim["param_groups"]:
            for index, entry in optim["state"].items():
                states[names[int(index)]] = entry
            hyper = hyper or {k: v for k, v in optim["param_groups"][0].items() if k != "params"}
        for name, tied in part.get("tied", {}).items():
            optim = tied["optimizer"]
            for entry in optim["state"].values():
                states[name] = entry
            hyper = hyper or {k: v for k, v in optim["param_groups"][0].items() if k != "params"}
    return states, hyper


def _single_param_state(parts: Sequence[dict[str, Any]], name: str, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    states, _ = _per_param_states(parts)
    group = {k: v for k, v in optimizer.state_dict()["param_groups"][0].items()}
    group["params"] = [0]
    return {"state": {0: states[name]} if name in states else {}, "param_groups": [group]}


def merge_parts(parts: Sequence[dict[str, Any]], param_names: Sequence[str], state_keys: Sequence[str]
                ) -> dict[str, Any]:
    """Gather one new stage's weights and optimizer state from the old stages' checkpoint parts.

    ``param_names``: the new stage's own parameters in optimizer order; ``state_keys``: its ``state_dict``
    keys. Optimizer state is found by parameter name, whether the old stage held the parameter as its own or as
    a tied one. Raises :class:`PipelineSetupError` naming what is missing.
    """
    model: dict[str, Any] = {}
    for part in parts:
        model.update(part["model"])
        if part.get("param_names") is None:
            raise PipelineSetupError("the checkpoint predates layer-addressable parts (no param_names); "
                                     "it can only be resumed with its own plan")
        optim = part.get("optimizer")
        if optim is not None and len(optim["param_groups"]) != 1:
            raise PipelineSetupError(
                f"re-planning needs a single optimizer parameter group, the checkpoint has {len(optim['param_groups'])}"
            )
    missing = [k for k in state_keys if k not in model]
    if missing:
        raise PipelineSetupError(f"the checkpoint lacks {len(missing)} tensors of this stage, e.g. {missing[:3]}")
    states, hyper = _per_param_states(parts)
    groups = [dict(hyper, params=list(range(len(param_names))))]
    state = {i: states[n] for i, n in enumerate(param_names) if n in states}
    return {"model": {k: model[k] for k in state_keys}, "optimizer": {"state": state, "param_groups": groups}}
