"""The profile: what was measured about a model, layer by layer.

A :class:`Profile` is a DAG of :class:`Layer` records in topological order (layer ``i`` only feeds layers
``j > i``). It is pure data, torch-free, and is what the partitioner plans from.

JSON format (``"format": "pipedream-ft-profile"``, ``"version": 1``)::

    {
      "format": "pipedream-ft-profile",
      "version": 1,
      "meta": {"model": "pipedream_ft_examples.models:small_cnn", "batch_size": 32, "device": "cpu", ...},
      "layers": [
        {"name": "0", "description": "Conv2d(1, 16, ...)", "forward_ms": 0.41, "backward_ms": 0.83,
         "activation_bytes": 131072, "parameter_bytes": 640},
        ...
      ],
      "edges": [[0, 1], [1, 2], ...],
      "tied": [{"name": "wte.weight", "bytes": 65536, "layers": [1, 129]}],
      "inputs": [{"name": "idx", "bytes": 1024, "readers": [0, 3]}],
      "keep_together": [{"name": "model.norm + lm_head", "layers": [130, 131]}]
    }

Times are per minibatch in milliseconds (``weight_backward_ms``, optional: the share of ``backward_ms`` that
computes the weight gradients, for split-backward schedules); sizes are bytes (``activation_bytes`` is the layer's output for one
minibatch: the bytes of the tensors in it). Edges index into ``layers``.

Optional per layer, written only when known (older profiles load without them): ``forward_spread`` and
``backward_spread``, ``(p75 - p25) / median`` of the timed repeats (:mod:`profiler.noise`), and ``reused_from``,
the name of an identical earlier layer whose times were reused rather than measured again
(:mod:`profiler.reuse`; e.g. ``"model_layers_0"`` on ``model_layers_1`` of a decoder profiled on ``meta``).

Each layer has a ``kind`` (optional in JSON, default ``"tensor"``): a ``"value"`` layer is one whose output holds
no tensor at all (ints, ``torch.Size``, dtypes, devices, ``None``, tuples of those; e.g. ``x.size()`` and the
shape arithmetic after it). Such a value is never sent between pipeline stages: a stage that needs it
recomputes it from its inputs, so its ``activation_bytes`` is 0. Any other layer is ``"tensor"`` and crosses
a stage boundary as the tensors in its output.

``tied`` (optional, default empty) lists the parameters that several layers share (by identity, e.g. GPT-2's
``lm_head.weight is wte.weight``): the name under which the model first reaches the parameter, its bytes, and
the layers using it (ascending). A layer's ``parameter_bytes`` counts a shared parameter on its first user only.

``inputs`` (optional, default empty) lists the model's inputs: name, bytes for one minibatch, and the layers
reading each directly. Plans use it to count an input that must be passed on to a later stage. Layer names are the handle the runtime uses to find the layer in the
model: the child's index for an ``nn.Sequential``, the fx node name for a traced model, ``nodeN`` for profiles
imported from PipeDream's ``graph.txt``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "FORMAT",
    "VERSION",
    "KINDS",
    "MAX_BYTES",
    "MAX_MS",
    "Layer",
    "TiedGroup",
    "ModelInput",
    "KeepTogether",
    "Profile",
    "ProfileError",
    "load_profile",
]

FORMAT = "pipedream-ft-profile"
VERSION = 1
KINDS = ("tensor", "value")
MAX_MS = 1e9
"""The largest time a profile may give a layer, in milliseconds (about 11.6 days per minibatch): beyond it a value
is a mistake, and sums of such values overflow the planner's arithmetic."""
MAX_BYTES = float(2**60)
"""The largest byte count a profile may give (an exbibyte)."""
"""Layer kinds: ``"tensor"`` (its output holds tensors) or ``"value"`` (no tensor: recomputed, never sent)."""


class ProfileError(ValueError):
    """A profile is malformed; the message names the file, line or field."""


@dataclass(frozen=True, slots=True)
class Layer:
    """One profiled layer."""

    name: str
    """Handle of the layer in the model (Sequential index, fx node name, or ``nodeN``)."""
    description: str
    """Human-readable description, e.g. the module's ``repr``."""
    forward_ms: float
    """Median forward time for one minibatch, milliseconds."""
    backward_ms: float
    """Median backward time for one minibatch, milliseconds."""
    activation_bytes: float
    """Bytes of this layer's output for one minibatch."""
    parameter_bytes: float
    """Bytes of this layer's own parameters."""
    kind: str = "tensor"
    """``"tensor"`` or ``"value"`` (its output holds no tensor; see the module docstring)."""
    weight_backward_ms: float | None = None
    """The part of ``backward_ms`` that computes the weight gradients (``W`` of a split backward; the rest,
    ``backward_ms - weight_backward_ms``, is the input gradient ``I``). ``None``: not measured."""
    forward_spread: float | None = None
    """``(p75 - p25) / median`` of the forward's timed repeats (:mod:`profiler.noise`). ``None``: not recorded."""
    backward_spread: float | None = None
    """The same for the backward."""
    reused_from: str | None = None
    """The name of an identical earlier layer whose times these are (measured once, :mod:`profiler.reuse`);
    ``None``: measured itself."""

    def __post_init__(self) -> None:
        keys = ("forward_ms", "backward_ms", "activation_bytes", "parameter_bytes")
        optional = ("weight_backward_ms", "forward_spread", "backward_spread")
        for key in keys + tuple(k for k in optional if getattr(self, k) is not None):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ProfileError(f"layer {self.name!r}: {key} must be a number, got {value!r}")
            if math.isnan(value) or math.isinf(value) or value < 0:
                raise ProfileError(f"layer {self.name!r}: {key} must be finite and >= 0, got {value!r}")
            limit = MAX_MS if key.endswith("_ms") else MAX_BYTES
            if value > limit:
                raise ProfileError(f"layer {self.name!r}: {key} is {value!r}, beyond any real layer "
                                   f"(at most {limit:.3g}{' ms' if key.endswith('_ms') else ' bytes'})")
        if self.weight_backward_ms is not None and self.weight_backward_ms > self.backward_ms * (1 + 1e-9):
            raise ProfileError(f"layer {self.name!r}: weight_backward_ms ({self.weight_backward_ms!r}) is part of "
                               f"backward_ms ({self.backward_ms!r}) and cannot exceed it")
        if self.reused_from is not None and (not isinstance(self.reused_from, str) or self.reused_from == self.name):
            raise ProfileError(f"layer {self.name!r}: reused_from must name another layer, got {self.reused_from!r}")
        if self.kind not in KINDS:
            raise ProfileError(f"layer {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "value" and self.activation_bytes != 0:
            raise ProfileError(
                f"layer {self.name!r}: a value layer holds no tensor, so its activation_bytes must be 0, "
                f"got {self.activation_bytes!r}"
            )


@dataclass(frozen=True, slots=True)
class TiedGroup:
    """A parameter shared by several layers."""

    name: str
    """The qualified name under which the model first reaches the parameter, e.g. ``"wte.weight"``."""
    bytes: float
    """The parameter's size in bytes."""
    layers: tuple[int, ...]
    """Indices of the layers using it, ascending, at least two."""

    def __post_init__(self) -> None:
        if not isinstance(self.bytes, (int, float)) or isinstance(self.bytes, bool) \
                or not math.isfinite(self.bytes) or not 0 <= self.bytes <= MAX_BYTES:
            raise ProfileError(f"tied parameter {self.name!r}: bytes must be a finite number >= 0 and at most "
                               f"{MAX_BYTES:.3g}, got {self.bytes!r}")
        if len(self.layers) < 2 or list(self.layers) != sorted(set(self.layers)):
            raise ProfileError(
                f"tied parameter {self.name!r}: layers must be two or more distinct indices, ascending, "
                f"got {list(self.layers)}"
            )


@dataclass(frozen=True, slots=True)
class ModelInput:
    """One input of the model."""

    name: str
    """The input's name (the fx placeholder, or ``"input"`` for an ``nn.Sequential``)."""
    bytes: float
    """Bytes of the input for one minibatch (0 in a structure-only profile)."""
    readers: tuple[int, ...]
    """Indices of the layers that read it directly, ascending."""

    def __post_init__(self) -> None:
        if not isinstance(self.bytes, (int, float)) or isinstance(self.bytes, bool) \
                or not math.isfinite(self.bytes) or not 0 <= self.bytes <= MAX_BYTES:
            raise ProfileError(f"input {self.name!r}: bytes must be a finite number >= 0 and at most "
                               f"{MAX_BYTES:.3g}, got {self.bytes!r}")
        if list(self.readers) != sorted(set(self.readers)):
            raise ProfileError(f"input {self.name!r}: readers must be distinct indices, ascending, got {list(self.readers)}")


@dataclass(frozen=True, slots=True)
class KeepTogether:
    """Layers that must share one pipeline stage (no plan cuts between them)."""

    name: str
    """What the model called the group (its module paths), for messages."""
    layers: tuple[int, ...]
    """Indices of the group's layers, ascending, at least two."""

    def __post_init__(self) -> None:
        if len(self.layers) < 2 or list(self.layers) != sorted(set(self.layers)):
            raise ProfileError(f"keep-together group {self.name!r}: layers must be two or more distinct indices, "
                               f"ascending, got {list(self.layers)}")


@dataclass(frozen=True, slots=True)
class Profile:
    """A model's layer DAG with per-layer costs, in topological order."""

    layers: tuple[Layer, ...]
    edges: tuple[tuple[int, int], ...]
    meta: dict[str, Any] = field(default_factory=dict)
    tied: tuple[TiedGroup, ...] = ()
    """Parameters shared by several layers (layer indices into ``layers``)."""
    inputs: tuple[ModelInput, ...] = ()
    """The model's inputs and the layers reading them (empty when unknown, e.g. from ``graph.txt``)."""
    keep_together: tuple[KeepTogether, ...] = ()
    """Groups of layers the partitioner keeps on one stage (layer indices into ``layers``)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError("profile has no layers")
        n = len(self.layers)
        for group in self.tied:
            if not all(0 <= i < n for i in group.layers):
                raise ProfileError(
                    f"tied parameter {group.name!r} names layers {list(group.layers)}, but the profile has {n} layers"
                )
        for inp in self.inputs:
            if not all(0 <= i < n for i in inp.readers):
                raise ProfileError(f"input {inp.name!r} names readers {list(inp.readers)}, but the profile has {n} layers")
        for keep in self.keep_together:
            if not all(0 <= i < n for i in keep.layers):
                raise ProfileError(f"keep-together group {keep.name!r} names layers {list(keep.layers)}, but the "
                                   f"profile has {n} layers")
        names: set[str] = set()
        for layer in self.layers:
            if layer.name in names:
                raise ProfileError(f"duplicate layer name {layer.name!r}")
            names.add(layer.name)
        for layer in self.layers:
            if layer.reused_from is not None and layer.reused_from not in names:
                raise ProfileError(f"layer {layer.name!r}: reused_from names {layer.reused_from!r}, which is no "
                                   "layer of the profile")
        for a, b in self.edges:
            if not (0 <= a < n and 0 <= b < n):
                raise ProfileError(f"edge ({a}, {b}) names an unknown layer (the profile has {n} layers)")
            if a >= b:
                raise ProfileError(
                    f"edge {self.layers[a].name} -> {self.layers[b].name} goes backwards: layers must be in "
                    "topological order (is there a cycle?)"
                )

    # -- construction -------------------------------------------------------------------------------------

    @staticmethod
    def from_unordered(
        layers: Sequence[Layer],
        edges: Iterable[tuple[str, str]],
        meta: dict[str, Any] | None = None,
        tied: Sequence[TiedGroup] = (),
        inputs: Sequence[ModelInput] = (),
        keep_together: Sequence[KeepTogether] = (),
    ) -> Profile:
        """Build a profile from layers in any order and edges given by name; sorts topologically.

        Ties are broken by the original order, so an already ordered input is kept as is. ``tied``, ``inputs``
        and ``keep_together`` index into ``layers`` as given and are renumbered. Raises :class:`ProfileError`
        on an unknown name or a cycle.
        """
        index = {layer.name: i for i, layer in enumerate(layers)}
        if len(index) != len(layers):
            seen: set[str] = set()
            dup = next(layer.name for layer in layers if layer.name in seen or seen.add(layer.name))  # type: ignore[func-returns-value]
            raise ProfileError(f"duplicate layer name {dup!r}")
        succ: list[list[int]] = [[] for _ in layers]
        indeg = [0] * len(layers)
        pairs: list[tuple[int, int]] = []
        for a, b in edges:
            for end in (a, b):
                if end not in index:
                    raise ProfileError(f"edge {a} -- {b} names unknown layer {end!r}")
            ia, ib = index[a], index[b]
            if (ia, ib) in pairs:
                continue
            pairs.append((ia, ib))
            succ[ia].append(ib)
            indeg[ib] += 1
        import heapq

        ready = [i for i in range(len(layers)) if indeg[i] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for j in succ[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) != len(layers):
            stuck = sorted(layers[i].name for i in range(len(layers)) if indeg[i] > 0)
            raise ProfileError(f"the layer graph has a cycle through {', '.join(stuck[:5])}")
        pos = {old: new for new, old in enumerate(order)}
        new_edges = tuple(sorted((pos[a], pos[b]) for a, b in pairs))
        n = len(layers)

        def renumber(indices: Iterable[int], what: str) -> tuple[int, ...]:
            out = []
            for i in indices:
                if not 0 <= i < n:
                    raise ProfileError(f"{what} names layer {i}, but the profile has {n} layers")
                out.append(pos[i])
            return tuple(sorted(out))

        new_tied = tuple(TiedGroup(g.name, g.bytes, renumber(g.layers, f"tied parameter {g.name!r}")) for g in tied)
        new_inputs = tuple(ModelInput(x.name, x.bytes, renumber(x.readers, f"input {x.name!r}")) for x in inputs)
        new_keep = tuple(KeepTogether(k.name, renumber(k.layers, f"keep-together group {k.name!r}"))
                         for k in keep_together)
        return Profile(tuple(layers[i] for i in order), new_edges, dict(meta or {}), new_tied, new_inputs, new_keep)

    # -- queries --------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.layers)

    def index(self, name: str) -> int:
        for i, layer in enumerate(self.layers):
            if layer.name == name:
                return i
        raise KeyError(name)

    def predecessors(self) -> list[list[int]]:
        preds: list[list[int]] = [[] for _ in self.layers]
        for a, b in self.edges:
            preds[b].append(a)
        return preds

    def successors(self) -> list[list[int]]:
        succ: list[list[int]] = [[] for _ in self.layers]
        for a, b in self.edges:
            succ[a].append(b)
        return succ

    def is_chain(self) -> bool:
        return list(self.edges) == [(i, i + 1) for i in range(len(self.layers) - 1)]

    def structure_hash(self) -> str:
        """SHA-256 of the model's structure: layer names, descriptions, parameter bytes, edges and tied groups.

        Times, activation sizes, layer kinds, inputs and keep-together groups are left out, so profiling the
        same model again (or at another batch size) keeps the hash, while a different model changes it; tied
        groups count only when there are some, so profiles without any keep their old hash. Plans carry it; the runtime refuses a
        plan whose hash differs from its model's.
        """
        body: dict[str, Any] = {
            "layers": [[l.name, l.description, int(l.parameter_bytes)] for l in self.layers],
            "edges": [list(e) for e in self.edges],
        }
        if self.tied:
            body["tied"] = [[g.name, int(g.bytes), list(g.layers)] for g in self.tied]
        blob = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    # -- JSON -----------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "meta": self.meta,
            "layers": [
                {
                    "name": l.name,
                    "description": l.description,
                    "forward_ms": l.forward_ms,
                    "backward_ms": l.backward_ms,
                    "activation_bytes": l.activation_bytes,
                    "parameter_bytes": l.parameter_bytes,
                    "kind": l.kind,
                    **{k: getattr(l, k) for k in _OPTIONAL if getattr(l, k) is not None},
                }
                for l in self.layers
            ],
            "edges": [list(e) for e in self.edges],
            "tied": [{"name": g.name, "bytes": g.bytes, "layers": list(g.layers)} for g in self.tied],
            "inputs": [{"name": x.name, "bytes": x.bytes, "readers": list(x.readers)} for x in self.inputs],
        }
        if self.keep_together:
            out["keep_together"] = [{"name": k.name, "layers": list(k.layers)} for k in self.keep_together]
        return out

    def save(self, path: str | Path) -> None:
        """Write JSON (``.json``) or PipeDream's ``graph.txt`` (any other suffix), atomically."""
        path = Path(path)
        if path.suffix == ".json":
            text = json.dumps(self.to_json(), indent=1) + "\n"
        else:
            from .graphtxt import dumps_graph_txt

            text = dumps_graph_txt(self)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    @staticmethod
    def from_json(data: Any, source: str = "<profile>") -> Profile:
        """Parse the JSON document produced by :meth:`to_json`; errors name ``source`` and the field."""
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ProfileError(f"{source}: field 'format' must be {FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != VERSION:
            raise ProfileError(f"{source}: unsupported profile version {data.get('version')!r} (this reads {VERSION})")
        raw_layers = data.get("layers")
        if not isinstance(raw_layers, list) or not raw_layers:
            raise ProfileError(f"{source}: field 'layers' must be a non-empty list")
        layers: list[Layer] = []
        for i, raw in enumerate(raw_layers):
            where = f"{source}: layers[{i}]"
            if not isinstance(raw, dict):
                raise ProfileError(f"{where}: expected an object")
            try:
                layers.append(
                    Layer(
                        name=str(raw["name"]),
                        description=str(raw.get("description", "")),
                        forward_ms=_number(raw, "forward_ms", where),
                        backward_ms=_number(raw, "backward_ms", where),
                        activation_bytes=_number(raw, "activation_bytes", where),
                        parameter_bytes=_number(raw, "parameter_bytes", where),
                        kind=str(raw.get("kind", "tensor")),
                        weight_backward_ms=(_number(raw, "weight_backward_ms", where)
                                            if raw.get("weight_backward_ms") is not None else None),
                        forward_spread=(_number(raw, "forward_spread", where)
                                        if raw.get("forward_spread") is not None else None),
                        backward_spread=(_number(raw, "backward_spread", where)
                                         if raw.get("backward_spread") is not None else None),
                        reused_from=(str(raw["reused_from"]) if raw.get("reused_from") is not None else None),
                    )
                )
            except KeyError as exc:
                raise ProfileError(f"{where}: missing field {exc.args[0]!r}") from None
            except ProfileError as exc:
                raise ProfileError(f"{where}: {exc}") from None
        raw_edges = data.get("edges", [])
        if not isinstance(raw_edges, list):
            raise ProfileError(f"{source}: field 'edges' must be a list")
        edges: list[tuple[int, int]] = []
        for i, e in enumerate(raw_edges):
            if not (isinstance(e, list) and len(e) == 2 and all(isinstance(x, int) for x in e)):
                raise ProfileError(f"{source}: edges[{i}] must be a pair of layer indices, got {e!r}")
            if not all(0 <= x < len(layers) for x in e):
                raise ProfileError(f"{source}: edges[{i}] = {e!r} names an unknown layer ({len(layers)} layers)")
            edges.append((e[0], e[1]))
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ProfileError(f"{source}: field 'meta' must be an object")
        tied: list[TiedGroup] = []
        for g, where in _records(data, "tied", ("name", "bytes", "layers"), source):
            try:
                tied.append(TiedGroup(str(g["name"]), _number(g, "bytes", where), tuple(g["layers"])))
            except ProfileError as exc:
                raise ProfileError(f"{where}: {exc}") from None
        inputs: list[ModelInput] = []
        for x, where in _records(data, "inputs", ("name", "bytes", "readers"), source):
            try:
                inputs.append(ModelInput(str(x["name"]), _number(x, "bytes", where), tuple(x["readers"])))
            except ProfileError as exc:
                raise ProfileError(f"{where}: {exc}") from None
        keep: list[KeepTogether] = []
        for k, where in _records(data, "keep_together", ("name", "layers"), source):
            try:
                keep.append(KeepTogether(str(k["name"]), tuple(k["layers"])))
            except ProfileError as exc:
                raise ProfileError(f"{where}: {exc}") from None
        try:
            return Profile.from_unordered(
                layers, [(layers[a].name, layers[b].name) for a, b in edges], meta, tied, inputs, keep
            )
        except ProfileError as exc:
            raise ProfileError(f"{source}: {exc}") from None


_OPTIONAL = ("weight_backward_ms", "forward_spread", "backward_spread", "reused_from")
"""Layer fields written only when set: profiles without them (older ones) load unchanged."""


def _records(data: dict[str, Any], key: str, fields: tuple[str, ...], source: str) -> list[tuple[dict[str, Any], str]]:
    """The objects of the optional list field ``key``, checked to have ``fields`` and an index list last."""
    raw = data.get(key, [])
    if not isinstance(raw, list):
        raise ProfileError(f"{source}: field {key!r} must be a list")
    out = []
    for i, rec in enumerate(raw):
        where = f"{source}: {key}[{i}]"
        if not isinstance(rec, dict):
            raise ProfileError(f"{where}: expected an object")
        for f in fields:
            if f not in rec:
                raise ProfileError(f"{where}: missing field {f!r}")
        idx = rec[fields[-1]]
        if not (isinstance(idx, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in idx)):
            raise ProfileError(f"{where}: field {fields[-1]!r} must be a list of layer indices, got {idx!r}")
        out.append((rec, where))
    return out


def _number(raw: dict[str, Any], key: str, where: str) -> float:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"field {key!r} must be a number, got {value!r}")
    return float(value)


def load_profile(path: str | Path) -> Profile:
    """Read a profile from JSON or PipeDream's ``graph.txt`` (chosen by content, not suffix)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: not a profile: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})"
                           ) from None
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
        return Profile.from_json(data, source=str(path))
    from .graphtxt import parse_graph_txt

    return parse_graph_txt(text, source=str(path))
