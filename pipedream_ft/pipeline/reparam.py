"""Run a stage's module on a weight version: other tensors in the places of its parameters, for one call.

The forward of a minibatch reads the weight version its mode picks (weight stashing), so each forward runs the
module with that version's tensors in place of its parameters. ``torch.func.functional_call`` does this for any
module, working out again at every call where each named tensor goes (ties included); a stage runs the same
module thousands of times, so :class:`Reparametrized` works the places out once — every ``(submodule, name)``
slot that holds each parameter, a parameter shared by several submodules filling all of them — and a call only
swaps the slots' entries and puts the parameters back, even when the forward raises.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["Reparametrized"]


class Reparametrized:
    """``module`` with the slots of each of its parameters, by every name the parameter has."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        slots: dict[int, list[tuple[nn.Module, str]]] = {}
        seen: set[tuple[int, str]] = set()
        for _, sub in module.named_modules(remove_duplicate=False):
            for leaf, p in sub._parameters.items():
                if p is None or (id(sub), leaf) in seen:
                    continue
                seen.add((id(sub), leaf))
                slots.setdefault(id(p), []).append((sub, leaf))
        self._slots: dict[str, list[tuple[nn.Module, str]]] = {
            name: slots[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}
        """Parameter name (any of a shared parameter's names) -> every slot holding that parameter."""

    def __call__(self, tensors: Mapping[str, torch.Tensor], args: tuple[Any, ...]) -> Any:
        """``module(*args)`` with ``tensors[name]`` in place of the parameter called ``name``; a name the module
        does not have raises :class:`KeyError` naming it."""
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for name, t in tensors.items():
                try:
                    places = self._slots[name]
                except KeyError:
                    raise KeyError(f"the stage's module has no parameter {name!r}") from None
                for sub, leaf in places:
                    entries = sub._parameters
                    swapped.append((entries, leaf, entries[leaf]))
                    entries[leaf] = t
            return self.module(*args)
        finally:
            for entries, leaf, p in reversed(swapped):
                entries[leaf] = p
