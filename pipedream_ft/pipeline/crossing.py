"""What crosses a stage boundary: the values a stage passes on, flattened into tensors.

A value crossing a boundary is whatever a layer returned: a tensor, or a tuple, list or dict whose leaves are
tensors and constants (``None``, numbers — an HF block returning ``(hidden, None)``, a ``split`` returning a
tuple of tensors). It crosses as its tensor leaves, in order. Its :class:`Structure` — the containers and the
constant leaves — is sent to the next stage once, during the pre-flight, and every later send is checked
against it, so a structure or constant that changes between minibatches stops the run with a clear message
instead of being silently misread. (Values holding no tensor at all never cross: the stages recompute them,
see :func:`~pipedream_ft.pipeline.stage.executed_layers`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from .comm import ShapeMismatchError

__all__ = ["Structure", "outgoing", "without_tensor"]


@dataclass(frozen=True)
class Structure:
    """The shape of a list of crossing values, without their tensors."""

    spec: TreeSpec
    constants: tuple[tuple[int, Any], ...]
    """``(leaf index, value)`` of every leaf that is not a tensor."""
    plain: bool
    """Every value is a single tensor (the common case: nothing to rebuild)."""

    @staticmethod
    def split(values: Sequence[Any]) -> tuple[Structure, list[torch.Tensor]]:
        """The structure of ``values`` and their tensor leaves, in order."""
        if all(isinstance(v, torch.Tensor) for v in values):
            plain = _PLAIN.get(len(values))
            if plain is None:  # made once per count: a stage's outputs have the same structure every minibatch
                _, spec = tree_flatten(list(values))
                plain = _PLAIN[len(values)] = Structure(spec, (), True)
            return plain, list(values)
        leaves, spec = tree_flatten(list(values))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        constants = tuple((i, x) for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor))
        return Structure(spec, constants, False), tensors

    def join(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The values, rebuilt from their tensor leaves."""
        if self.plain:
            return list(tensors)
        leaves: list[Any] = []
        it = iter(tensors)
        consts = dict(self.constants)
        for i in range(self.spec.num_leaves):
            leaves.append(consts[i] if i in consts else next(it))
        return list(tree_unflatten(leaves, self.spec))

    def __reduce__(self) -> tuple[Any, ...]:  # TreeSpec itself is not meant to be pickled
        return _structure, (treespec_dumps(self.spec), self.constants, self.plain)

    def check(self, other: Structure, names: Sequence[str], minibatch: int) -> None:
        """Raise :class:`ShapeMismatchError` if ``other`` (this minibatch's) differs from this (the pre-flight's)."""
        if other.spec != self.spec or other.constants != self.constants:
            raise ShapeMismatchError(
                f"the values crossing to the next stage ({', '.join(names)}) changed structure at minibatch "
                f"{minibatch}: {_describe(other)} instead of {_describe(self)} at the pre-flight; the layers "
                "must return the same containers and constants for every minibatch"
            )


_PLAIN: dict[int, Structure] = {}
"""The structure of ``n`` plain tensors, by ``n``."""


def _structure(spec: str, constants: tuple[tuple[int, Any], ...], plain: bool) -> Structure:
    return Structure(treespec_loads(spec), constants, plain)


def _describe(s: Structure) -> str:
    consts = ", ".join(f"leaf {i} = {v!r}" for i, v in s.constants[:4])
    return f"{s.spec.num_leaves} leaves" + (f" ({consts})" if consts else "")


def without_tensor(values: Sequence[Any], names: Sequence[str]) -> list[str]:
    """Names of the ``values`` that hold no tensor at all (those must never cross: the stages recompute them)."""
    return [n for n, v in zip(names, values)
            if not isinstance(v, torch.Tensor) and not any(isinstance(x, torch.Tensor) for x in tree_flatten(v)[0])]


def outgoing(values: Sequence[Any], names: Sequence[str]) -> tuple[Structure, list[torch.Tensor]] | list[str]:
    """What a stage sends for ``values`` (its outputs, named ``names``): their structure and tensor leaves, as
    training, the pre-flight, :func:`~pipedream_ft.pipeline.check.check_plan` and evaluation all send them —
    or, if some hold no tensor, their names (the caller raises its own error naming them)."""
    bad = without_tensor(values, names)
    return bad if bad else Structure.split(values)
