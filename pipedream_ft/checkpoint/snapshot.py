"""Snapshots: what a checkpoint save copies before training may go on, and what it only references.

A *snapshot* of a state is taken while training waits. Everything in it must keep the value it had at the
snapshot until the part is persisted, so:

* tensors the caller marks with :func:`immutable` are never modified after creation (weight versions): the
  snapshot keeps a *reference* to them, no copy (on a GPU their device-to-host copy happens later, in the
  persist thread, on a side CUDA stream, into pinned host buffers the pool reuses as it does the mutable ones);
* every other tensor is *mutable* (live weights, optimizer state, buffers): it is copied, into buffers that a
  :class:`SnapshotPool` preallocates and reuses from one save to the next (no allocation, no page faults);
  CUDA tensors are copied into pinned host buffers on a side CUDA stream: training does not wait for the copy,
  the training stream only waits (on the GPU) for it before it may modify the source, and the persist thread
  waits for it before reading the buffer;
* plain values (int, float, str, bool, None, bytes, complex, torch.dtype/device/Size) are immutable in Python
  and containers (dict, OrderedDict, list, tuple) are rebuilt.

Anything else raises ``TypeError`` naming its path, at the snapshot (so ``save`` fails at once, not later).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from .checksum import checksum
from .directio import aligned_empty
from .storage import Buffers
from .tensorfile import dtype_name, encode_part

__all__ = ["Immutable", "Snapshot", "SnapshotPool", "immutable"]

_PLAIN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


class Immutable:
    """Marks a value (a tensor, or a container of tensors) whose tensors are never modified after this save:
    the snapshot keeps references to them instead of copying. Create with :func:`immutable`."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"immutable({type(self.value).__name__})"


def immutable(value: Any) -> Immutable:
    """Mark ``value`` (a tensor or a nested list/tuple/dict of them) as never modified after the save.

    Example: ``writer.save(step, {"versions": immutable(versions), "optimizer": opt.state_dict()})``.
    Marking a tensor that *is* modified later (a live parameter, an optimizer buffer) corrupts the checkpoint
    silently: only mark tensors that are replaced, not updated in place.
    """
    return value if isinstance(value, Immutable) else Immutable(value)


_Key = tuple[tuple[int, ...], torch.dtype, str]
"""(shape, dtype, kind): kind ``"cpu"`` (a page-aligned copy of a CPU tensor), ``"cuda"`` (a pinned copy of a
mutable CUDA tensor) or ``"cuda-ref"`` (a pinned copy of an immutable one, made later by the persist thread)."""


@dataclass(slots=True)
class _Arena:
    """Buffers by (shape, dtype, pinned): the n-th mutable tensor of a given kind in a snapshot reuses the n-th
    buffer of that kind (so keys that change from save to save, like update numbers, still reuse buffers)."""

    buffers: dict[_Key, list[torch.Tensor]] = field(default_factory=dict)
    busy: bool = False

    def buffer(self, key: _Key, used: dict[_Key, int]) -> torch.Tensor:
        """The next buffer of ``key`` in this snapshot, allocated on first use."""
        n = used.get(key, 0)
        used[key] = n + 1
        kind = self.buffers.setdefault(key, [])
        if n == len(kind):
            shape, dtype, where = key
            kind.append(aligned_empty(shape, dtype) if where == "cpu"  # page-aligned: written with O_DIRECT
                        else torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True))
        return kind[n]


@dataclass(slots=True)
class Snapshot:
    """A snapshot taken by :meth:`SnapshotPool.take`: ``tree`` holds CPU tensors, or device tensors still to be
    copied by :meth:`materialize`. :meth:`release` returns its buffers to the pool (after persisting).

    One snapshot may feed several writers (a cut saved to the memory tier and to durable storage is snapshotted
    once): each holder but the taker calls :meth:`retain`, every holder calls :meth:`release` when done with it,
    and the buffers go back to the pool at the last release. :meth:`materialize` is safe from several threads
    and does its work once."""

    tree: Any
    copied_bytes: int = 0
    """Bytes copied while training waited (mutable tensors)."""
    referenced_bytes: int = 0
    """Bytes of immutable tensors referenced, not copied."""
    _arena: _Arena | None = None
    _pool: SnapshotPool | None = None
    _events: list[Any] = field(default_factory=list)
    _host_copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(pinned buffer in the tree, immutable CUDA tensor) pairs still to copy."""
    _deferred: bool = False
    _holders: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _encoded: dict[str, tuple[Buffers, str]] = field(default_factory=dict)

    def retain(self) -> Snapshot:
        """One more holder (released by one more :meth:`release`); returns this snapshot."""
        with self._lock:
            if self._holders == 0:
                raise ValueError("the snapshot was released: its buffers may hold another save by now")
            self._holders += 1
        return self

    def materialize(self) -> Any:
        """The tree with every tensor on the CPU and safe to read: waits for the side-stream copies and copies
        immutable device tensors to the host. Call from a persist thread."""
        with self._lock:
            return self._materialize()

    def encoded(self, algorithm: str) -> tuple[Buffers, str]:
        """The part's file (:func:`~.tensorfile.encode_part` of the materialized tree) and its checksum under
        ``algorithm``: made once, by the first holder that asks, for every holder (a cut saved to the memory tier
        and durably is encoded and checksummed once). Call from a persist thread."""
        with self._lock:
            got = self._encoded.get(algorithm)
            if got is None:
                data = Buffers(encode_part(self._materialize()).chunks())
                got = self._encoded[algorithm] = (data, checksum(data, algorithm))
            return got

    def _materialize(self) -> Any:
        for ev in self._events:
            ev.synchronize()
        self._events.clear()
        if self._host_copies:
            assert self._pool is not None
            done = []
            for buf, src in self._host_copies:
                with torch.cuda.stream(self._pool._side_stream(src.device)):
                    buf.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record()
                    done.append(ev)
            for ev in done:
                ev.synchronize()
            self._host_copies.clear()
        if self._deferred:
            self.tree = _to_host(self.tree)
            self._deferred = False
        return self.tree

    def release(self) -> None:
        """This holder is done: at the last holder's release the buffers go back to the pool (the tree must not
        be used afterwards). Idempotent once the last holder released it."""
        with self._lock:
            self._holders = max(0, self._holders - 1)
            if self._holders:
                return
            self.tree = None
            self._encoded.clear()
            arena, self._arena = self._arena, None
        if self._pool is not None and arena is not None:
            self._pool._release(arena)


class SnapshotPool:
    """Takes snapshots into reused buffers.

    Args:
        max_arenas: how many sets of buffers to keep for reuse (one per save not yet persisted; more saves in
            flight allocate fresh buffers that are dropped after use).
    """

    def __init__(self, max_arenas: int = 2) -> None:
        if isinstance(max_arenas, bool) or not isinstance(max_arenas, int) or max_arenas < 1:
            raise ValueError(f"max_arenas must be an int >= 1, got {max_arenas!r}")
        self.max_arenas = max_arenas
        self._arenas: list[_Arena] = []
        self._lock = threading.Lock()
        self._streams: dict[Any, Any] = {}

    def _acquire(self) -> _Arena:
        with self._lock:
            for a in self._arenas:
                if not a.busy:
                    a.busy = True
                    return a
            a = _Arena(busy=True)
            if len(self._arenas) < self.max_arenas:
                self._arenas.append(a)
            return a

    def _release(self, arena: _Arena) -> None:
        with self._lock:
            arena.busy = False

    def _side_stream(self, device: torch.device) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def take(self, state: Any) -> Snapshot:
        """Snapshot ``state`` (see the module docstring). Raises ``TypeError`` naming the path of an
        unsupported value; nothing is kept busy then."""
        arena = self._acquire()
        snap = Snapshot(tree=None, _arena=arena, _pool=self)
        used: dict[_Key, int] = {}
        try:
            snap.tree = self._walk(state, "state", False, arena, snap, used)
        except BaseException:
            self._release(arena)
            raise
        for key in list(arena.buffers):  # the state's structure changed: drop what this snapshot did not use
            n = used.get(key, 0)
            if n:
                del arena.buffers[key][n:]
            else:
                del arena.buffers[key]
        return snap

    def _walk(self, value: Any, path: str, frozen: bool, arena: _Arena, snap: Snapshot, used: dict[_Key, int]) -> Any:
        if isinstance(value, Immutable):
            return self._walk(value.value, path, True, arena, snap, used)
        if isinstance(value, torch.Tensor):
            dtype_name(value.dtype)  # TypeError for dtypes the format cannot hold
            if value.layout != torch.strided:
                raise TypeError(f"{path}: cannot checkpoint a {value.layout} tensor; use dense tensors")
            nbytes = value.numel() * value.element_size()
            if frozen:
                snap.referenced_bytes += nbytes
                if value.device.type == "cuda":  # copied by the persist thread, after the pending writes
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(value.device))
                    snap._events.append(ev)
                    buf = arena.buffer((tuple(value.shape), value.dtype, "cuda-ref"), used)
                    snap._host_copies.append((buf, value.detach()))
                    return buf
                if value.device.type != "cpu":
                    snap._deferred = True
                return value.detach()
            snap.copied_bytes += nbytes
            return self._copy(value.detach(), arena, snap, used)
        tp = type(value)
        if tp in _PLAIN:
            return value
        if tp is torch.Size:
            return torch.Size(value)
        if tp is dict or tp is OrderedDict:
            out = tp()
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"{path}: dict keys must be str or int, got {type(k).__name__} {k!r}")
                out[k] = self._walk(v, f"{path}[{k!r}]", frozen, arena, snap, used)
            return out
        if tp is list:
            return [self._walk(v, f"{path}[{i}]", frozen, arena, snap, used) for i, v in enumerate(value)]
        if tp is tuple:
            return tuple(self._walk(v, f"{path}[{i}]", frozen, arena, snap, used) for i, v in enumerate(value))
        raise TypeError(
            f"{path}: cannot checkpoint a value of type {tp.__module__}.{tp.__qualname__}; "
            "use tensors, plain Python values (int, float, str, bool, None) and list/tuple/dict of them"
        )

    def _copy(self, src: torch.Tensor, arena: _Arena, snap: Snapshot, used: dict[_Key, int]) -> torch.Tensor:
        cuda = src.device.type == "cuda"
        buf = arena.buffer((tuple(src.shape), src.dtype, "cuda" if cuda else "cpu"), used)
        if cuda:
            main = torch.cuda.current_stream(src.device)
            side = self._side_stream(src.device)
            side.wait_stream(main)  # copy the value as of now, after the pending kernels that produce it
            with torch.cuda.stream(side):
                buf.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            main.wait_event(done)  # the training stream may modify src only after the copy (a GPU-side wait)
            snap._events.append(done)
        else:
            buf.copy_(src)
        return buf


def _to_host(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree if tree.device.type == "cpu" else tree.to("cpu")
    if isinstance(tree, dict):
        out = type(tree)()
        for k, v in tree.items():
            out[k] = _to_host(v)
        return out
    if isinstance(tree, list):
        return [_to_host(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_to_host(v) for v in tree)
    return tree
