"""Value layers out of the search: only tensors cross stage boundaries.

A *value* layer (``Layer.kind == "value"``: ``x.size()``, ``getitem`` of a size, ``floordiv`` of ints, ...) is
never sent between stages; a stage that needs it recomputes it from its *tensor roots*: the nearest
tensor-kind layers (or model inputs) that its ancestry through value layers reads. So a value layer is no cut
point, and a layer that reads a value layer really depends on that value's tensor roots.

:func:`contract` builds the profile the antichain search sees: the tensor layers only, where an edge ``p -> c``
from a value layer ``p`` is replaced by edges ``r -> c`` from each tensor root ``r`` of ``p``. The bytes that
cross a cut of the contracted profile are then exactly the tensor layers that really cross (including the
roots a later stage needs to recompute its values). Model inputs reached through value layers become
readers of those inputs, so an input a later stage needs is counted too. Tied groups are renumbered (a
value layer cannot hold a parameter; any listed one is dropped). The value layers' own times are not counted
(shape arithmetic takes microseconds, and a stage recomputes only what it reads). Keep-together groups lose
their value layers.

Then the layers that share one stage in every plan (the profile's keep-together groups, and each parameter read
with its first consumer: :mod:`partitioner.together`) are merged into one layer each: no cut falls inside them.

Not counted: a value layer that nothing but the model's output reads is recomputed in the last stage from
roots the search does not route there (the profile does not say which sinks feed the output; models return
tensors). A tensor layer that feeds only the output is a sink, so every cut after it counts it.

:func:`place_values` gives each value layer the stage of its earliest consumer (the last stage if nothing
reads it), which keeps every edge going forward; the runtime recomputes value layers wherever they are
needed, whatever stage they are listed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from profiler.profile import KeepTogether, ModelInput, Profile, TiedGroup

from .plan import PlanError
from .together import merge_groups, together_groups

__all__ = ["Contracted", "tensor_roots", "contract", "place_values"]


@dataclass(frozen=True)
class Contracted:
    """The search's view of a profile and the way back to the original layer indices."""

    profile: Profile
    """Tensor layers only (same order), edges through value layers replaced by edges from their roots, each group
    kept together merged into one layer (:mod:`partitioner.together`)."""
    tensor_layers: tuple[int, ...]
    """Original indices of the tensor layers, ascending."""
    value_layers: tuple[int, ...]
    """Original indices of the value layers, ascending."""
    members: tuple[tuple[int, ...], ...]
    """Per layer of :attr:`profile`, the original layers it stands for (ascending; one unless merged)."""


def tensor_roots(profile: Profile) -> tuple[list[frozenset[int]], list[frozenset[int]]]:
    """Per layer: its tensor roots (original layer indices) and the model inputs (indices into ``profile.inputs``).

    For a tensor layer ``i`` the roots are ``{i}`` and no inputs; for a value layer, the union over its
    predecessors (a tensor predecessor is a root itself) plus the inputs it or its value ancestors read.
    """
    preds = profile.predecessors()
    reads_input: list[set[int]] = [set() for _ in profile.layers]
    for k, inp in enumerate(profile.inputs):
        for r in inp.readers:
            reads_input[r].add(k)
    roots: list[frozenset[int]] = []
    inputs: list[frozenset[int]] = []
    for i, layer in enumerate(profile.layers):
        if layer.kind != "value":
            roots.append(frozenset((i,)))
            inputs.append(frozenset())
            continue
        r: set[int] = set()
        x: set[int] = set(reads_input[i])
        for p in preds[i]:
            r |= roots[p]
            x |= inputs[p]
        roots.append(frozenset(r))
        inputs.append(frozenset(x))
    return roots, inputs


def contract(profile: Profile) -> Contracted:
    """The profile the antichain search runs on: tensor layers only (see the module docstring), then the groups
    kept on one stage merged (:func:`partitioner.together.merge_groups`)."""
    small, kept, values = _tensor_profile(profile)
    groups = together_groups(small)
    if not groups:
        return Contracted(small, kept, values, tuple((i,) for i in kept))
    try:
        merged, parts = merge_groups(small, groups)
    except ValueError as exc:  # cannot happen for groups from together_groups
        raise PlanError(f"cannot keep layers together: {exc}") from None
    return Contracted(merged, kept, values, tuple(tuple(kept[i] for i in part) for part in parts))


def _tensor_profile(profile: Profile) -> tuple[Profile, tuple[int, ...], tuple[int, ...]]:
    """The tensor-layer profile, the original index of each of its layers, and the value layers."""
    values = tuple(i for i, layer in enumerate(profile.layers) if layer.kind == "value")
    if not values:
        return profile, tuple(range(len(profile.layers))), ()
    if len(values) == len(profile.layers):
        names = ", ".join(profile.layers[i].name for i in values[:5])
        raise PlanError(f"the profile has only value layers ({names}, ...): nothing to place in a pipeline")
    roots, inputs = tensor_roots(profile)
    kept = tuple(i for i, layer in enumerate(profile.layers) if layer.kind != "value")
    new = {old: k for k, old in enumerate(kept)}
    preds = profile.predecessors()
    edges: set[tuple[int, int]] = set()
    readers: list[set[int]] = [{new[r] for r in inp.readers if r in new} for inp in profile.inputs]
    for c in kept:
        for p in preds[c]:
            for r in roots[p]:
                edges.add((new[r], new[c]))
            for k in inputs[p]:
                readers[k].add(new[c])
    tied = []
    for g in profile.tied:
        layers = tuple(new[i] for i in g.layers if i in new)
        if len(layers) >= 2:
            tied.append(TiedGroup(g.name, g.bytes, layers))
    model_inputs = tuple(ModelInput(x.name, x.bytes, tuple(sorted(r))) for x, r in zip(profile.inputs, readers))
    keep = []
    for k in profile.keep_together:  # a value layer is recomputed wherever it is read: no member to keep
        layers = tuple(new[i] for i in k.layers if i in new)
        if len(layers) >= 2:
            keep.append(KeepTogether(k.name, layers))
    small = Profile(tuple(profile.layers[i] for i in kept), tuple(sorted(edges)), dict(profile.meta),
                    tuple(tied), model_inputs, tuple(keep))
    return small, kept, values


def place_values(profile: Profile, stage_of: Sequence[int | None], num_stages: int) -> list[int]:
    """``stage_of`` with every value layer (entries None) given the stage of its earliest consumer.

    A value layer nothing reads goes to the last stage. Tensor layers keep their stage.
    """
    succ = profile.successors()
    out: list[int | None] = list(stage_of)
    for i in range(len(out) - 1, -1, -1):  # consumers come later in topological order
        if out[i] is None:
            placed = [out[c] for c in succ[i]]
            out[i] = min((s for s in placed if s is not None), default=num_stages - 1)
    return [int(s) for s in out]  # type: ignore[arg-type]
