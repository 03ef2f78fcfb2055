"""Layers that share one stage in every plan, merged into one layer of the search.

Two kinds of groups are kept together:

* the profile's :attr:`~profiler.profile.Profile.keep_together` groups (a model's ``pipeline_keep_together``, see
  :mod:`profiler.together`), e.g. a language model's final norm, head and soft-capping;
* a **parameter read** (a source layer whose description starts with ``get_attr``: fx hoists ``self.w * x``, or
  the weight of a norm fx traces through, into a layer of its own) with its first consumer. Left in the search
  it would be a source of the layer graph, which lands in the first stage, and its tensor would be sent from
  there to its consumer's stage every minibatch. A parameter read with consumers in several places joins the
  first one; the later ones receive it as any activation (the cuts count it).

Groups that share a layer become one, and each group is closed under paths between its layers (a plan that
keeps both ends of a path on one stage keeps the whole path there), so merging a group yields a DAG again.

:func:`merge_groups` builds the search's profile: each group is one layer with the members' summed times and
parameter bytes, whose ``activation_bytes`` is the sum over the members that a layer outside the group reads (or
that nothing reads). That is exact when one member's output leaves the group (norm and head: the logits) and an
upper bound otherwise (a cut counts every leaving member while some of them may already have all their readers
before it). Tied groups and model inputs are renumbered; a tied group that falls inside one merged layer is
dropped (nothing splits it).
"""

from __future__ import annotations

from typing import Sequence

from profiler.profile import KeepTogether, Layer, ModelInput, Profile, TiedGroup
from profiler.together import closure

__all__ = ["PARAMETER_READ", "parameter_reads", "together_groups", "merge_groups"]

PARAMETER_READ = "get_attr"
"""Description prefix of a layer that reads a parameter or buffer (``profiler.layers`` writes ``get_attr <path>``)."""


def parameter_reads(profile: Profile) -> list[tuple[int, int]]:
    """``(reader, first consumer)`` for each parameter-read source layer that some layer consumes."""
    preds = profile.predecessors()
    succ = profile.successors()
    readers = {r for inp in profile.inputs for r in inp.readers}
    out = []
    for i, layer in enumerate(profile.layers):
        if layer.description.split(" ", 1)[0] == PARAMETER_READ and not preds[i] and i not in readers and succ[i]:
            out.append((i, min(succ[i])))
    return out


def together_groups(profile: Profile, extra: Sequence[Sequence[int]] = ()) -> list[tuple[int, ...]]:
    """The groups of ``profile`` to merge: its keep-together groups, ``extra`` groups and its parameter reads with
    their first consumers, united where they share a layer and closed under paths; ascending, disjoint."""
    n = len(profile.layers)
    sets = [set(k.layers) for k in profile.keep_together] + [set(g) for g in extra]
    sets += [set(pair) for pair in parameter_reads(profile)]
    sets = [s for s in sets if len(s) >= 2]
    changed = True
    while changed:
        changed = False
        merged: list[set[int]] = []
        for s in sets:
            for m in merged:
                if m & s:
                    m |= s
                    changed = True
                    break
            else:
                merged.append(set(s))
        closed = [set(closure(m, profile.edges, n)) for m in merged]
        changed = changed or any(len(c) != len(m) for c, m in zip(closed, merged))
        sets = closed
    return sorted(tuple(sorted(s)) for s in sets)


def merge_groups(profile: Profile, groups: Sequence[Sequence[int]]) -> tuple[Profile, tuple[tuple[int, ...], ...]]:
    """The profile with each of the disjoint, path-closed ``groups`` as one layer (see the module docstring), and
    for each of its layers the indices of ``profile``'s layers it stands for (ascending)."""
    n = len(profile.layers)
    owner = list(range(n))  # the representative (first member) of each layer
    members: dict[int, tuple[int, ...]] = {i: (i,) for i in range(n)}
    for g in groups:
        g = tuple(sorted(g))
        if len(g) < 2 or tuple(closure(g, profile.edges, n)) != g:
            raise ValueError(f"a merged group must be two or more layers closed under paths, got {list(g)}")
        for i in g:
            if members.get(i) != (i,) or owner[i] != i:
                raise ValueError(f"merged groups must be disjoint: layer {i} ({profile.layers[i].name}) is in two")
        for i in g:
            owner[i] = g[0]
            members.pop(i)
        members[g[0]] = g
    succ = profile.successors()
    layers: list[Layer] = []
    for rep in sorted(members):
        group = members[rep]
        if len(group) == 1:
            layers.append(profile.layers[rep])
            continue
        inside = set(group)
        ls = [profile.layers[i] for i in group]
        leaving = [l for i, l in zip(group, ls) if not succ[i] or any(c not in inside for c in succ[i])]
        layers.append(Layer(ls[0].name, "together: " + " + ".join(l.name for l in ls),
                            sum(l.forward_ms for l in ls), sum(l.backward_ms for l in ls),
                            sum(l.activation_bytes for l in leaving), sum(l.parameter_bytes for l in ls),
                            weight_backward_ms=(sum(l.weight_backward_ms for l in ls)  # type: ignore[misc]
                                                if all(l.weight_backward_ms is not None for l in ls) else None)))
    order = sorted(members)
    pos = {rep: k for k, rep in enumerate(order)}
    edges = {(profile.layers[owner[a]].name, profile.layers[owner[b]].name) for a, b in profile.edges
             if owner[a] != owner[b]}
    tied = []
    for t in profile.tied:
        held = sorted({pos[owner[i]] for i in t.layers})
        if len(held) >= 2:
            tied.append(TiedGroup(t.name, t.bytes, tuple(held)))
    inputs = [ModelInput(x.name, x.bytes, tuple(sorted({pos[owner[r]] for r in x.readers}))) for x in profile.inputs]
    keep = []
    for k in profile.keep_together:
        held = sorted({pos[owner[i]] for i in k.layers})
        if len(held) >= 2:
            keep.append(KeepTogether(k.name, tuple(held)))
    merged = Profile.from_unordered(layers, sorted(edges), dict(profile.meta), tied, inputs, keep)
    by_name = {profile.layers[rep].name: members[rep] for rep in order}
    return merged, tuple(by_name[l.name] for l in merged.layers)
