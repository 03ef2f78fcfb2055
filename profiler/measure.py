"""Measure a model layer by layer: forward and backward time, output size and parameter size.

Each layer is timed in isolation on its real inputs: layer by layer, in order, the layer is first run once on
the outputs of the layers before it (which gives its own output, kept until its last reader has run), then
``warmup + repeats`` times on fresh detached copies of its inputs (floating tensors requiring grad), timing the
forward pass and then ``torch.autograd.backward`` from its outputs. Times are medians over the ``repeats`` runs.
Each timed run is followed by one with the backward split as zero-bubble schedules split it (the input gradient
``I``, then the weight gradient ``W``): the share of ``W`` over those runs, times the whole backward's median,
is the layer's ``weight_backward_ms``. The model is run in training mode; its mode, gradients, buffers and
device are restored afterwards. Each layer also records the spread of its repeats (:mod:`profiler.noise`). A
model on the ``meta`` device is profiled with one layer materialised at a time, and identical layers measured
once (:func:`profile_model`).

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
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .layers import LayerGraph, fetch_attr, has_tensor, layer_graph, sequential_children, tensor_bytes
from .materialize import has_meta, init_function, materialized, materialized_buffers
from .noise import noise_summary, noise_warning, spread
from .profile import Layer, ModelInput, Profile, ProfileError
from .reuse import signature

__all__ = ["Clock", "call_overhead_ms", "profile_model", "resolve_device"]

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


class Clock(Protocol):
    """A timer: ``start()``, then ``stop()`` returns the milliseconds since (a test may inject its own)."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


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
def _preserved(model: nn.Module, device: torch.device, move: bool = True) -> Iterator[None]:
    """Move ``model`` to ``device`` for the block (unless not ``move``: a meta model stays where it is); restore
    its device, modes, gradients and buffers after."""
    modes = [(m, m.training) for m in model.modules()]
    grads = {name: p.grad for name, p in model.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    tensors = [*model.parameters(), *model.buffers()]
    home = tensors[0].device if tensors else device
    moved = move and any(t.device != device for t in tensors)
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


def _split_backward(call: _Call, base: dict[Any, Any], clock: Clock, params: Sequence[nn.Parameter],
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


def _measure(call: _Call, base: dict[Any, Any], clock: Clock, params: Sequence[nn.Parameter], warmup: int,
             repeats: int, overhead: tuple[float, float] = (0.0, 0.0), data: frozenset[Any] = frozenset()
             ) -> tuple[float, float, float, float, float]:
    """Median forward and backward times of one layer, less the timer's ``overhead`` (:func:`call_overhead_ms`),
    the share of the backward that computes the weight gradients (from a split run, see
    :func:`_split_backward`), and the spreads of the forward and backward repeats (:func:`profiler.noise.spread`).
    ``data``: the keys of ``base`` that are the model's own inputs: as in training, no gradient is computed for
    them (a first layer's backward has no input gradient)."""
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
            share, spread(forward), spread(backward))


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
    seed: int = 0,
    reuse: bool | None = None,
    clock: Clock | None = None,
    warn: bool = True,
) -> Profile:
    """Profile ``model`` on one minibatch ``example_input``; layers as :func:`profiler.layers.layer_graph` splits it.

    **A model on meta** (parameters or buffers on the ``meta`` device, e.g. built under ``torch.device("meta")``)
    is never materialised whole: its buffers are given real values once (:func:`profiler.materialize.
    materialized_buffers`), then layer by layer, each layer's parameters are materialised on ``device`` alone,
    initialised from ``(seed, layer's qualified name)`` (:func:`profiler.materialize.materialized`), run once on
    its real inputs (its output is the next layers' input, and its sizes the profile's), timed, and freed; an
    activation is dropped once its last reader has run. Shapes are propagated with real activations of the one
    minibatch rather than on meta: models such as transformers' compute masks from data (``.all()`` on a
    tensor), which a meta tensor cannot answer. Activation and parameter sizes are exact.

    ``reuse`` (default: on for a meta model, off otherwise): a module layer identical to an earlier one
    (:func:`profiler.reuse.signature`) takes its times instead of being timed again, and records the earlier
    layer's name in ``reused_from``. ``clock`` replaces the timer (tests). Each layer records the spread of its
    repeats; with ``warn``, one line on stderr says when they are too noisy to trust (:mod:`profiler.noise`).
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError("example_input must be a tensor or a tuple of tensors")
    if any(t.is_meta for t in inputs):
        raise ValueError("example_input must hold real tensors (a meta model is profiled on real inputs)")
    dev = resolve_device(device)
    inputs = tuple(t.to(dev) for t in inputs)
    timer: Clock = clock if clock is not None else _Clock(dev)
    on_meta = has_meta(model)
    reuse = on_meta if reuse is None else reuse
    init = init_function(model) if on_meta else None

    from tqdm import tqdm

    with _preserved(model, dev, move=not on_meta), \
            (materialized_buffers(model, dev, init=init) if on_meta else nullcontext()):
        model.train()
        graph = layer_graph(model)
        keys_in, calls, keys_out, env = _layer_calls(model, graph, inputs)
        data = frozenset(env)  # before the layers' outputs are added: the model's own inputs
        last_use = {k: i for i, keys in enumerate(keys_in) for k in keys}
        params = [] if on_meta else list(model.parameters())
        parts = _parts(model, graph)
        calls_as = (["child"] * len(calls) if graph.kind == "sequential" else
                    [repr(torch.fx.node.map_arg((n.args, n.kwargs), lambda _: "<input>")) for n in graph.nodes()])
        show = progress and sys.stderr.isatty()
        bar = tqdm(total=len(calls), desc="profiling", unit="layer", disable=not show, leave=False)
        layers: list[Layer] = []
        measured: dict[Any, int] = {}  # signature -> the layer measured for it
        overhead = call_overhead_ms(dev)
        try:
            for i, call in enumerate(calls):
                part, qualname = parts[i]
                holder = (materialized(part, dev, seed=seed, name=qualname, init=init)
                          if on_meta and part is not None else nullcontext())
                with holder:
                    base = {k: env[k] for k in keys_in[i]}
                    with torch.no_grad():
                        try:
                            out = call({k: _copy(v) for k, v in base.items()})
                        except Exception as exc:
                            raise RuntimeError(
                                f"layer {graph.names[i]} ({graph.descriptions[i]}) failed on the example input: "
                                f"{type(exc).__name__}: {exc}"
                            ) from exc
                    env[keys_out[i]] = out
                    kind = _kind(graph, i, out, isinstance(part, nn.Module))
                    key = (signature(part, graph.descriptions[i], [base[k] for k in keys_in[i]], calls_as[i])
                           if reuse and isinstance(part, nn.Module) else None)
                    if key is not None and key in measured:
                        source = layers[measured[key]]
                        layers.append(Layer(graph.names[i], graph.descriptions[i], source.forward_ms,
                                            source.backward_ms, float(tensor_bytes(out)),
                                            float(graph.parameter_bytes[i]), kind, source.weight_backward_ms,
                                            source.forward_spread, source.backward_spread, source.name))
                    else:
                        mine = list(part.parameters()) if on_meta and isinstance(part, nn.Module) else params
                        fwd, bwd, share, f_spread, b_spread = _measure(call, base, timer, mine, warmup, repeats,
                                                                       overhead, data)
                        layers.append(Layer(graph.names[i], graph.descriptions[i], fwd, bwd, float(tensor_bytes(out)),
                                            float(graph.parameter_bytes[i]), kind, bwd * share,
                                            round(f_spread, 4), round(b_spread, 4)))
                        if key is not None:
                            measured[key] = i
                    del base, out
                for k in keys_in[i]:
                    if last_use.get(k) == i and k not in data:
                        env.pop(k, None)
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
        "timing_spread": noise_summary(layers),
    }
    if on_meta:
        info["materialized"] = "per layer"
        info["seed"] = seed
    info.update(meta or {})
    model_inputs = tuple(
        ModelInput(name, float(tensor_bytes(inputs[i])) if i < len(inputs) else 0.0, tuple(readers))
        for i, (name, readers) in enumerate(zip(graph.input_names, graph.input_readers))
    )
    profile = Profile(tuple(layers), tuple(graph.edges), info, tuple(graph.tied), model_inputs,
                      tuple(graph.keep_together))
    line = noise_warning(profile) if warn else None
    if line is not None:
        print(line, file=sys.stderr)
    return profile


def _parts(model: nn.Module, graph: LayerGraph) -> list[tuple[nn.Module | tuple[nn.Module, str] | None, str]]:
    """Per layer, what holds its parameters (a module, ``(owner, attribute)`` for a ``get_attr``, or nothing)
    and its qualified name (the seed of its initialisation)."""
    if graph.kind == "sequential":
        return [(child, name) for name, child in sequential_children(model)]
    gm = graph.graph_module
    assert gm is not None
    parts: list[tuple[nn.Module | tuple[nn.Module, str] | None, str]] = []
    for n in graph.nodes():
        if n.op == "call_module":
            parts.append((gm.get_submodule(n.target), str(n.target)))
        elif n.op == "get_attr":
            owner, _, attr = str(n.target).rpartition(".")
            parts.append(((gm.get_submodule(owner), attr), str(n.target)))
        else:
            parts.append((None, n.name))
    return parts


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
