"""Cut a model into the stage a rank runs.

A model is seen as a list of *layers* in topological order — the children of an ``nn.Sequential``, or the
nodes of its ``torch.fx`` trace otherwise — the same layers, with the same names, as the profiler measured.
:func:`build_stage` keeps only the layers of one stage and works out which values cross each stage boundary:
a value produced before stage ``s`` (or a model input) that stage ``s`` or a later one reads. Stage ``s``
receives those values and sends on the ones a later stage still needs, so a skip connection spanning several
stages is passed through the stages in between and communication is only ever between neighbours.

The stage module mirrors the original module tree (only the kept layers are grafted in), so its
``state_dict`` keys are the original model's keys.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn
from torch.fx.node import map_aggregate

from partitioner.plan import Plan, PlanError
from profiler.layers import layer_graph, sequential_children

__all__ = ["ModelLayers", "StageModule", "model_layers", "build_stage", "boundaries", "executed_layers"]


_IN_PLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                                  operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                                  operator.ilshift, operator.irshift, operator.imatmul})
"""``x += y`` and the like, as fx records them: they modify their first argument."""


@dataclass(frozen=True, slots=True)
class _Ref:
    """A reference to another value (a layer's output or a model input) inside a layer's arguments."""

    name: str


@dataclass(slots=True)
class _Layer:
    name: str
    op: str  # "module", "function", "method", "attr"
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def refs(self) -> list[str]:
        out: list[str] = []
        map_aggregate((self.args, self.kwargs), lambda a: out.append(a.name) if isinstance(a, _Ref) else None)
        return out


@dataclass(slots=True)
class ModelLayers:
    """The model as an ordered list of layers, with its inputs and its output expression."""

    root: nn.Module
    inputs: list[str]
    layers: list[_Layer]
    output: Any  # structure of _Ref / constants

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]


def model_layers(model: nn.Module) -> ModelLayers:
    """List ``model``'s layers: children of an ``nn.Sequential``, else the nodes of its fx trace."""
    if isinstance(model, nn.Sequential):
        layers = []
        prev = "input"
        for name, _child in sequential_children(model):
            layers.append(_Layer(name, "module", name, (_Ref(prev),), {}))
            prev = name
        if not layers:
            raise ValueError("the model is an empty nn.Sequential")
        return ModelLayers(model, ["input"], layers, _Ref(prev))
    gm = layer_graph(model).graph_module  # the profiler's trace: same layers, same names
    assert gm is not None
    inputs: list[str] = []
    layers = []
    output: Any = None
    to_ref = lambda a: _Ref(a.name) if isinstance(a, torch.fx.Node) else a  # noqa: E731
    for node in gm.graph.nodes:
        args = map_aggregate(node.args, to_ref)
        kwargs = map_aggregate(dict(node.kwargs), to_ref)
        if node.op == "placeholder":
            inputs.append(node.name)
        elif node.op == "output":
            output = args[0]
        else:
            op = {"call_module": "module", "call_function": "function", "call_method": "method", "get_attr": "attr"}[node.op]
            layers.append(_Layer(node.name, op, node.target, tuple(args), kwargs))
    return ModelLayers(gm, inputs, layers, output)


def executed_layers(ml: ModelLayers, layer_to_stage: Sequence[int], num_stages: int,
                    recompute: Iterable[int] = ()) -> list[list[int]]:
    """The layers each stage runs, in model order: its own layers, except the *value* layers (``recompute``:
    shape arithmetic and other outputs that hold no tensor), which instead run in every stage that needs them.

    A stage needs a value layer if one of the layers it runs reads it (directly or through other value layers),
    or, for the last stage, if the model's output does. Value layers are never sent between stages: each stage
    recomputes the ones it needs from their tensor roots, which cross stage boundaries like any tensor.
    """
    values = set(recompute)
    index = {layer.name: i for i, layer in enumerate(ml.layers)}
    out_refs: list[str] = []
    map_aggregate(ml.output, lambda a: out_refs.append(a.name) if isinstance(a, _Ref) else None)
    result = []
    for s in range(num_stages):
        run = {i for i, st in enumerate(layer_to_stage) if st == s and i not in values}
        todo = [r for i in run for r in ml.layers[i].refs()]
        if s == num_stages - 1:
            todo += out_refs
        while todo:
            i = index.get(todo.pop())
            if i is not None and i in values and i not in run:
                run.add(i)
                todo += ml.layers[i].refs()
        result.append(sorted(run))
    return result


def boundaries(ml: ModelLayers, layer_to_stage: Sequence[int], num_stages: int,
               recompute: Iterable[int] = ()) -> list[list[str]]:
    """Names of the values crossing into each stage: ``result[s]`` is what stage ``s`` receives.

    ``result[0]`` is the model inputs stage 0 reads; ``result[num_stages]`` is the model's output values.
    A value produced before stage ``s`` (or a model input) that stage ``s`` or a later one reads crosses into
    ``s`` (and is passed on). Value layers (``recompute``) never cross; their tensor roots do, to every stage
    that recomputes them (see :func:`executed_layers`). Raises :class:`PlanError` if a layer reads a value
    produced by a later stage.
    """
    values = set(recompute)
    producer: dict[str, int] = {name: -1 for name in ml.inputs}
    for i, (layer, stage) in enumerate(zip(ml.layers, layer_to_stage)):
        if i not in values:
            producer[layer.name] = stage
    last_use: dict[str, int] = {}
    for s, run in enumerate(executed_layers(ml, layer_to_stage, num_stages, values)):
        local = {ml.layers[i].name for i in run}
        for i in run:
            layer = ml.layers[i]
            for ref in layer.refs():
                if ref in local:
                    continue
                if producer[ref] > s:
                    raise PlanError(f"layer {layer.name} (stage {s}) reads {ref}, which stage {producer[ref]} computes")
                last_use[ref] = max(last_use.get(ref, -1), s)
    outs: list[str] = []
    map_aggregate(ml.output, lambda a: outs.append(a.name) if isinstance(a, _Ref) else None)
    for ref in outs:
        if ref in producer:
            last_use[ref] = num_stages
    order = {name: i for i, name in enumerate(ml.inputs + ml.names)}
    result = []
    for s in range(num_stages + 1):
        crossing = [n for n in last_use if producer[n] < s <= last_use[n]]
        result.append(sorted(crossing, key=order.__getitem__))
    result[0] = list(ml.inputs)
    return result


class StageModule(nn.Module):
    """One pipeline stage: takes the values crossing into it, returns the values crossing out of it.

    For the last stage the output is the model's output (same structure as the model's).
    """

    def __init__(self, ml: ModelLayers, layer_idx: Sequence[int], inputs: list[str], outputs: list[str],
                 is_last: bool) -> None:
        super().__init__()
        self.input_names = list(inputs)
        self.output_names = list(outputs)
        self.is_last = is_last
        self._layers = [ml.layers[i] for i in layer_idx]
        self._output = ml.output
        self._attrs: dict[str, str] = {}
        for layer in self._layers:
            if layer.op == "module":
                _graft(self, layer.target, ml.root.get_submodule(layer.target))
            elif layer.op == "attr":
                owner_path, _, attr = layer.target.rpartition(".")
                owner = ml.root.get_submodule(owner_path) if owner_path else ml.root
                value = getattr(owner, attr)
                container = _graft_container(self, owner_path)
                if isinstance(value, nn.Parameter):
                    container.register_parameter(attr, value)
                elif isinstance(value, torch.Tensor):
                    container.register_buffer(attr, value)
                else:
                    setattr(container, attr, value)
        self._modified_inputs = sorted(self._inputs_modified_in_place(ml))
        """Inputs that a layer of this stage modifies in place (``ReLU(inplace=True)`` right after a cut): a
        received activation is a leaf that requires grad, which autograd forbids modifying, so they are copied."""

    def _inputs_modified_in_place(self, ml: ModelLayers) -> set[str]:
        inputs = set(self.input_names)
        out: set[str] = set()
        for layer in self._layers:
            if layer.op == "module":
                in_place = bool(getattr(ml.root.get_submodule(layer.target), "inplace", False))
            elif layer.op == "function":
                in_place = bool(layer.kwargs.get("inplace", False)) or layer.target in _IN_PLACE_OPERATORS \
                    or getattr(layer.target, "__name__", "").endswith("_")
            elif layer.op == "method":
                in_place = str(layer.target).endswith("_") and not str(layer.target).startswith("_")
            else:
                in_place = False
            if in_place:
                first = layer.args[0] if layer.args else None
                if isinstance(first, _Ref) and first.name in inputs:
                    out.add(first.name)
        return out

    def forward(self, *values: Any) -> Any:
        if len(values) != len(self.input_names):
            raise ValueError(f"stage expects {len(self.input_names)} inputs ({self.input_names}), got {len(values)}")
        env: dict[str, Any] = dict(zip(self.input_names, values))
        for name in self._modified_inputs:
            value = env[name]
            if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf:
                env[name] = value.clone()
        load = lambda a: env[a.name] if isinstance(a, _Ref) else a  # noqa: E731
        for layer in self._layers:
            args = map_aggregate(layer.args, load)
            kwargs = map_aggregate(layer.kwargs, load)
            if layer.op == "module":
                env[layer.name] = self.get_submodule(layer.target)(*args, **kwargs)
            elif layer.op == "function":
                env[layer.name] = layer.target(*args, **kwargs)
            elif layer.op == "method":
                env[layer.name] = getattr(args[0], layer.target)(*args[1:], **kwargs)
            else:
                env[layer.name] = _get_path(self, layer.target)
        if self.is_last:
            return map_aggregate(self._output, load)
        return tuple(env[n] for n in self.output_names)


def _graft_container(root: nn.Module, path: str) -> nn.Module:
    node = root
    if not path:
        return node
    for part in path.split("."):
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]  # type: ignore[assignment]
    return node


def _graft(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = _graft_container(root, parent_path)
    parent.add_module(name, module)


def _get_path(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def build_stage(model: nn.Module | ModelLayers, plan: Plan, stage: int) -> StageModule:
    """The module of stage ``stage`` of ``plan``, holding only that stage's layers.

    Raises :class:`PlanError` if the plan's layers are not the model's. A parameter that layers of several
    stages use is grafted into each of them (see :mod:`pipedream_ft.pipeline.tied`).
    """
    ml = model if isinstance(model, ModelLayers) else model_layers(model)
    if ml.names != list(plan.layer_names):
        diff = next((i for i, (a, b) in enumerate(zip(ml.names, plan.layer_names)) if a != b), min(len(ml.names), plan.num_layers))
        raise PlanError(
            f"plan was made for another model: it has {plan.num_layers} layers, the model {len(ml.names)}; "
            f"first difference at layer {diff}"
        )
    if not 0 <= stage < plan.num_stages:
        raise PlanError(f"stage {stage} is out of range for a plan of {plan.num_stages} stages")
    recompute = plan.recompute
    crossing = boundaries(ml, plan.layer_to_stage, plan.num_stages, recompute)
    run = executed_layers(ml, plan.layer_to_stage, plan.num_stages, recompute)[stage]
    return StageModule(ml, run, crossing[stage], crossing[stage + 1], stage == plan.num_stages - 1)

