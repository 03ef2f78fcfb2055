"""Materialise part of a model built on the ``meta`` device: real tensors on a device, initialised per layer.

A model built under ``torch.device("meta")`` has the shapes of its parameters and buffers but no storage. The
profiler times such a model one layer at a time: :func:`materialized` gives one module (or one tensor) real
tensors on the profiling device for the duration of a ``with`` block, initialised, and puts the original meta
tensors back after it (the model is left exactly as it was, tied parameters included).

**Initialisation, seeded per layer.** The RNG is seeded from ``(seed, name)`` with a stable hash
(:func:`layer_seed`: SHA-256, not Python's salted ``hash``), so a layer's initial weights depend on the seed and
its qualified name only, not on which other layers are materialised, in which order or in which process. Every
new floating tensor is first filled with zeros (so nothing is left uninitialised memory), then, in
``module.apply`` order (children first), each submodule's own ``reset_parameters()`` runs, then the model's
initialiser (:func:`init_function`: a ``transformers`` model's ``_init_weights``, or a model's own
``_init_weights(module)`` as nanoGPT-style models have). A parameter read directly (an fx ``get_attr``) is
drawn from ``N(0, 0.02²)``.

**Computed buffers.** Buffers are small and several layers may read one (the rotary embedding's ``inv_freq``
feeds every decoder layer); :func:`materialized_buffers` gives the whole model's meta buffers real values once.
A computed buffer (``inv_freq``: non-persistent, derived from the config) holds garbage after ``to_empty``: each
buffer is filled with NaN, the module's ``reset_parameters()`` and the model's initialiser run (transformers'
``_init_weights`` recomputes rotary frequencies), and a buffer still NaN is rebuilt from a fresh copy of its
module built on the CPU from its ``config`` (``type(module)(module.config)``). A buffer nothing can recompute
is refused with a ``ValueError`` naming it.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["InitFn", "has_meta", "init_function", "layer_seed", "materialized", "materialized_buffers"]

InitFn = Callable[[nn.Module], None]
"""Initialises one module in place (called on each submodule, as ``nn.Module.apply`` calls its function)."""

DIRECT_STD = 0.02
"""Standard deviation of a parameter read directly (fx ``get_attr``), which no module initialiser reaches."""


def layer_seed(seed: int, name: str) -> int:
    """A 63-bit RNG seed from ``(seed, name)``: stable across processes, runs and Python versions."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def init_function(model: nn.Module) -> InitFn | None:
    """The model's own initialiser of one module, if it has one.

    A model wrapped by :func:`profiler.hf.for_pipeline` holds its ``transformers`` model's ``_init_weights``
    (``pipeline_init_weights``). Any other model with a callable ``_init_weights(module)`` (a ``transformers``
    ``PreTrainedModel``, nanoGPT-style models) uses that; an ``_init_weights()`` that takes no module is not one
    (``None``: each module's ``reset_parameters()`` alone)."""
    init = getattr(model, "pipeline_init_weights", None)
    if callable(init):
        return init
    init = getattr(model, "_init_weights", None)
    return init if callable(init) and _takes_one_argument(init) else None


def _takes_one_argument(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called as ``fn(module)`` (a model's ``_init_weights(self)`` that walks the model
    itself cannot)."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return len(required) <= 1 <= len(positional) or any(p.kind == p.VAR_POSITIONAL for p in params)


def _fill(t: torch.Tensor, value: float) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(value)
    else:
        t.zero_()


def _initialise(module: nn.Module, init: InitFn | None) -> None:
    def one(m: nn.Module) -> None:
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
        if init is not None:
            init(m)

    module.apply(one)


def _swap(module: nn.Module, device: torch.device, fill: float, params: bool, buffers: bool,
          saved: list[tuple[dict[str, Any], str, Any]]) -> None:
    """Replace ``module``'s meta tensors (and, on another device, its real ones, copied) by new tensors on
    ``device``; the same tensor reached twice gets the same new tensor. Appends to ``saved`` what to put back
    (as it goes: after an error, what was swapped is still put back)."""
    memo: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        tables = ([sub._parameters] if params else []) + ([sub._buffers] if buffers else [])
        for table in tables:
            for key, t in list(table.items()):
                if t is None or (not t.is_meta and t.device == device):
                    continue
                if id(t) not in memo:
                    with torch.no_grad():
                        new = torch.empty_like(t, device=device)
                        if t.is_meta:
                            _fill(new, fill)
                        else:
                            new.copy_(t)
                    memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else new
                saved.append((table, key, t))
                table[key] = memo[id(t)]


def _restore(saved: list[tuple[dict[str, Any], str, Any]]) -> None:
    for table, key, original in reversed(saved):
        table[key] = original


@contextmanager
def materialized(part: nn.Module | tuple[nn.Module, str], device: torch.device | str, *, seed: int, name: str,
                 init: InitFn | None = None) -> Iterator[None]:
    """For the block, ``part``'s meta parameters are real tensors on ``device``, initialised from
    ``(seed, name)`` (module docstring); the original tensors are put back after it, and the new ones freed.

    ``part`` is a module (its parameters; buffers are :func:`materialized_buffers`' business) or
    ``(owner, attribute)``: one parameter or buffer of ``owner``, as an fx ``get_attr`` reads it."""
    device = torch.device(device)
    if isinstance(part, tuple):
        owner, key = part
        table = owner._parameters if key in owner._parameters else owner._buffers
        original = table.get(key)
        if original is None or not original.is_meta:
            yield
            return
        with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(device)):
            torch.manual_seed(layer_seed(seed, name))
            new = torch.randn(original.shape, dtype=original.dtype, device=device) * DIRECT_STD \
                if original.is_floating_point() else torch.zeros_like(original, device=device)
        table[key] = nn.Parameter(new, requires_grad=original.requires_grad) if isinstance(original, nn.Parameter) \
            else new
        try:
            yield
        finally:
            table[key] = original
        return
    if not isinstance(part, nn.Module):
        raise TypeError(f"materialized takes a module or (module, attribute), got {type(part).__name__}")
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        with torch.random.fork_rng(devices=_rng_devices(device)):
            torch.manual_seed(layer_seed(seed, name))
            _swap(part, device, 0.0, params=True, buffers=False, saved=saved)
            if saved:
                with torch.no_grad():
                    _initialise(part, init)
        yield
    finally:
        _restore(saved)


@contextmanager
def materialized_buffers(model: nn.Module, device: torch.device | str, *, init: InitFn | None = None
                         ) -> Iterator[None]:
    """For the block, every meta buffer of ``model`` is a real tensor on ``device``, recomputed as the module
    docstring says; the meta buffers are put back after it. ``ValueError`` names a buffer nothing recomputes."""
    device = torch.device(device)
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for qual, sub in model.named_modules():
            if not any(b is not None and b.is_meta for b in sub._buffers.values()):
                continue
            mine = _swap_direct_buffers(sub, device)
            saved += mine  # before anything that may fail: put back whatever happens
            with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(device)):
                torch.manual_seed(layer_seed(0, qual))
                reset = getattr(sub, "reset_parameters", None)
                try:
                    if callable(reset):
                        reset()
                except (NotImplementedError, RuntimeError):
                    pass  # a reset that also touches its meta parameters: the buffers are what counts here
                if init is not None:
                    init(sub)
                for table, key, _ in mine:
                    if _unset(table[key]):
                        _rebuild(sub, qual, key, table)
        yield
    finally:
        _restore(saved)


def _swap_direct_buffers(sub: nn.Module, device: torch.device) -> list[tuple[dict[str, Any], str, Any]]:
    saved = []
    for key, b in list(sub._buffers.items()):
        if b is None or not b.is_meta:
            continue
        new = torch.empty_like(b, device=device)
        _fill(new, float("nan"))
        saved.append((sub._buffers, key, b))
        sub._buffers[key] = new
    return saved


def _unset(t: torch.Tensor) -> bool:
    return bool((t.is_floating_point() or t.is_complex()) and t.numel() and torch.isnan(t).any())


def _rebuild(sub: nn.Module, qual: str, key: str, table: dict[str, Any]) -> None:
    config = getattr(sub, "config", None)
    where = f"{qual}.{key}" if qual else key
    if config is None:
        raise ValueError(f"buffer {where} of {type(sub).__name__} is on the meta device and nothing recomputes it "
                         "(no reset_parameters() or model initialiser sets it, and the module has no config to "
                         "rebuild it from); build that module with real buffers, or give it a reset_parameters()")
    try:
        with torch.device("cpu"):
            fresh = type(sub)(config)
    except Exception as exc:
        raise ValueError(f"buffer {where}: rebuilding {type(sub).__name__}(config) on the CPU failed "
                         f"({type(exc).__name__}: {exc})") from None
    value = fresh._buffers.get(key)
    if value is None or tuple(value.shape) != tuple(table[key].shape):
        raise ValueError(f"buffer {where}: a {type(sub).__name__} rebuilt from its config has no buffer {key!r} "
                         f"of shape {tuple(table[key].shape)}")
    with torch.no_grad():
        table[key].copy_(value)


def _rng_devices(device: torch.device) -> list[Any]:
    return [device] if device.type == "cuda" else []
