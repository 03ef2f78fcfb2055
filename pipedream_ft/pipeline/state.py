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
                 keep: int, extra: dict[str, Any] | None = None) -> None:
        self.module = module
        self.stage = stage
        self.replica = replica
        self.keep = keep
        self.params: list[nn.Parameter] = [p for p in module.parameters()]
        self.param_names: list[str] = [n for n, _ in module.named_parameters()]
        self.optimizer: torch.optim.Optimizer | None = optimizer_factory(self.params) if self.params else None
        """``None`` for a stage without parameters (the factory is never called with nothing)."""
        self.versions = VersionStore(self.params, keep=keep)
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
        """The parameters that train (``requires_grad``), in optimizer order."""
        return [p for p in self.params if p.requires_grad]

    # -- checkpoint parts ---------------------------------------------------------------------------------------

    def capture(self, cut: int) -> dict[str, Any]:
        """This rank's part of the checkpoint at ``cut`` (taken right after its update for minibatch ``cut - 1``)."""
        versions = {u: list(v.tensors) for u, v in self.versions.history.items()}
        state: dict[str, Any] = {
            "position": cut,
            "updates": self.versions.current.updates,
            "stage": self.stage,
            "replica": self.replica,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "param_names": list(self.param_names),
            "versions": versions,
            "rng": torch.get_rng_state(),
            "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
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
        self.module.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.versions = VersionStore(self.params, updates=int(state["updates"]), keep=self.keep)
        device = self.params[0].device if self.params else torch.device("cpu")
        for u, tensors in state["versions"].items():
            self.versions.add(Version(int(u), tuple(t.to(device).requires_grad_(p.requires_grad)
                                                    for t, p in zip(tensors, self.params))))
        self.position = int(state["position"])
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
        self.module.load_state_dict(merged["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(merged["optimizer"])
        start = -(-cut // window) * window
        self.versions = VersionStore(self.params, updates=start // updates_per_round, keep=self.keep)
        self.versions.floor = self.versions.current.updates
        self.position = start
        torch.set_rng_state(parts[0]["rng"])
        self._load_extra(parts)
        for name, c in self.components.items():
            c.reshard([p.get("components", {}).get(name) for p in parts])
        return start

    def _load_extra(self, parts: Sequence[dict[str, Any]]) -> None:
        for name, obj in self.extra.items():
            source = next((p["extra"][name] for p in parts if name in p.get("extra", {})), None)
            if source is None:
                have = sorted(set().union(*(p.get("extra", {}) for p in parts)))
                raise PipelineSetupError(f"checkpoint has no extra state {name!r} (it has {have})")
            obj.load_state_dict(source)


def merge_parts(parts: Sequence[dict[str, Any]], param_names: Sequence[str], state_keys: Sequence[str]
                ) -> dict[str, Any]:
    """Gather one new stage's weights and optimizer state from the old stages' checkpoint parts.

    ``param_names``: the new stage's parameters in optimizer order; ``state_keys``: its ``state_dict`` keys.
    Raises :class:`PipelineSetupError` naming what is missing.
    """
    model: dict[str, Any] = {}
    opt_state: dict[str, Any] = {}
    groups: list[dict[str, Any]] | None = None
    for part in parts:
        model.update(part["model"])
        names = part.get("param_names")
        if names is None:
            raise PipelineSetupError("the checkpoint predates layer-addressable parts (no param_names); "
                                     "it can only be resumed with its own plan")
        optim = part["optimizer"]
        if optim is None:  # a stage without parameters
            continue
        if len(optim["param_groups"]) != 1:
            raise PipelineSetupError(
                f"re-planning needs a single optimizer parameter group, the checkpoint has {len(optim['param_groups'])}"
            )
        for index, entry in optim["state"].items():
            opt_state[names[int(index)]] = entry
        if groups is None:
            groups = [{k: v for k, v in optim["param_groups"][0].items() if k != "params"}]
    missing = [k for k in state_keys if k not in model]
    if missing:
        raise PipelineSetupError(f"the checkpoint lacks {len(missing)} tensors of this stage, e.g. {missing[:3]}")
    if groups is None:  # no old stage had parameters
        groups = [{}]
    groups[0]["params"] = list(range(len(param_names)))
    state = {i: opt_state[n] for i, n in enumerate(param_names) if n in opt_state}
    return {"model": {k: model[k] for k in state_keys}, "optimizer": {"state": state, "param_groups": groups}}

