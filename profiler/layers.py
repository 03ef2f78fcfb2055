"""A model's layer graph: the unit the profiler measures and the runtime splits into stages.

An ``nn.Sequential`` is a chain of its children. Any other module is traced with ``torch.fx``; every graph
node other than the inputs (``placeholder``) and the ``output`` is a layer, so functional operations such as
a residual ``add`` are layers of their own. The result is deterministic for a given model class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from .profile import Layer, Profile

__all__ = ["LayerGraph", "layer_graph", "structure_profile", "one_line", "tensor_bytes", "fetch_attr", "sequential_children"]


@dataclass
class LayerGraph:
    """Layers of a model in topological order, with their data dependencies."""

    kind: str
    """``"sequential"`` (layer ``i`` is child ``i``) or ``"fx"`` (layer ``i`` is the ``i``-th traced node)."""
    names: list[str]
    """Child names (Sequential) or fx node names."""
    descriptions: list[str]
    """One-line descriptions, e.g. the module's ``repr`` or the function's name."""
    parameter_bytes: list[int]
    """Bytes of each layer's parameters (a shared parameter is counted on its first user only)."""
    edges: list[tuple[int, int]]
    """``(producer, consumer)`` pairs, producer < consumer, sorted."""
    graph_module: torch.fx.GraphModule | None = None
    """The traced module (kind ``"fx"``), sharing submodules and parameters with the model."""
    input_consumers: list[int] = field(default_factory=list)
    """Layers that read one of the model's inputs."""

    def __len__(self) -> int:
        return len(self.names)

    def nodes(self) -> list[torch.fx.Node]:
        """The fx nodes of the layers, in layer order (kind ``"fx"`` only)."""
        if self.graph_module is None:
            raise ValueError("a sequential layer graph has no fx nodes")
        return [n for n in self.graph_module.graph.nodes if n.op not in ("placeholder", "output")]

    def predecessors(self) -> list[list[int]]:
        preds: list[list[int]] = [[] for _ in self.names]
        for a, b in self.edges:
            preds[b].append(a)
        return preds


def one_line(text: str) -> str:
    """Collapse newlines and runs of spaces into single spaces."""
    return " ".join(str(text).split())


def tensor_bytes(value: Any) -> int:
    """Bytes of all tensors in ``value`` (a tensor or nested tuples/lists/dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def _params_bytes(module: nn.Module, seen: set[int]) -> int:
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += tensor_bytes(p)
    return total


def layer_graph(model: nn.Module) -> LayerGraph:
    """Split ``model`` into layers: children of an ``nn.Sequential``, else the nodes of its fx trace."""
    if isinstance(model, nn.Sequential):
        return _sequential_graph(model)
    return _fx_graph(model)


def sequential_children(model: nn.Sequential) -> list[tuple[str, nn.Module]]:
    """The children of ``model`` in the order its forward runs them (a module used twice appears twice)."""
    return [(name, child) for name, child in model._modules.items() if child is not None]


def _sequential_graph(model: nn.Sequential) -> LayerGraph:
    children = sequential_children(model)
    if not children:
        raise ValueError("the nn.Sequential model has no layers")
    seen: set[int] = set()
    return LayerGraph(
        kind="sequential",
        names=[name for name, _ in children],
        descriptions=[one_line(repr(child)) for _, child in children],
        parameter_bytes=[_params_bytes(child, seen) for _, child in children],
        edges=[(i, i + 1) for i in range(len(children) - 1)],
        graph_module=None,
        input_consumers=[0],
    )


def _trace(model: nn.Module) -> torch.fx.GraphModule:
    try:
        return torch.fx.symbolic_trace(model)
    except Exception as exc:  # tracing raises many kinds of errors
        first = one_line(str(exc).splitlines()[0] if str(exc) else "")
        raise ValueError(
            f"cannot trace model {type(model).__name__} with torch.fx ({type(exc).__name__}: {first}); "
            "make its forward traceable (no data-dependent control flow) or express it as an nn.Sequential"
        ) from exc


def _describe(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return one_line(repr(gm.get_submodule(node.target)))
    if node.op == "call_function":
        return getattr(node.target, "__name__", None) or one_line(repr(node.target))
    if node.op == "call_method":
        return "." + str(node.target)
    if node.op == "get_attr":
        return "get_attr " + str(node.target)
    return node.op


def fetch_attr(root: nn.Module, target: str) -> Any:
    """The attribute ``target`` (a dotted path) of ``root``, as an fx ``get_attr`` node reads it."""
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _fx_graph(model: nn.Module) -> LayerGraph:
    gm = _trace(model)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if not nodes:
        raise ValueError(f"model {type(model).__name__} has no layers (its forward returns an input unchanged)")
    index = {n: i for i, n in enumerate(nodes)}
    seen: set[int] = set()
    param_bytes: list[int] = []
    for n in nodes:
        if n.op == "call_module":
            param_bytes.append(_params_bytes(gm.get_submodule(n.target), seen))
        elif n.op == "get_attr":
            value = fetch_attr(gm, n.target)
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                param_bytes.append(tensor_bytes(value))
            else:
                param_bytes.append(0)
        else:
            param_bytes.append(0)
    edges: set[tuple[int, int]] = set()
    consumers: list[int] = []
    for n in nodes:
        for src in n.all_input_nodes:
            if src in index:
                edges.add((index[src], index[n]))
            elif src.op == "placeholder" and index[n] not in consumers:
                consumers.append(index[n])
    return LayerGraph(
        kind="fx",
        names=[n.name for n in nodes],
        descriptions=[_describe(gm, n) for n in nodes],
        parameter_bytes=param_bytes,
        edges=sorted(edges),
        graph_module=gm,
        input_consumers=consumers,
    )


def structure_profile(model: nn.Module) -> Profile:
    """A profile of ``model``'s structure only (zero times and activations); same structure hash as a measured one."""
    graph = layer_graph(model)
    layers = tuple(
        Layer(name=name, description=desc, forward_ms=0.0, backward_ms=0.0, activation_bytes=0.0, parameter_bytes=float(pb))
        for name, desc, pb in zip(graph.names, graph.descriptions, graph.parameter_bytes)
    )
    return Profile(layers, tuple(graph.edges), {"model": type(model).__name__, "structure_only": True})
