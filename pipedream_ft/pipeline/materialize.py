"""Giving a model built on the ``meta`` device real tensors: only the ones a process needs, initialised the same
whatever the plan.

A model built under ``torch.device("meta")`` has parameters and buffers with shapes and no storage, so a
process can build the whole model for nothing and :func:`materialize` only its own stage's tensors. How they get
their values (:data:`Init`):

* :class:`SeededInit` (the default): the model's own initialisation, module by module. Each module that owns
  tensors directly is initialised alone, with the CPU RNG seeded from ``(seed, the module's qualified name)``
  through a stable hash: its ``reset_parameters()`` (or ``_reset_parameters()``), then the model's
  ``_init_weights(module)`` if it has one (a transformers model's; a :func:`profiler.hf.for_pipeline` wrapper's
  ``pipeline_init_weights``), which also recomputes computed buffers (rotary ``inv_freq``, Gemma's
  ``embed_scale``). The values depend on nothing but the seed and the name: not on the plan, the number of
  processes or a resize. ``materialize(model)`` on the whole meta model is the one-process reference.
* :class:`FromFile`: the tensors read from a weights file, only those of the stage (see
  :mod:`pipedream_ft.checkpoint.weights_file`): a safetensors file, a sharded Hugging Face directory, a
  ``torch.save`` state dict or a pipedream-ft checkpoint. A tensor known by several names (tied weights) is read
  under the first of its names the file holds, by every holder. Non-persistent buffers (not in any file) get
  the seeded initialisation. File keys that match no tensor of the model (``strict``), and tensors of the model
  the file lacks, raise :class:`PipelineSetupError` naming them: the same on every rank, since every rank checks
  the whole (meta) model.

A tensor used under several names (``lm_head.weight is wte.weight``) stays one tensor; its value is the one its
*first* owner (the first module holding it, in ``named_modules`` order) gives it, so a stage holding only the
second name gets the same value. A floating-point tensor that no initialisation wrote (a module with its own
``nn.Parameter`` and no ``reset_parameters``) raises :class:`PipelineSetupError` naming it.

Besides the tensors of the stage's modules, those of modules its layers' forward hooks refer to (the rotary
embedding a :func:`~profiler.hf.for_pipeline` decoder layer's hook computes positions with) are materialised.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Union

import torch
from torch import nn

from profiler.materialize import has_meta, init_function, layer_seed

from ..errors import InvalidArgument, PipelineSetupError

__all__ = ["FromFile", "Init", "SeededInit", "as_init", "has_meta", "layer_seed", "materialize", "materialize_stage"]


@dataclass(frozen=True, slots=True)
class SeededInit:
    """The model's own initialisation, each module seeded from ``(seed, its qualified name)`` (module docstring)."""

    seed: int | None = None
    """``None``: the job's seed (``PipelineConfig.seed``)."""


@dataclass(frozen=True, slots=True)
class FromFile:
    """Weights read from ``path``, only the stage's tensors (module docstring)."""

    path: str
    """A ``.safetensors`` file, a Hugging Face directory, a ``torch.save`` state dict or a pipedream-ft checkpoint
    directory."""
    strict: bool = True
    """File keys that match no tensor of the model are an error."""


Init = Union[SeededInit, FromFile, str]
"""How a meta model's tensors get their values: ``"seeded"`` means ``SeededInit()``, any other string
``FromFile(string)``."""


def as_init(init: Init | None) -> SeededInit | FromFile:
    """``init`` as a :class:`SeededInit` or :class:`FromFile` (``None``: ``SeededInit()``)."""
    if init is None or init == "seeded":
        return SeededInit()
    if isinstance(init, str):
        return FromFile(init)
    if isinstance(init, (SeededInit, FromFile)):
        return init
    raise InvalidArgument(f"init must be SeededInit(...), FromFile(...), 'seeded' or a path, got {init!r}")


_Slot = tuple[nn.Module, str, str]  # (module, "p" or "b", attribute)


def _direct(m: nn.Module) -> Iterable[tuple[str, str, torch.Tensor]]:
    for n, t in m._parameters.items():
        if t is not None:
            yield "p", n, t
    for n, t in m._buffers.items():
        if t is not None:
            yield "b", n, t


def _set(m: nn.Module, kind: str, name: str, t: torch.Tensor) -> None:
    (m._parameters if kind == "p" else m._buffers)[name] = t  # type: ignore[index,assignment]


def _hook_modules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Modules the forward hooks of ``modules`` hold (one attribute deep)."""
    out: list[nn.Module] = []
    for m in modules:
        for hook in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]:
            owner = hook.__self__ if isinstance(hook, types.MethodType) else hook
            for value in getattr(owner, "__dict__", {}).values():
                if isinstance(value, nn.Module):
                    out.append(value)
    return out


def _own_init(m: nn.Module, root_init: Callable[[nn.Module], Any] | None) -> None:
    reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
    if callable(reset):
        reset()
    if root_init is not None:
        root_init(m)


def materialize(model: nn.Module, names: Iterable[str] | None = None, *, init: Init | None = None,
                seed: int = 0) -> nn.Module:
    """Give the tensors of ``model``'s submodules ``names`` (qualified names; ``None``: the whole model) real
    CPU storage and values from ``init`` (module docstring), in place; returns ``model``. On a whole meta model
    built by every process the same way, this is the one-process reference of a meta-built pipeline."""
    if names is None:
        return materialize_stage(model, [model], init=init, seed=seed)
    return materialize_stage(model, [model.get_submodule(n) for n in names], init=init, seed=seed)


def materialize_stage(model: nn.Module, parts: Iterable[nn.Module], *, init: Init | None = None, seed: int = 0,
                      also: Iterable[nn.Module] = ()) -> nn.Module:
    """Materialise, in place, every tensor of the modules ``parts`` (and of the modules their forward hooks
    refer to) on the CPU, with values from ``init``: ``model`` is the whole model (names, seeds, the file's keys
    and the model's own init come from it). Every slot holding one of those tensors — in ``model``, in ``parts``
    and in ``also`` (other module trees sharing the same objects, e.g. an fx ``GraphModule``) — gets the new
    tensor. Returns ``model``."""
    chosen = as_init(init)
    parts = list(parts)
    owner: dict[int, tuple[str, nn.Module]] = {}
    for q, m in model.named_modules(remove_duplicate=False):
        for _, _, t in _direct(m):
            owner.setdefault(id(t), (q, m))
    wanted: dict[int, torch.Tensor] = {}
    scope = [m for p in parts for m in p.modules()]
    for m in scope + _hook_modules(scope):
        for sub in m.modules():
            for _, _, t in _direct(sub):
                wanted[id(t)] = t
    unknown = [i for i in wanted if i not in owner]
    if unknown:
        raise PipelineSetupError(f"{len(unknown)} tensors of the stage are not the model's own (e.g. shape "
                                 f"{list(wanted[unknown[0]].shape)}); build the stage from the model")
    persistent: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        persistent.setdefault(id(t), []).append(key)
    reader = None
    file_keys: set[str] = set()
    if isinstance(chosen, FromFile):
        from ..checkpoint.weights_file import open_weights

        reader = open_weights(chosen.path)
        file_keys = set(reader.keys())
        _check_keys(chosen, reader.keys(), model, persistent)
    job_seed = chosen.seed if isinstance(chosen, SeededInit) and chosen.seed is not None else seed
    root_init = init_function(model)
    made: dict[int, torch.Tensor] = {}
    owners: dict[str, nn.Module] = {}
    for i in wanted:
        q, m = owner[i]
        owners.setdefault(q, m)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for q, m in owners.items():
                _init_owner(q, m, wanted, owner, made, persistent, reader, file_keys, job_seed, root_init)
    finally:
        if reader is not None:
            reader.close()
    unset = [_name_of(i, owner) for i, t in made.items()
             if (reader is None or i not in persistent) and t.is_floating_point() and bool(torch.isnan(t).any())]
    if unset:
        raise PipelineSetupError(f"no initialisation wrote {', '.join(sorted(unset)[:5])}"
                                 f"{f' (and {len(unset) - 5} more)' if len(unset) > 5 else ''}: give its module a "
                                 "reset_parameters(), or load the weights from a file (init=FromFile(path))")
    trees = [model, *parts, *also]
    for tree in trees:
        for m in tree.modules():
            for kind, n, t in list(_direct(m)):
                new = made.get(id(t))
                if new is not None:
                    _set(m, kind, n, new)
    return model


def _name_of(i: int, owner: dict[int, tuple[str, nn.Module]]) -> str:
    q, m = owner[i]
    for _, n, t in _direct(m):
        if id(t) == i:
            return f"{q}.{n}" if q else n
    return q


def _init_owner(q: str, m: nn.Module, wanted: dict[int, torch.Tensor], owner: dict[int, tuple[str, nn.Module]],
                made: dict[int, torch.Tensor], persistent: dict[int, list[str]], reader: Any, keys: set[str],
                seed: int,
                root_init: Callable[[nn.Module], Any] | None) -> None:
    """Give module ``m`` (named ``q``) fresh tensors, initialise them, keep those it owns and the stage wants."""
    originals = list(_direct(m))
    fresh: dict[int, torch.Tensor] = {}
    for kind, n, t in originals:
        if id(t) in fresh:
            continue
        new = torch.empty_like(t, device="cpu")
        if new.is_floating_point():
            new.fill_(math.nan)
        fresh[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if kind == "p" else new
    mine = [i for i in fresh if owner[i][1] is m and i in wanted]
    needs_init = reader is None or any(i not in persistent for i in fresh)
    if needs_init:
        for kind, n, t in originals:
            _set(m, kind, n, fresh[id(t)])
        try:
            torch.default_generator.manual_seed(layer_seed(seed, q))
            _own_init(m, root_init)
        finally:
            for kind, n, t in originals:
                _set(m, kind, n, t)
    if reader is not None:
        for i in mine:
            if i in persistent:
                key = next(k for k in persistent[i] if k in keys)
                value = reader.read(key)
                target = fresh[i]
                if tuple(value.shape) != tuple(target.shape):
                    raise PipelineSetupError(f"{reader.path}: {key} has shape {list(value.shape)}, the model's "
                                             f"{list(target.shape)}")
                target.copy_(value)
    for i in mine:
        made[i] = fresh[i]


def _check_keys(init: FromFile, keys: list[str], model: nn.Module, persistent: dict[int, list[str]]) -> None:
    """Every persistent tensor of the model under one of its names in the file; with ``strict``, every key of the
    file a tensor of the model's."""
    have = set(keys)
    known = {k for names in persistent.values() for k in names}
    missing = [names[0] for names in persistent.values() if not any(k in have for k in names)]
    if missing:
        raise PipelineSetupError(f"{init.path} lacks {len(missing)} tensors of the model: {_some(missing)}")
    extra = [k for k in keys if k not in known]
    if extra and init.strict:
        raise PipelineSetupError(f"{init.path} holds {len(extra)} tensors that match nothing in the model: "
                                 f"{_some(extra)} (FromFile(path, strict=False) ignores them)")


def _some(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
