"""Layers a model keeps on one pipeline stage: its ``pipeline_keep_together`` attribute.

A model may name groups of its parts that no plan may split across stages, e.g. a language model's final norm,
head and the logit soft-capping after it::

    class MyLM(nn.Module):
        pipeline_keep_together = (("norm", "lm_head", "<output>"),)

Each group is a sequence of *members*:

* a module path (``"model.norm"``): every layer that calls that module or one of its submodules, reads one of
  its parameters or buffers, or runs inside its forward when fx traces through it (by the fx node's
  ``nn_module_stack``); for an ``nn.Sequential``, the child it names or lies in;
* a parameter or buffer path (``"norm_weight"``): the ``get_attr`` layer reading it;
* :data:`OUTPUT` (``"<output>"``): the layers whose results the model returns.

The group's layers are the members' layers and every layer on a path between two of them (:func:`closure`: a
plan that keeps both ends of a path on one stage keeps the layers on it there too), so ``("norm",
"<output>")`` is the norm and everything after it. :func:`keep_together_groups` resolves the attribute against
a :class:`~profiler.layers.LayerGraph`; the profile records the result as
:class:`~profiler.profile.KeepTogether` groups (a group of one layer is dropped: nothing can split it) and the
partitioner honours them (:mod:`partitioner.together`). :func:`with_keep_together` adds a model's groups to a
profile measured without them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable

from .profile import KeepTogether, Profile

if TYPE_CHECKING:
    from torch import nn

    from .layers import LayerGraph

__all__ = ["ATTRIBUTE", "OUTPUT", "closure", "declared_groups", "keep_together_groups", "with_keep_together"]

ATTRIBUTE = "pipeline_keep_together"
"""Name of the model attribute listing the groups (see the module docstring)."""

OUTPUT = "<output>"
"""Member naming the layers whose results the model returns."""


def closure(members: Iterable[int], edges: Iterable[tuple[int, int]], n: int) -> tuple[int, ...]:
    """``members`` and every layer on a path between two of them, ascending (``edges`` over layers ``0..n-1``)."""
    succ: list[list[int]] = [[] for _ in range(n)]
    pred: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        succ[a].append(b)
        pred[b].append(a)
    start = set(members)

    def reach(adj: list[list[int]]) -> set[int]:
        seen = set(start)
        todo = list(start)
        while todo:
            for v in adj[todo.pop()]:
                if v not in seen:
                    seen.add(v)
                    todo.append(v)
        return seen

    return tuple(sorted(reach(succ) & reach(pred)))


def declared_groups(model: Any) -> tuple[tuple[str, ...], ...]:
    """The groups ``model.pipeline_keep_together`` declares (empty if unset); ValueError if malformed."""
    raw = getattr(model, ATTRIBUTE, None)
    if raw is None:
        return ()
    where = f"{type(model).__name__}.{ATTRIBUTE}"
    if isinstance(raw, (str, bytes)) or not isinstance(raw, (tuple, list)):
        raise ValueError(f"{where} must be a tuple of groups (tuples of module paths), got {raw!r}")
    groups = []
    for group in raw:
        if isinstance(group, (str, bytes)) or not isinstance(group, (tuple, list)) or not group \
                or not all(isinstance(m, str) and m for m in group):
            raise ValueError(f"{where}: each group must be a non-empty tuple of module paths, got {group!r}")
        groups.append(tuple(group))
    return tuple(groups)


def _under(path: str, member: str) -> bool:
    return path == member or path.startswith(member + ".")


def _fx_members(graph: LayerGraph, member: str) -> list[int]:
    nodes = graph.nodes()
    if member == OUTPUT:
        index = {n: i for i, n in enumerate(nodes)}
        assert graph.graph_module is not None
        out = [n for n in graph.graph_module.graph.nodes if n.op == "output"]
        return sorted({index[src] for o in out for src in o.all_input_nodes if src in index})
    found = []
    for i, node in enumerate(nodes):
        if node.op in ("call_module", "get_attr") and _under(str(node.target), member):
            found.append(i)
            continue
        stack = node.meta.get("nn_module_stack") or {}
        paths = [v[0] if isinstance(v, tuple) else k for k, v in stack.items()]
        if any(isinstance(p, str) and _under(p, member) for p in paths):
            found.append(i)
    return found


def _sequential_members(graph: LayerGraph, member: str) -> list[int]:
    if member == OUTPUT:
        return [len(graph.names) - 1]
    return [i for i, name in enumerate(graph.names) if _under(member, name)]


def keep_together_groups(model: Any, graph: LayerGraph) -> list[KeepTogether]:
    """The groups ``model`` declares, as layers of ``graph`` (its layer graph), closed under paths between them.

    Groups that come to fewer than two layers are left out. Raises ValueError naming a member that matches no
    layer.
    """
    out = []
    for group in declared_groups(model):
        layers: set[int] = set()
        for member in group:
            found = (_sequential_members if graph.kind == "sequential" else _fx_members)(graph, member)
            if not found:
                raise ValueError(f"{type(model).__name__}.{ATTRIBUTE}: {member!r} (in group {group!r}) names no "
                                 f"layer: no module, parameter or buffer of that path is used in forward "
                                 f"(layers: {', '.join(graph.names[:8])}{', ...' if len(graph.names) > 8 else ''})")
            layers.update(found)
        closed = closure(layers, graph.edges, len(graph.names))
        if len(closed) >= 2:
            out.append(KeepTogether(" + ".join(group), closed))
    return out


def with_keep_together(profile: Profile, model: nn.Module) -> Profile:
    """``profile`` (of ``model``) with the groups ``model`` declares; ValueError if its layers are not the model's."""
    from .layers import layer_graph

    graph = layer_graph(model)
    names = [l.name for l in profile.layers]
    if names != graph.names:
        diff = next((i for i, (a, b) in enumerate(zip(names, graph.names)) if a != b),
                    min(len(names), len(graph.names)))
        raise ValueError(f"the profile's layers are not {type(model).__name__}'s: {len(names)} layers against "
                         f"{len(graph.names)}, first difference at layer {diff}")
    return replace(profile, keep_together=tuple(graph.keep_together))
