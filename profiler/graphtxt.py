"""PipeDream's profiler format, ``graph.txt``: import and export.

Node lines::

    nodeN -- DESCRIPTION -- forward_compute_time=F, backward_compute_time=B, activation_size=A, parameter_size=P

and edge lines ``<TAB>nodeA -- nodeB``. Times are milliseconds, sizes bytes. Nodes may come in any order;
the imported profile is sorted topologically (ties by node number).

A layer with several outputs may give one size per output, ``activation_size=[6291456.0; 131072.0]``
(PipeDream writes a list that way); its activation size is their sum, as PipeDream's reader takes it. The
list is kept in the profile's ``meta["activation_parts"]`` (by layer name) and written back as read, as long
as it still sums to the layer's ``activation_bytes``.
"""

from __future__ import annotations

import math
import re

from .profile import Layer, Profile, ProfileError

__all__ = ["parse_graph_txt", "dumps_graph_txt", "PARTS_KEY"]

PARTS_KEY = "activation_parts"
"""``meta`` key of the per-output activation sizes of layers read from a list (``{name: [bytes, ...]}``)."""

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_NODE = re.compile(r"^(node\d+) -- (.*) -- (.*)$")
_EDGE = re.compile(r"^\t(node\d+) -- (node\d+)\s*$")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|NaN|inf|-inf"


def parse_graph_txt(text: str, source: str = "<graph.txt>") -> Profile:
    """Parse ``graph.txt``; a malformed line raises :class:`ProfileError` naming ``source:line``."""
    layers: list[Layer] = []
    edges: list[tuple[str, str]] = []
    parts: dict[str, list[float]] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        if line.startswith("\t"):
            m = _EDGE.match(line)
            if not m:
                raise ProfileError(f"{where}: malformed edge line {line.strip()!r} (expected 'nodeA -- nodeB')")
            edges.append((m.group(1), m.group(2)))
            continue
        m = _NODE.match(line)
        if not m:
            raise ProfileError(f"{where}: malformed node line {line[:60]!r}")
        name, desc, rest = m.groups()
        values: dict[str, float] = {}
        for part in rest.split(","):
            key, sep, raw = part.strip().partition("=")
            if not sep or key not in _FIELDS:
                raise ProfileError(f"{where}: unexpected field {part.strip()!r} in node {name}")
            raw = raw.strip()
            if key == "activation_size" and raw.startswith("["):
                items = _parse_list(raw)
                if items is None:
                    raise ProfileError(
                        f"{where}: {key} of node {name} is neither a number nor a list like [1.0; 2.0]: {raw!r}"
                    )
                parts[name] = items
                values[key] = sum(items)
                continue
            if not re.fullmatch(_NUMBER, raw):
                raise ProfileError(f"{where}: {key} of node {name} is not a number: {raw!r}")
            values[key] = float(raw)
        missing = [k for k in _FIELDS if k not in values]
        if missing:
            raise ProfileError(f"{where}: node {name} lacks {', '.join(missing)} (truncated line?)")
        try:
            layers.append(
                Layer(
                    name=name,
                    description=desc,
                    forward_ms=values["forward_compute_time"],
                    backward_ms=values["backward_compute_time"],
                    activation_bytes=values["activation_size"],
                    parameter_bytes=values["parameter_size"],
                )
            )
        except ProfileError as exc:
            raise ProfileError(f"{where}: {exc}") from None
    if not layers:
        raise ProfileError(f"{source}: no node lines (empty or truncated profile)")
    layers.sort(key=lambda layer: int(layer.name[4:]))
    meta: dict[str, object] = {"source": "graph.txt"}
    if parts:
        meta[PARTS_KEY] = parts
    try:
        return Profile.from_unordered(layers, edges, meta)
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None


def _parse_list(raw: str) -> list[float] | None:
    """``"[1.0; 2.5]"`` -> ``[1.0, 2.5]`` (``"[]"`` -> ``[]``); None if malformed, negative or not finite."""
    if not raw.endswith("]"):
        return None
    body = raw[1:-1].strip()
    if not body:
        return []
    items = [x.strip() for x in body.split(";")]
    if not all(re.fullmatch(_NUMBER, x) for x in items):
        return None
    values = [float(x) for x in items]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    return values


def _activation_text(profile: Profile, layer: Layer) -> str:
    parts = profile.meta.get(PARTS_KEY)
    items = parts.get(layer.name) if isinstance(parts, dict) else None
    if isinstance(items, list) and all(isinstance(x, (int, float)) for x in items) \
            and sum(float(x) for x in items) == layer.activation_bytes:
        return "[" + "; ".join(repr(float(x)) for x in items) + "]"
    return repr(layer.activation_bytes)


def dumps_graph_txt(profile: Profile) -> str:
    """Render a profile as ``graph.txt``; names that are not ``nodeN`` become ``node{i+1}``.

    Layer kinds, tied parameters and inputs have no place in ``graph.txt`` and are left out.
    """
    use_own = all(re.fullmatch(r"node\d+", l.name) for l in profile.layers)
    names = [l.name if use_own else f"node{i + 1}" for i, l in enumerate(profile.layers)]
    lines = []
    for name, l in zip(names, profile.layers):
        desc = l.description.replace("\n", " ").replace(" -- ", " - ") or "Layer"
        lines.append(
            f"{name} -- {desc} -- forward_compute_time={l.forward_ms!r}, backward_compute_time={l.backward_ms!r}, "
            f"activation_size={_activation_text(profile, l)}, parameter_size={l.parameter_bytes!r}"
        )
    for a, b in profile.edges:
        lines.append(f"\t{names[a]} -- {names[b]}")
    return "\n".join(lines) + "\n"
