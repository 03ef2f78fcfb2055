"""When a layer's timing may be reused: repeated identical blocks (the decoder layers of an LM) are measured once.

Two module layers are *identical* when their :func:`signature` is equal: the same class and description, the
same parameter and buffer names, shapes and dtypes, the same call (constant arguments) and inputs (tensor shapes, dtypes and whether they
need a gradient; other values as they are), and the same plain settings (ints, floats, strings, booleans and
``None``) on every submodule and on their forward pre-hooks (a Gemma 2 layer's sliding window or attention
type; the hook :func:`profiler.hf.for_pipeline` puts on a decoder layer). Settings whose names start with ``_``
or name the layer's position (``layer_idx``, ``layer_id``, ``layer_index``, ``layer_number``) are left out:
they differ between layers that compute the same thing.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["POSITION_NAMES", "signature"]

POSITION_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})
"""Settings naming a layer's position: not part of what it computes."""

_PLAIN = (int, float, str, bool, type(None))


def _settings(obj: Any) -> tuple[tuple[str, Any], ...]:
    items = []
    for key, value in sorted(vars(obj).items()):
        if key.startswith("_") or key in POSITION_NAMES:
            continue
        if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
            items.append((key, value))
    return tuple(items)


def _value(v: Any) -> Hashable:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), str(v.dtype), bool(v.requires_grad))
    if isinstance(v, _PLAIN) or isinstance(v, (torch.dtype, torch.device, torch.Size)):
        return v
    return type(v).__name__


def signature(module: nn.Module, description: str, inputs: Sequence[Any], call: str = "") -> Hashable:
    """What makes two calls of module layers take the same time (module docstring): ``inputs`` are the values
    the layer reads, in order; ``call`` how it is called besides (its constant arguments)."""
    leaves, spec = tree_flatten(inputs)
    tensors = tuple((name, tuple(t.shape), str(t.dtype))
                    for name, t in (*module.named_parameters(), *module.named_buffers()))
    settings = []
    for name, sub in module.named_modules():
        hooks = tuple(_settings(h) for h in sub._forward_pre_hooks.values() if hasattr(h, "__dict__"))
        settings.append((name, type(sub).__qualname__, _settings(sub), hooks))
    return (type(module).__qualname__, description, call, tensors, str(spec), tuple(_value(v) for v in leaves),
            tuple(settings))
