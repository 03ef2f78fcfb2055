"""A model's layer graph: the unit the profiler measures and the runtime splits into stages.

An ``nn.Sequential`` is a chain of its children. Any other module is traced with ``torch.fx``; every graph
node other than the inputs (``placeholder``) and the ``output`` is a layer, so functional operations such as
a residual ``add`` are layers of their own. The result is deterministic for a given model class.

**Leaf modules.** The tracer treats the usual ``torch.nn`` modules as single layers and traces through any
other submodule. A model may name more module types to keep whole with a ``pipeline_leaf_modules``
attribute (a tuple of ``nn.Module`` subclasses, on the class or the instance): each call of such a module
becomes one ``call_module`` layer and its forward is not traced. This is how models whose blocks fx cannot
trace (Hugging Face's ``GPT2Block``, see :mod:`profiler.hf`) are split at block boundaries. Everything built
from :func:`layer_graph` (the profile, and the runtime's stages, which use its ``graph_module``) follows.

**Tied parameters.** A parameter reached from several layers (the same ``nn.Parameter`` object in two
``call_module`` layers, a module called twice, or a ``get_attr`` of a parameter another layer also uses, e.g.
GPT-2's ``lm_head.weight is wte.weight``) forms a :class:`~profiler.profile.TiedGroup`; its name is the first
qualified name ``model.named_parameters()`` gives it.

**Kept together.** A model's ``pipeline_keep_together`` attribute names groups of its parts that share one
stage in every plan (:mod:`profiler.together`); :attr:`LayerGraph.keep_together` holds them as layers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten

from .profile import KeepTogether, Layer, ModelInput, Profile, TiedGroup
from .together import keep_together_groups

__all__ = [
    "LEAF_ATTRIBUTE",
    "LayerGraph",
    "layer_graph",
    "structure_profile",
    "one_line",
    "tensor_bytes",
    "has_tensor",
    "fetch_attr",
    "sequential_children",
    "leaf_module_types",
]

LEAF_ATTRIBUTE = "pipeline_leaf_modules"
"""Name of the model attribute listing extra module types the tracer keeps whole (see the module docstring)."""


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
    input_names: list[str] = field(default_factory=list)
    """The model's inputs: fx placeholder names, or ``["input"]`` for an ``nn.Sequential``."""
    input_readers: list[list[int]] = field(default_factory=list)
    """Per input, the layers that read it directly (ascending)."""
    tied: list[TiedGroup] = field(default_factory=list)
    """Parameters used by more than one layer."""
    keep_together: list[KeepTogether] = field(default_factory=list)
    """Groups of layers the model keeps on one stage (``pipeline_keep_together``, see :mod:`profiler.together`)."""

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
    """Bytes of all tensors in ``value`` (a tensor, or nested tuples/lists/dicts/... of them and other leaves)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def has_tensor(value: Any) -> bool:
    """Whether ``value`` holds a tensor anywhere: ``"tensor"`` kind if so, else a ``"value"`` layer's output."""
    if isinstance(value, torch.Tensor):
        return True
    leaves, _ = tree_flatten(value)
    return any(isinstance(t, torch.Tensor) for t in leaves)


def _params_bytes(module: nn.Module, seen: set[int]) -> int:
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += tensor_bytes(p)
    return total


def layer_graph(model: nn.Module) -> LayerGraph:
    """Split ``model`` into layers: children of an ``nn.Sequential``, else the nodes of its fx trace.

    The model's ``pipeline_keep_together`` groups are resolved into :attr:`LayerGraph.keep_together`."""
    graph = _sequential_graph(model) if isinstance(model, nn.Sequential) else _fx_graph(model)
    graph.keep_together = keep_together_groups(model, graph)
    return graph


def sequential_children(model: nn.Sequential) -> list[tuple[str, nn.Module]]:
    """The children of ``model`` in the order its forward runs them (a module used twice appears twice)."""
    return [(name, child) for name, child in model._modules.items() if child is not None]


def _tied_groups(model: nn.Module, layer_params: list[list[nn.Parameter]]) -> list[TiedGroup]:
    """Groups of layers sharing a parameter (by identity), named as ``model.named_parameters()`` first does."""
    users: dict[int, list[int]] = {}
    objects: dict[int, nn.Parameter] = {}
    for i, params in enumerate(layer_params):
        for p in params:
            objects[id(p)] = p
            if i not in users.setdefault(id(p), []):
                users[id(p)].append(i)
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [
        TiedGroup(names.get(key, f"<parameter of layer {layers[0]}>"), float(tensor_bytes(objects[key])),
                  tuple(sorted(layers)))
        for key, layers in users.items()
        if len(layers) > 1
    ]
    return sorted(groups, key=lambda g: g.layers)  # stable: parameters in the order layers reach them


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
        input_names=["input"],
        input_readers=[[0]],
        tied=_tied_groups(model, [list(child.parameters()) for _, child in children]),
    )


def leaf_module_types(model: nn.Module) -> tuple[type, ...]:
    """The module types ``model.pipeline_leaf_modules`` names (empty if unset); ValueError if malformed."""
    leaves = getattr(model, LEAF_ATTRIBUTE, ())
    if isinstance(leaves, type):
        leaves = (leaves,)
    if not isinstance(leaves, (tuple, list)) or not all(
        isinstance(t, type) and issubclass(t, nn.Module) for t in leaves
    ):
        raise ValueError(
            f"{type(model).__name__}.{LEAF_ATTRIBUTE} must be a tuple of nn.Module subclasses, got {leaves!r}"
        )
    return tuple(leaves)


class _PipelineTracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` that also keeps the given module types whole."""

    def __init__(self, leaves: tuple[type, ...]) -> None:
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self._leaves and isinstance(m, self._leaves):
            return True
        return super().is_leaf_module(m, module_qualified_name)


_TRACING = threading.Lock()
"""torch.fx patches ``nn.Module.__call__`` while it traces: one trace at a time in a process (a process that holds
several stages builds them on threads of their own)."""


def _trace(model: nn.Module) -> torch.fx.GraphModule:
    leaves = leaf_module_types(model)
    try:
        tracer = _PipelineTracer(leaves)
        with _TRACING:
            graph = tracer.trace(model)
        return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as exc:  # tracing raises many kinds of errors
        first = one_line(str(exc).splitlines()[0] if str(exc) else "")
        hint = f"list the untraceable blocks' types in {type(model).__name__}.{LEAF_ATTRIBUTE}, "
        raise ValueError(
            f"cannot trace model {type(model).__name__} with torch.fx ({type(exc).__name__}: {first}); "
            f"make its forward traceable (no data-dependent control flow), {hint}or express it as an nn.Sequential"
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
    layer_params: list[list[nn.Parameter]] = []
    for n in nodes:
        params: list[nn.Parameter] = []
        if n.op == "call_module":
            module = gm.get_submodule(n.target)
            params = list(module.parameters())
            param_bytes.append(_params_bytes(module, seen))
        elif n.op == "get_attr":
            value = fetch_attr(gm, n.target)
            if isinstance(value, nn.Parameter):
                params = [value]
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                param_bytes.append(tensor_bytes(value))
            else:
                param_bytes.append(0)
        else:
            param_bytes.append(0)
        layer_params.append(params)
    edges: set[tuple[int, int]] = set()
    consumers: list[int] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    readers: dict[torch.fx.Node, list[int]] = {ph: [] for ph in placeholders}
    for n in nodes:
        for src in n.all_input_nodes:
            if src in index:
                edges.add((index[src], index[n]))
            elif src.op == "placeholder":
                if index[n] not in consumers:
                    consumers.append(index[n])
                if index[n] not in readers[src]:
                    readers[src].append(index[n])
    return LayerGraph(
        kind="fx",
        names=[n.name for n in nodes],
        descriptions=[_describe(gm, n) for n in nodes],
        parameter_bytes=param_bytes,
        edges=sorted(edges),
        graph_module=gm,
        input_consumers=consumers,
        input_names=[ph.name for ph in placeholders],
        input_readers=[sorted(readers[ph]) for ph in placeholders],
        tied=_tied_groups(model, layer_params),
    )


def structure_profile(model: nn.Module) -> Profile:
    """A profile of ``model``'s structure only (zero times and activations); same structure hash as a measured one.

    Nothing is run, so every layer has kind ``"tensor"`` and inputs have 0 bytes; tied and keep-together groups
    are found.
    """
    graph = layer_graph(model)
    layers = tuple(
        Layer(name=name, description=desc, forward_ms=0.0, backward_ms=0.0, activation_bytes=0.0, parameter_bytes=float(pb))
        for name, desc, pb in zip(graph.names, graph.descriptions, graph.parameter_bytes)
    )
    inputs = tuple(ModelInput(name, 0.0, tuple(r)) for name, r in zip(graph.input_names, graph.input_readers))
    return Profile(layers, tuple(graph.edges), {"model": type(model).__name__, "structure_only": True},
                   tuple(graph.tied), inputs, tuple(graph.keep_together))
