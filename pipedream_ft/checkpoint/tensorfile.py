"""The part file format: a JSON header describing a nested state, then the raw bytes of its tensors.

Layout of one part file (all integers little-endian)::

    offset 0   MAGIC (8 bytes: b"PDFTTNS1")
    offset 8   header length H (uint64)
    offset 16  header: H bytes of UTF-8 JSON
               zero padding up to a multiple of ALIGN (4096)
    data       each tensor's bytes, C-contiguous, in native (little-endian) order, each starting at a
               multiple of ALIGN from the start of the file

The header is ``{"format": 1, "byteorder": "little", "tree": <node>, "tensors": [<entry>, ...]}`` where a
tensor entry is ``{"dtype": "float32", "shape": [2, 3], "offset": <from file start>, "nbytes": <n>}`` and a
tree node is plain JSON for ``str``, ``int``, ``bool``, ``None`` and finite ``float``, and a one-key object
for everything else:

====================  =============================================
``{"T": i}``           tensor ``i`` of the table (shared tensors are stored once)
``{"d": [[k, v]...]}``  ``dict`` (keys ``str`` or ``int``); ``"o"`` for ``OrderedDict``
``{"l": [...]}``       ``list``; ``"t"`` for ``tuple``
``{"f": "nan"}``       non-finite ``float`` (``"nan"``, ``"inf"``, ``"-inf"``)
``{"c": [re, im]}``    ``complex`` (each part a float node)
``{"b": "<base64>"}``  ``bytes``
``{"dt": "float16"}``  ``torch.dtype``; ``{"dv": "cuda:0"}`` ``torch.device``; ``{"S": [...]}`` ``torch.Size``
====================  =============================================

Decoding never unpickles anything: it parses JSON and views the data region with :func:`torch.frombuffer`
(the tensors share the buffer that was read; nothing is copied).
"""

from __future__ import annotations

import base64
import json
import math
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .format import CorruptCheckpointError

__all__ = [
    "ALIGN",
    "MAGIC",
    "EncodedPart",
    "decode_part",
    "dtype_from_name",
    "dtype_name",
    "encode_part",
    "is_tensorfile",
]

MAGIC = b"PDFTTNS1"
"""First 8 bytes of every part file in this format."""
ALIGN = 4096
"""Alignment of the data region and of every tensor in it (:data:`.directio.BLOCK`: page-aligned buffers are
written with ``O_DIRECT`` straight from memory)."""
_VERSION = 1
_PREFIX = struct.Struct("<8sQ")
_MAX_HEADER = 1 << 30

_DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(dt := getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dt: name for name, dt in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The header name of ``dtype`` (``"float32"``, ...); ``TypeError`` for dtypes the format cannot hold."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"cannot checkpoint tensors of dtype {dtype} (supported: {', '.join(_DTYPES)})") from None


def dtype_from_name(name: Any) -> torch.dtype:
    """Inverse of :func:`dtype_name`; :class:`CorruptCheckpointError` for unknown names."""
    dt = _DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise CorruptCheckpointError(f"part header: unknown dtype {name!r}")
    return dt


def is_tensorfile(prefix: bytes | bytearray | memoryview) -> bool:
    """Whether a file starting with ``prefix`` (at least 8 bytes) is in this format."""
    return bytes(prefix[: len(MAGIC)]) == MAGIC


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a CPU, contiguous tensor's data (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(slots=True)
class EncodedPart:
    """A part ready to be written: the bytes of the file are ``b"".join(chunks())`` (never materialized)."""

    head: bytes
    """Magic, header length, header and padding (the file's first ``len(head)`` bytes)."""
    tensors: list[torch.Tensor]
    """The tensors (CPU, contiguous) in file order; tensor ``i`` starts at ``offsets[i]``."""
    offsets: list[int]
    size: int
    """Total size of the file in bytes."""

    def chunks(self, max_chunk: int = 8 << 20) -> Iterator[memoryview]:
        """The file's bytes as a sequence of buffers of at most ``max_chunk`` bytes (views, no copies)."""
        yield memoryview(self.head)
        pos = len(self.head)
        for t, off in zip(self.tensors, self.offsets):
            if off > pos:
                yield memoryview(bytes(off - pos))
            view = _tensor_bytes(t) if t.numel() else memoryview(b"")
            for i in range(0, len(view), max_chunk):
                yield view[i : i + max_chunk]
            pos = off + len(view)
        if self.size > pos:
            yield memoryview(bytes(self.size - pos))


def encode_part(state: Any) -> EncodedPart:
    """Describe ``state`` (whose tensors are on the CPU) as a part file.

    Tensors are made contiguous (a copy only for non-contiguous ones); the same tensor (same data, dtype,
    shape and strides) appearing several times is stored once. Raises ``TypeError`` naming the path of a
    value the format cannot hold.
    """
    tensors: list[torch.Tensor] = []
    seen: dict[tuple[Any, ...], int] = {}

    def node(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise TypeError(f"{path}: tensor on {value.device}, expected a CPU tensor (snapshot first)")
            dtype_name(value.dtype)
            key = (value.data_ptr(), value.dtype, tuple(value.shape), tuple(value.stride()), value.numel())
            if value.numel() == 0 or key not in seen:
                if value.numel():
                    seen[key] = len(tensors)
                t = value.detach()
                tensors.append(t if t.is_contiguous() else t.contiguous())
                return {"T": len(tensors) - 1}
            return {"T": seen[key]}
        tp = type(value)
        if value is None or tp is str or tp is bool or tp is int:
            return value
        if tp is float:
            return value if math.isfinite(value) else {"f": repr(value)}
        if tp is dict or tp is OrderedDict:
            items = []
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"{path}: dict keys must be str or int, got {type(k).__name__} {k!r}")
                items.append([k, node(v, f"{path}[{k!r}]")])
            return {"o" if tp is OrderedDict else "d": items}
        if tp is list:
            return {"l": [node(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if tp is tuple:
            return {"t": [node(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if tp is torch.Size:
            return {"S": list(value)}
        if tp is complex:
            return {"c": [node(value.real, path), node(value.imag, path)]}
        if tp is bytes:
            return {"b": base64.b64encode(value).decode("ascii")}
        if tp is torch.dtype:
            return {"dt": dtype_name(value)}
        if tp is torch.device:
            return {"dv": str(value)}
        raise TypeError(
            f"{path}: cannot checkpoint a value of type {tp.__module__}.{tp.__qualname__}; "
            "use tensors, plain Python values (int, float, str, bool, None) and list/tuple/dict of them"
        )

    tree = node(state, "state")
    entries = []
    # First pass with placeholder offsets to size the header, then fix the offsets (the header's length
    # depends on the offsets' digits: iterate until stable, at most a few rounds).
    head_len = 0
    for _ in range(8):
        data_start = _round_up(_PREFIX.size + head_len)
        offsets, pos = [], data_start
        for t in tensors:
            offsets.append(pos)
            pos = _round_up(pos + t.numel() * t.element_size())
        entries = [
            {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": off, "nbytes": t.numel() * t.element_size()}
            for t, off in zip(tensors, offsets)
        ]
        header = json.dumps(
            {"format": _VERSION, "byteorder": sys.byteorder, "tree": tree, "tensors": entries},
            separators=(",", ":"), allow_nan=False,
        ).encode()
        if _round_up(_PREFIX.size + len(header)) == data_start:
            break
        head_len = len(header)
    else:  # pragma: no cover - the header length converges in two rounds
        raise AssertionError("part header size did not converge")
    head = _PREFIX.pack(MAGIC, len(header)) + header
    head += bytes(data_start - len(head))
    size = offsets[-1] + entries[-1]["nbytes"] if tensors else data_start
    return EncodedPart(head=head, tensors=tensors, offsets=offsets, size=size)


def decode_part(data: bytearray | memoryview | bytes) -> Any:
    """The state stored in a part file's bytes; tensors are views into ``data`` (pass a ``bytearray`` to
    get writable tensors). Raises :class:`CorruptCheckpointError` if the bytes are not a well-formed part."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise CorruptCheckpointError(f"part file too short ({len(view)} bytes)")
    magic, hlen = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"not a part file (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if hlen > _MAX_HEADER or _PREFIX.size + hlen > len(view):
        raise CorruptCheckpointError(f"part header length {hlen} does not fit in {len(view)} bytes")
    try:
        header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + hlen]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(f"part header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != _VERSION:
        got = header.get("format") if isinstance(header, dict) else header
        raise CorruptCheckpointError(f"part header: unsupported format {got!r} (expected {_VERSION})")
    if header.get("byteorder") != sys.byteorder:
        raise CorruptCheckpointError(
            f"part written on a {header.get('byteorder')!r}-endian machine, this one is {sys.byteorder!r}-endian"
        )
    entries = header.get("tensors")
    if not isinstance(entries, list):
        raise CorruptCheckpointError("part header: 'tensors' must be a list")
    buffer = data if isinstance(data, (bytearray, bytes)) else view
    tensors = [_tensor(buffer, len(view), e, i) for i, e in enumerate(entries)]
    return _tree(header.get("tree"), tensors)


def _tensor(buffer: Any, size: int, entry: Any, i: int) -> torch.Tensor:
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"part header: tensor {i} must be an object, got {entry!r}")
    dtype = dtype_from_name(entry.get("dtype"))
    shape, off, nbytes = entry.get("shape"), entry.get("offset"), entry.get("nbytes")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CorruptCheckpointError(f"part header: tensor {i} has a bad shape {shape!r}")
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if type(off) is not int or type(nbytes) is not int or nbytes != numel * itemsize or off < 0 or off + nbytes > size:
        raise CorruptCheckpointError(
            f"part header: tensor {i} ({entry.get('dtype')} {shape}) at offset {off!r} with {nbytes!r} bytes "
            f"does not fit in the {size}-byte file"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    import warnings

    with warnings.catch_warnings():  # read-only buffers (bytes) give read-only tensors; that is intended
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=off)
    return flat.view(dtype).view(shape)


def _float(node: Any) -> float:
    if type(node) in (int, float):
        return float(node)
    if isinstance(node, dict) and set(node) == {"f"} and node["f"] in ("nan", "inf", "-inf"):
        return float(node["f"])
    raise CorruptCheckpointError(f"part header: bad float {node!r}")


def _tree(node: Any, tensors: list[torch.Tensor]) -> Any:
    if node is None or type(node) in (str, bool, int, float):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise CorruptCheckpointError(f"part header: bad value node {str(node)[:100]!r}")
    ((tag, v),) = node.items()
    try:
        if tag == "T":
            if type(v) is not int or not 0 <= v < len(tensors):
                raise CorruptCheckpointError(f"part header: tensor index {v!r} out of range")
            return tensors[v]
        if tag in ("d", "o"):
            out: dict[Any, Any] = {} if tag == "d" else OrderedDict()
            for k, x in v:
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise CorruptCheckpointError(f"part header: bad dict key {k!r}")
                out[k] = _tree(x, tensors)
            return out
        if tag == "l":
            return [_tree(x, tensors) for x in v]
        if tag == "t":
            return tuple(_tree(x, tensors) for x in v)
        if tag == "f":
            return _float(node)
        if tag == "c":
            return complex(_float(v[0]), _float(v[1]))
        if tag == "b":
            return base64.b64decode(v, validate=True)
        if tag == "dt":
            return dtype_from_name(v)
        if tag == "dv":
            return torch.device(v)
        if tag == "S":
            return torch.Size(v)
    except CorruptCheckpointError:
        raise
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CorruptCheckpointError(f"part header: bad {tag!r} node: {exc}") from None
    raise CorruptCheckpointError(f"part header: unknown node tag {tag!r}")
