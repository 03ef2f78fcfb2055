"""PipeDream's profiler format, ``graph.txt``: import and export.

Node lines::

    nodeN -- DESCRIPTION -- forward_compute_time=F, backward_compute_time=B, activation_size=A, parameter_size=P

and edge lines ``<TAB>nodeA -- nodeB``. Times are milliseconds, sizes bytes. Nodes may come in any order;
the imported profile is sorted topologically (ties by node number).
"""

from __future__ import annotations

import re

from .profile import Layer, Profile, ProfileError

__all__ = ["parse_graph_txt", "dumps_graph_txt"]

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_NODE = re.compile(r"^(node\d+) -- (.*) -- (.*)$")
_EDGE = re.compile(r"^\t(node\d+) -- (node\d+)\s*$")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|NaN|inf|-inf"


def parse_graph_txt(text: str, source: str = "<graph.txt>") -> Profile:
    """Parse ``graph.txt``; a malformed line raises :class:`ProfileError` naming ``source:line``."""
    layers: list[Layer] = []
    edges: list[tuple[str, str]] = []
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
            if not re.fullmatch(_NUMBER, raw.strip()):
                raise ProfileError(f"{where}: {key} of node {name} is not a number: {raw.strip()!r}")
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
    try:
        return Profile.from_unordered(layers, edges, {"source": "graph.txt"})
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None


def dumps_graph_txt(profile: Profile) -> str:
    """Render a profile as ``graph.txt``; names that are not ``nodeN`` become ``node{i+1}``."""
    use_own = all(re.fullmatch(r"node\d+", l.name) for l in profile.layers)
    names = [l.name if use_own else f"node{i + 1}" for i, l in enumerate(profile.layers)]
    lines = []
    for name, l in zip(names, profile.layers):
        desc = l.description.replace("\n", " ").replace(" -- ", " - ") or "Layer"
        lines.append(
            f"{name} -- {desc} -- forward_compute_time={l.forward_ms!r}, backward_compute_time={l.backward_ms!r}, "
            f"activation_size={l.activation_bytes!r}, parameter_size={l.parameter_bytes!r}"
        )
    for a, b in profile.edges:
        lines.append(f"\t{names[a]} -- {names[b]}")
    return "\n".join(lines) + "\n"
