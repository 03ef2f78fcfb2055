"""Measure a model layer by layer: forward and backward time, output size and parameter size.

Each layer is timed in isolation on its real inputs: the example input is first run through the whole model
once to collect every layer's inputs, then each layer is run ``warmup + repeats`` times on fresh detached
copies of them (floating tensors requiring grad), timing the forward pass and then
``torch.autograd.backward`` from its outputs. Times are medians over the ``repeats`` runs. Each timed run is
followed by one with the backward split as zero-bubble schedules split it (the input gradient ``I``, then the
weight gradient ``W``): the share of ``W`` over those runs, times the whole backward's median, is the layer's
``weight_backward_ms``. The model is run in
training mode; its mode, gradients, buffers and device are restored afterwards.

Each layer's kind comes from the output it really computes on the example input: ``"value"`` if it holds no
tensor at all (``x.size()``, ``getitem`` of a size, ``floordiv`` of ints, ``x.device``, ...), else
``"tensor"``. A module call (``call_module``, or a child of an ``nn.Sequential``) must return a tensor
somewhere in its output: one that returns none cannot be pipelined and is refused with a
:class:`~profiler.profile.ProfileError`.
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .layers import LayerGraph, fetch_attr, has_tensor, layer_graph, sequential_children, tensor_bytes
from .profile import Layer, ModelInput, Profile, ProfileError

__all__ = ["call_overhead_ms", "profile_model", "resolve_device"]

_Call = Callable[[dict[Any, Any]], Any]


def resolve_device(device: str | torch.device) -> torch.device:
    """Parse ``device`` ("cpu", "cuda", "cuda:N"); raise ``ValueError`` if unknown or unavailable."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {str(device)!r}") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"unsupported device {str(device)!r} (use cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but CUDA is not available")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return dev


class _Clock:
    """Wall-clock timer in milliseconds; CUDA events with synchronisation on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._t0 = 0.0
        self._ev0: Any = None

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._ev0 = torch.cuda.Event(enable_timing=True)
            self._ev0.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record()
            torch.cuda.synchronize(self.device)
            return float(self._ev0.elapsed_time(ev1))
        return (time.perf_counter() - self._t0) * 1000.0


def _fresh(value: Any, grad: bool = True) -> Any:
    """A private copy of ``value``, cut from any graph: with ``grad``, floating tensors become non-leaf tensors
    requiring grad (a layer's input from the layer before); without, none requires grad (the model's own input,
    data, whose gradient training never computes)."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if grad and t.is_floating_point():
            # a clone of a leaf: in-place layers (ReLU(inplace=True)) are allowed on it
            return t.detach().requires_grad_(True).clone()
        return t.detach().clone()

    return tree_map(one, value)


def _copy(value: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def _run_node(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict[Any, Any]) -> Any:
    args = torch.fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)
    if node.op == "get_attr":
        return fetch_attr(gm, node.target)
    raise ValueError(f"unexpected fx node {node.name} with op {node.op!r}")


def _layer_calls(
    model: nn.Module, graph: LayerGraph, inputs: tuple[torch.Tensor, ...]
) -> tuple[list[list[Any]], list[_Call], list[Any], dict[Any, Any]]:
    """Per layer: the keys of its inputs in the environment, a call taking them, its own key; and the env of inputs."""
    if graph.kind == "sequential":
        if len(inputs) != 1:
            raise ValueError(f"an nn.Sequential takes one input, got {len(inputs)}")
        children = [child for _, child in sequential_children(model)]
        keys_in = [[i - 1] for i in range(len(children))]
        calls: list[_Call] = [(lambda env, m=m, i=i: m(env[i - 1])) for i, m in enumerate(children)]
        return keys_in, calls, list(range(len(children))), {-1: inputs[0]}
    gm = graph.graph_module
    assert gm is not None
    env: dict[Any, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) > len(placeholders):
        raise ValueError(f"model {type(model).__name__} takes {len(placeholders)} inputs, got {len(inputs)}")
    for i, ph in enumerate(placeholders):
        if i < len(inputs):
            env[ph] = inputs[i]
        elif ph.args:
            env[ph] = ph.args[0]
        else:
            raise ValueError(f"model {type(model).__name__}: no example value for input {ph.target!r}")
    nodes = graph.nodes()
    keys_in = [list(n.all_input_nodes) for n in nodes]
    calls = [(lambda e, n=n: _run_node(gm, n, e)) for n in nodes]
    return keys_in, calls, nodes, env


@contextmanager
def _preserved(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Move ``model`` to ``device`` for the block; restore its device, modes, gradients and buffers after."""
    modes = [(m, m.training) for m in model.modules()]
    grads = {name: p.grad for name, p in model.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    tensors = [*model.parameters(), *model.buffers()]
    home = tensors[0].device if tensors else device
    moved = any(t.device != device for t in tensors)
    if moved:
        model.to(device)
    try:
        yield
    finally:
        for p in model.parameters():
            p.grad = None
        if moved:
            model.to(home)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for name, p in model.named_parameters():
            p.grad = grads.get(name)
        for m, training in modes:
            m.training = training


def _float_leaves(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]


def _split_backward(call: _Call, base: dict[Any, Any], clock: _Clock, params: Sequence[nn.Parameter],
                    data: frozenset[Any] = frozenset()) -> tuple[float, float]:
    """One run of the backward split as zero-bubble schedules run it: the input gradient (``I``) first, keeping
    the graph, then the weight gradient (``W``). Their times, milliseconds. ``data``: the keys of ``base`` that
    are the model's own inputs (no gradient)."""
    env = {k: _fresh(v, k not in data) for k, v in base.items()}
    outs = _float_leaves(call(env))
    if not outs:
        return 0.0, 0.0
    grads = [torch.ones_like(t) for t in outs]
    inputs = [t for v in env.values() for t in _float_leaves(v)]
    weights = [p for p in params if p.requires_grad]
    input_ms = weight_ms = 0.0
    if inputs:
        clock.start()
        got = torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
        input_ms = clock.stop() if any(g is not None for g in got) else 0.0  # none reached: no I to run
    if weights:
        for p in weights:
            p.grad = None
        clock.start()
        torch.autograd.backward(outs, grad_tensors=grads, inputs=weights)
        weight_ms = clock.stop() if any(p.grad is not None for p in weights) else 0.0
    for p in params:
        p.grad = None
    return input_ms, weight_ms


def call_overhead_ms(device: str | torch.device, warmup: int = 5, repeats: int = 50) -> tuple[float, float]:
    """What timing one call costs on ``device`` beyond its work, in milliseconds: (forward, backward), medians.

    On a GPU every timed call pays a synchronisation, two events and, for a backward, the hand-off to
    autograd's device thread; a training step pays them once, not once per layer. They are measured on a call
    that does almost nothing (a one-element multiply and its backward) and taken off each layer's times. On the
    CPU the timer costs microseconds and nothing is taken off: (0.0, 0.0)."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        return 0.0, 0.0
    clock = _Clock(dev)
    x = torch.zeros(1, device=dev, requires_grad=True)
    grad = torch.ones(1, device=dev)
    forward: list[float] = []
    backward: list[float] = []
    for run in range(warmup + repeats):
        clock.start()
        y = x * 1.0
        fwd = clock.stop()
        clock.start()
        torch.autograd.backward([y], grad_tensors=[grad])
        bwd = clock.stop()
        x.grad = None
        if run >= warmup:
            forward.append(fwd)
            backward.append(bwd)
    return statistics.median(forward), statistics.median(backward)


def _measure(call: _Call, base: dict[Any, Any], clock: _Clock, params: Sequence[nn.Parameter], warmup: int,
             repeats: int, overhead: tuple[float, float] = (0.0, 0.0), data: frozenset[Any] = frozenset()
             ) -> tuple[float, float, float]:
    """Median forward and backward times of one layer, less the timer's ``overhead`` (:func:`call_overhead_ms`),
    and the share of the backward that computes the weight gradients (from a split run, see
    :func:`_split_backward`). ``data``: the keys of ``base`` that are the model's own inputs: as in training,
    no gradient is computed for them (a first layer's backward has no input gradient)."""
    forward: list[float] = []
    backward: list[float] = []
    split: list[tuple[float, float]] = []
    mine: Sequence[nn.Parameter] | None = None  # the parameters this layer's backward reaches, once known
    for run in range(warmup + repeats):
        env = {k: _fresh(v, k not in data) for k, v in base.items()}
        clock.start()
        out = call(env)
        fwd = clock.stop()
        leaves, _ = tree_flatten(out)
        outs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
        bwd = 0.0
        if outs:
            grads = [torch.ones_like(t) for t in outs]
            clock.start()
            torch.autograd.backward(outs, grad_tensors=grads)
            bwd = clock.stop()
        del env, out, leaves, outs
        if mine is None:  # the first backward shows which parameters the layer uses: the others need no clearing
            mine = [p for p in params if p.grad is not None]
        for p in mine:
            p.grad = None
        if run >= warmup:
            forward.append(fwd)
            backward.append(bwd)
            i_ms, w_ms = _split_backward(call, base, clock, mine, data) if bwd > 0 else (0.0, 0.0)
            split.append((max(i_ms - overhead[1], 0.0), max(w_ms - overhead[1], 0.0)))
    inputs, weights = sum(i for i, _ in split), sum(w for _, w in split)
    share = weights / (inputs + weights) if inputs + weights > 0 else 0.0
    return (max(statistics.median(forward) - overhead[0], 0.0), max(statistics.median(backward) - overhead[1], 0.0),
            share)


def _dtype_name(inputs: Sequence[torch.Tensor], model: nn.Module) -> str:
    for t in [*inputs, *model.parameters()]:
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return str(inputs[0].dtype).removeprefix("torch.") if inputs else "float32"


def profile_model(
    model: nn.Module,
    example_input: torch.Tensor | tuple[torch.Tensor, ...],
    *,
    device: str | torch.device = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = False,
    meta: dict[str, Any] | None = None,
) -> Profile:
    """Profile ``model`` on one minibatch ``example_input``; layers as :func:`profiler.layers.layer_graph` splits it."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError("example_input must be a tensor or a tuple of tensors")
    dev = resolve_device(device)
    inputs = tuple(t.to(dev) for t in inputs)
    clock = _Clock(dev)

    from tqdm import tqdm

    with _preserved(model, dev):
        model.train()
        graph = layer_graph(model)
        keys_in, calls, keys_out, env = _layer_calls(model, graph, inputs)
        data = frozenset(env)  # before the pass below adds the layers' outputs: the model's own inputs
        params = list(model.parameters())
        show = progress and sys.stderr.isatty()
        bar = tqdm(total=2 * len(calls), desc="profiling", unit="layer", disable=not show, leave=False)
        try:
            # one pass over the whole model to get every layer's real inputs
            activation: list[int] = []
            kinds: list[str] = []
            is_module = ([True] * len(calls) if graph.kind == "sequential"
                         else [n.op == "call_module" for n in graph.nodes()])
            with torch.no_grad():
                for i, call in enumerate(calls):
                    try:
                        out = call({k: _copy(env[k]) for k in keys_in[i]})
                    except Exception as exc:
                        raise RuntimeError(
                            f"layer {graph.names[i]} ({graph.descriptions[i]}) failed on the example input: "
                            f"{type(exc).__name__}: {exc}"
                        ) from exc
                    env[keys_out[i]] = out
                    kinds.append(_kind(graph, i, out, is_module[i]))
                    activation.append(tensor_bytes(out))
                    bar.update(1)
            layers: list[Layer] = []
            overhead = call_overhead_ms(dev)
            for i, call in enumerate(calls):
                base = {k: env[k] for k in keys_in[i]}
                fwd, bwd, weight_share = _measure(call, base, clock, params, warmup, repeats, overhead, data)
                layers.append(
                    Layer(
                        name=graph.names[i],
                        description=graph.descriptions[i],
                        forward_ms=fwd,
                        backward_ms=bwd,
                        activation_bytes=float(activation[i]),
                        parameter_bytes=float(graph.parameter_bytes[i]),
                        kind=kinds[i],
                        weight_backward_ms=bwd * weight_share,
                    )
                )
                bar.update(1)
        finally:
            bar.close()

    first = inputs[0]
    info: dict[str, Any] = {
        "model": type(model).__name__,
        "batch_size": int(first.shape[0]) if first.dim() > 0 else 1,
        "input_shapes": [list(t.shape) for t in inputs],
        "device": str(dev),
        "dtype": _dtype_name(inputs, model),
        "torch": torch.__version__,
        "warmup": warmup,
        "repeats": repeats,
        "layer_graph": graph.kind,
        "call_overhead_ms": list(overhead),
    }
    info.update(meta or {})
    model_inputs = tuple(
        ModelInput(name, float(tensor_bytes(inputs[i])) if i < len(inputs) else 0.0, tuple(readers))
        for i, (name, readers) in enumerate(zip(graph.input_names, graph.input_readers))
    )
    return Profile(tuple(layers), tuple(graph.edges), info, tuple(graph.tied), model_inputs,
                   tuple(graph.keep_together))


def _kind(graph: LayerGraph, i: int, out: Any, is_module: bool) -> str:
    """``"tensor"`` or ``"value"`` for layer ``i``'s real output; a module call must return a tensor."""
    if has_tensor(out):
        return "tensor"
    if is_module:
        raise ProfileError(
            f"layer {graph.names[i]} ({graph.descriptions[i]}) is a module call that returned no tensor "
            f"({type(out).__name__}); it cannot be pipelined: return its result as a tensor, or compute it "
            "outside a module"
        )
    return "value"
