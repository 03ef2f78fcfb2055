"""Point-to-point transfers between neighbouring stages, non-blocking and with timeouts.

An activation message is a fixed-size ``int64`` header followed by the tensors crossing the boundary. The
header carries the minibatch number, a version tag, flags (for instance "checkpoint after this minibatch")
and the tensors' dtypes and shapes, so the receiver learns shapes from the first message on a link without the
user declaring them; later receives are posted ahead of time with the learned shapes, and the header is
checked against them. Once a link's shapes are known, an activation of at most :data:`PACK_LIMIT` bytes
travels with its header as one message (:class:`Packing`). A gradient message is just the gradients of the
floating-point tensors of the matching activation message, whose shapes both sides already know.

Every wait is bounded: a peer that is dead or stuck makes :class:`PeerTimeoutError` name the operation and the
peer instead of hanging. With gloo each message gets its own tag; NCCL ignores tags and keeps order per pair.

**Headers on the host.** A receiver acts on a header with the host (the version tag picks weights, the flags
announce a cut), so a header received into device memory would make the host wait for the device once per
message: on every stage, before it may queue the minibatch's forward. On a device (NCCL), headers therefore
travel as CPU tensors over the group's gloo ``control`` group (the link ``"hdr"``), and only the tensors over the
device's links; a small activation is not packed with its header there. The receiver reads the header on the
host and queues the forward at once, on tensors whose receives were posted ahead: the device runs it when they
arrive.

**Channels.** Header-and-tensors messages travel on a *channel*: ``"act"`` (training activations, shapes
learned once and fixed), ``"tgt"`` (stage 0 sends each minibatch's targets straight to the last stage),
``"eval"`` and ``"eval-tgt"`` (activations and targets of :meth:`~pipedream_ft.trainer.PipelineTrainer.evaluate`).
Each channel has its own tag space; every channel but ``"act"`` has *variable* shapes: each message's header
is read before its tensors are received, so shapes may change from message to message (a last partial
batch). Under NCCL a channel rides on a link's communicator: ``"eval"`` shares ``"act"``'s and ``"eval-tgt"``
shares ``"tgt"``'s, which is safe because evaluation runs only while no training message is in flight.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np
import torch

from ..errors import EXIT_SETUP
from .group import CommGroup, PeerTimeoutError, backend_reason

if TYPE_CHECKING:
    from .colocated import Handoff, StageRoute

__all__ = ["TensorSpec", "Header", "PeerTimeoutError", "ShapeMismatchError", "Messenger", "Packing", "RecvHandle"]

HEADER_LEN = 8 + 16 * 11
MAX_TENSORS = 16
MAX_DIMS = 8
_MAGIC = 0x5044  # "PD"
_OBJECT = -3
"""Pseudo minibatch number of object messages (the pre-flight uses -1 for its activations)."""

_DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


class ShapeMismatchError(ValueError):
    """Tensors crossing a stage boundary changed dtype or shape, or do not fit what the receiver expects."""

    exit_code: ClassVar[int] = EXIT_SETUP


@dataclass(frozen=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(t.shape), t.dtype)

    def __str__(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}{list(self.shape)}"


@dataclass(frozen=True, slots=True)
class Header:
    minibatch: int
    tag: int = 0
    """A version tag (vertical sync: the weight version stage 0 used)."""
    flags: int = 0


def _template(specs: Sequence[TensorSpec]) -> np.ndarray:
    """The header of a message of tensors ``specs``, its minibatch, tag and flags left 0 (see :func:`_encode`)."""
    if len(specs) > MAX_TENSORS:
        raise ShapeMismatchError(f"at most {MAX_TENSORS} tensors may cross a stage boundary, got {len(specs)}")
    buf = [0] * HEADER_LEN
    buf[0] = _MAGIC
    buf[4] = len(specs)
    for i, spec in enumerate(specs):
        if spec.dtype not in _CODE:
            raise ShapeMismatchError(f"dtype {spec.dtype} cannot cross a stage boundary")
        if len(spec.shape) > MAX_DIMS:
            raise ShapeMismatchError(f"tensors crossing stages may have at most {MAX_DIMS} dims, got {spec}")
        off = 8 + 11 * i
        buf[off] = _CODE[spec.dtype]
        buf[off + 1] = len(spec.shape)
        buf[off + 2: off + 2 + len(spec.shape)] = list(spec.shape)
    return np.array(buf, dtype=np.int64)


def _encode(header: Header, specs: Sequence[TensorSpec], device: torch.device,
            template: np.ndarray | None = None) -> torch.Tensor:
    """The header message: ``template`` (:func:`_template` of ``specs``, made here if not given) with the header's
    minibatch, tag and flags."""
    arr = (template if template is not None else _template(specs)).copy()
    arr[1], arr[2], arr[3] = header.minibatch, header.tag, header.flags
    buf = torch.from_numpy(arr)
    return buf if device.type == "cpu" else buf.to(device, non_blocking=True)


def _decode(buf: torch.Tensor) -> tuple[Header, list[TensorSpec]]:
    vals = buf.tolist()
    if vals[0] != _MAGIC:
        raise ShapeMismatchError(f"corrupt activation header (magic {vals[0]:#x})")
    specs = []
    for i in range(vals[4]):
        off = 8 + 11 * i
        ndim = vals[off + 1]
        specs.append(TensorSpec(tuple(vals[off + 2: off + 2 + ndim]), _DTYPES[vals[off]]))
    return Header(vals[1], vals[2], vals[3]), specs


def _tag(minibatch: int, slot: int) -> int:
    return (minibatch % (1 << 24)) * 32 + slot


_CHANNELS: dict[str, tuple[str, int]] = {
    "act": ("act", 0), "grad": ("grad", 0), "tgt": ("tgt", 1 << 29), "eval": ("act", 2 << 29),
    "eval-tgt": ("tgt", 3 << 29),
}
"""channel -> (the link it rides on under NCCL, its tag base): tags never collide across channels."""

PACK_LIMIT = 1 << 18
"""Bytes up to which an activation message and its header travel as one message (see :class:`Packing`)."""
_HEADER_BYTES = HEADER_LEN * 8
_TAIL = 4 * 8
"""Where the header's description of the tensors starts (after magic, minibatch, tag and flags)."""
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16, torch.int64: np.int64,
          torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
          torch.bool: np.bool_, torch.complex64: np.complex64}
"""The dtypes numpy has, for :meth:`Packing.unpack_host`."""
_ALIGN = 16


@dataclass(frozen=True, slots=True)
class Packing:
    """An activation message sent as one buffer: the header, then each tensor's bytes at a 16-byte aligned offset.

    Once both ends of a link know its shapes (after its first message, the pre-flight's), an activation of at most
    :data:`PACK_LIMIT` bytes travels with its header as one message instead of one for the header and one per
    tensor: a send and a receive fewer per minibatch and stage boundary, at the cost of one copy of a small
    activation. The receiver's tensors are views of the received buffer. Larger activations keep one message per
    tensor (no copy)."""

    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    """Each tensor's byte offset and length."""
    pads: tuple[int, ...]
    """Zero bytes after each tensor, up to the next aligned offset."""
    size: int
    """The whole buffer's bytes."""

    @staticmethod
    def of(specs: Sequence[TensorSpec]) -> Packing | None:
        """The packing of a message of ``specs``, or ``None`` when it is larger than :data:`PACK_LIMIT`."""
        offsets, nbytes, pads = [], [], []
        end = _HEADER_BYTES
        for spec in specs:
            n = spec.dtype.itemsize
            for d in spec.shape:
                n *= d
            offsets.append(end)
            nbytes.append(n)
            pads.append(-n % _ALIGN)
            end += n + pads[-1]
        return Packing(tuple(offsets), tuple(nbytes), tuple(pads), end) if end <= PACK_LIMIT else None

    def pack(self, header: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One ``uint8`` buffer of the encoded ``header`` and ``tensors``."""
        chunks = [header.view(torch.uint8)]
        for t, pad in zip(tensors, self.pads):
            if t.is_complex():  # a lazily conjugated view has its values made first
                t = t.resolve_conj().resolve_neg()
            chunks.append(t.detach().reshape(-1).view(torch.uint8))
            if pad:
                chunks.append(torch.zeros(pad, dtype=torch.uint8, device=header.device))
        return torch.cat(chunks)

    def pack_host(self, template: np.ndarray, header: Header, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`pack` of CPU ``tensors`` with the header written straight into the buffer (``template``, see
        :func:`_template`, with ``header``'s three fields): one allocation and one copy per tensor, no
        concatenation. The padding is zeros."""
        arr = np.zeros(self.size, dtype=np.uint8)
        fields = arr[:_HEADER_BYTES].view(np.int64)
        fields[:] = template
        fields[1], fields[2], fields[3] = header.minibatch, header.tag, header.flags
        for t, o, n in zip(tensors, self.offsets, self.nbytes):
            if n:
                np_dtype = _NUMPY.get(t.dtype)
                if t.is_complex():  # a lazily conjugated view has its values made first
                    t = t.resolve_conj().resolve_neg()
                if np_dtype is not None:
                    arr[o: o + n].view(np_dtype)[:] = t.detach().numpy().reshape(-1)
                else:
                    arr[o: o + n] = t.detach().reshape(-1).view(torch.uint8).numpy()
        return torch.from_numpy(arr)

    def unpack_host(self, arr: np.ndarray, buf: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
        """:meth:`unpack` of a buffer on the CPU, ``buf`` a tensor of the array ``arr``: views made by numpy where
        it has the dtype (fewer steps through torch's dispatcher), by torch otherwise (``bfloat16``)."""
        out = []
        for o, n, spec in zip(self.offsets, self.nbytes, specs):
            np_dtype = _NUMPY.get(spec.dtype)
            out.append(torch.from_numpy(arr[o: o + n].view(np_dtype).reshape(spec.shape)) if np_dtype is not None
                       else buf[o: o + n].view(spec.dtype).view(spec.shape))
        return out

    def unpack(self, buf: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
        """The tensors of a received buffer (views of it)."""
        return [buf[o: o + n].view(spec.dtype).view(spec.shape)
                for o, n, spec in zip(self.offsets, self.nbytes, specs)]


class RecvHandle:
    """A posted receive; :meth:`wait` returns the header (or ``None`` for gradients) and the tensors."""

    def __init__(self, messenger: Messenger, peer: int, minibatch: int, what: str, channel: str = "act") -> None:
        self._m = messenger
        self.peer = peer
        self.minibatch = minibatch
        self.what = what
        self.channel = channel if what == "activation" else "grad"
        self.header_buf: torch.Tensor | None = None
        self.header_work: Any = None
        self.tensors: list[torch.Tensor] = []
        self.works: list[Any] = []
        self.expected: list[TensorSpec] | None = None
        self.wait_s = 0.0
        self.deferred = False
        self.packing: Packing | None = None
        """Set when the message comes as one buffer (``header_buf``) holding the header and the tensors."""
        self.host: np.ndarray | None = None
        """A packed message's buffer on the CPU, as the array ``header_buf`` shares its memory with."""

    def wait(self) -> tuple[Header | None, list[torch.Tensor]]:
        t0 = time.perf_counter()
        header = None
        if self.deferred:
            self.deferred = False
            self._m._post_header(self)
        if self.header_work is not None:
            self._m._wait(self.header_work, f"{self.what} header of minibatch {self.minibatch}", self.peer)
            assert self.header_buf is not None
            packing, host = self.packing, self.host
            if host is not None and packing is not None:  # the common case on the CPU: read in place
                fields = host[:_HEADER_BYTES].view(np.int64)
                if (fields[0] == _MAGIC and fields[1] == self.minibatch
                        and host[_TAIL:_HEADER_BYTES].tobytes() == self._m._tails[self.peer]):
                    self.tensors = packing.unpack_host(host, self.header_buf, self.expected or ())
                    self.wait_s = time.perf_counter() - t0
                    return Header(int(fields[1]), int(fields[2]), int(fields[3])), self.tensors
                # else: decoded below, which names what differs
            header, specs = _decode(self.header_buf if packing is None else
                                    self.header_buf[:_HEADER_BYTES].view(torch.int64))
            if header.minibatch != self.minibatch:
                raise ShapeMismatchError(
                    f"expected minibatch {self.minibatch} from rank {self.peer}, got {header.minibatch}"
                )
            if self.expected is None:
                if self.channel == "act":
                    self._m._learn(self.peer, specs)
                self._post_tensors(specs)
            elif specs != self.expected:
                raise ShapeMismatchError(
                    f"rank {self.peer} sent {', '.join(map(str, specs))} for minibatch {self.minibatch}, "
                    f"but earlier minibatches were {', '.join(map(str, self.expected))}; use fixed-size "
                    "minibatches (drop the last partial one)"
                )
            if packing is not None:
                self.tensors = packing.unpack(self.header_buf, specs)
        for w in self.works:
            self._m._wait(w, f"{self.what} of minibatch {self.minibatch}", self.peer)
        self.wait_s = time.perf_counter() - t0
        return header, self.tensors

    def _post_tensors(self, specs: Sequence[TensorSpec]) -> None:
        self.expected = list(specs)
        for i, spec in enumerate(specs):
            t = torch.empty(spec.shape, dtype=spec.dtype, device=self._m.device)
            self.tensors.append(t)
            link, base = _CHANNELS[self.channel]
            code = self._m._code(self.minibatch, self.peer, self.channel == "grad")
            self.works.append(self._m._irecv(t, self.peer, base + _tag(code, i + 1), self._m._link(link, self.peer)))


class Messenger:
    """Sends and receives stage-boundary tensors for one rank."""

    def __init__(self, group: CommGroup, timeout_s: float, *, route: StageRoute | None = None,
                 handoff: Handoff | None = None, host_headers: bool | None = None) -> None:
        """``group`` carries the traffic (its links, under NCCL, one communicator per link and direction).

        ``route``: a stage of a process that holds several (see :mod:`~pipedream_ft.pipeline.colocated`): peers
        are then *stages*, each message's tag carries the stage that sends it, and a message to a stage of this
        same process is left in ``handoff`` instead of travelling. ``host_headers``: send headers on the host
        (default: when the group's device is not the CPU)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if route is not None and handoff is None:
            raise ValueError("a stage's messenger (route given) needs the process's handoff")
        self.group = group
        self.route = route
        self.handoff = handoff
        self._lanes = route.lanes if route is not None else 1
        self._stage = route.stage if route is not None else 0
        self.device = group.device
        self.host_headers = self.device.type != "cpu" if host_headers is None else host_headers
        """Headers travel as CPU tensors on the link ``"hdr"`` (see the module docstring); tensors as before."""
        self._header_device = torch.device("cpu") if self.host_headers else self.device
        self.timeout = timedelta(seconds=timeout_s)
        self._learned: dict[int, list[TensorSpec]] = {}
        self._sent_specs: dict[int, list[TensorSpec]] = {}
        self._templates: dict[int, np.ndarray] = {}
        """peer -> the activation header's template (its shapes are fixed: see :meth:`send_activations`)."""
        self._packings: dict[tuple[int, bool], Packing | None] = {}
        """(peer, sending) -> how the activations on that link are packed (``None``: they are not, too large)."""
        self._tails: dict[int, bytes] = {}
        """peer -> the bytes of its activation header after the four fields that change (see :class:`Packing`)."""
        self._pending: list[tuple[Any, Any, str, int]] = []
        self._unresolved: set[int] = set()

    # -- sending ------------------------------------------------------------------------------------------

    def send_activations(self, peer: int, header: Header, tensors: Sequence[torch.Tensor], channel: str = "act"
                         ) -> None:
        """Send ``header`` and ``tensors`` to ``peer`` on ``channel`` (see the module docstring)."""
        specs = [TensorSpec.of(t) for t in tensors]
        packing = None
        if channel == "act":
            before = self._sent_specs.get(peer)
            if before is None:  # the link's first message (the pre-flight's) teaches the receiver its shapes
                before = self._sent_specs[peer] = specs
            elif before == specs and not self.host_headers:
                packing = self._packing(peer, True, specs)
        else:
            before = specs
        if before != specs:
            raise ShapeMismatchError(
                f"minibatch {header.minibatch} sends {', '.join(map(str, specs))} to rank {peer}, but earlier "
                f"minibatches sent {', '.join(map(str, before))}; use fixed-size minibatches (drop the last "
                "partial one)"
            )
        if channel == "act":  # fixed shapes: the header's template is made once per peer
            template = self._templates.get(peer)
            if template is None:
                template = self._templates[peer] = _template(specs)
        else:
            template = None
        link, base = _CHANNELS[channel]
        if packing is not None and self.device.type == "cpu":  # the common case on the CPU: one buffer, made once
            assert template is not None
            self._isend(packing.pack_host(template, header, tensors), peer,
                        base + _tag(self._code(header.minibatch, self._stage), 0),
                        f"activation of minibatch {header.minibatch}", self._link(link, self._stage))
            return
        buf = _encode(header, specs, self._header_device, template)
        header_link = self._link("hdr" if self.host_headers else link, self._stage)
        link = self._link(link, self._stage)
        code = self._code(header.minibatch, self._stage)
        what = "activation" if channel == "act" else f"{channel} message"
        if packing is not None:
            self._isend(packing.pack(buf, tensors), peer, base + _tag(code, 0), f"{what} of minibatch "
                        f"{header.minibatch}", link)
            return
        self._isend(buf, peer, base + _tag(code, 0), f"{what} header of minibatch {header.minibatch}", header_link)
        for i, t in enumerate(tensors):
            self._isend(t.detach().contiguous(), peer, base + _tag(code, i + 1),
                        f"{what} of minibatch {header.minibatch}", link)

    def _packing(self, peer: int, sending: bool, specs: Sequence[TensorSpec]) -> Packing | None:
        key = (peer, sending)
        if key not in self._packings:
            self._packings[key] = Packing.of(specs)
        return self._packings[key]

    def send_object(self, peer: int, obj: Any) -> None:
        """Send a small picklable object on the activation channel (the pre-flight's structure message)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        code, link = self._code(_OBJECT, self._stage), self._link("act", self._stage)
        self._isend(size, peer, _tag(code, 0), "object size", link)
        self._isend(payload, peer, _tag(code, 1), "object", link)

    def recv_object(self, peer: int) -> Any:
        """Receive what :meth:`send_object` sent from ``peer`` (blocking, with the timeout)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        code, link = self._code(_OBJECT, peer), self._link("act", peer)
        self._wait(self._irecv(size, peer, _tag(code, 0), link), "object size", peer)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._wait(self._irecv(payload, peer, _tag(code, 1), link), "object", peer)
        return pickle.loads(payload.cpu().numpy().tobytes())

    def send_tensor(self, peer: int, minibatch: int, slot: int, tensor: torch.Tensor, channel: str) -> None:
        """Send one tensor whose shape the receiver knows (e.g. a tied parameter's gradient) in message ``slot``."""
        self._isend(tensor.detach().contiguous(), peer, _tag(self._code(minibatch, self._stage), slot),
                    f"{channel} tensor of update {minibatch}", self._link(channel, self._stage))

    def recv_tensor(self, peer: int, minibatch: int, slot: int, buf: torch.Tensor, channel: str) -> Any:
        """Post the receive of what :meth:`send_tensor` sends into ``buf``; wait for the returned work with
        :meth:`wait`."""
        return self._irecv(buf, peer, _tag(self._code(minibatch, peer), slot), self._link(channel, peer))

    def send_gradients(self, peer: int, minibatch: int, tensors: Sequence[torch.Tensor]) -> None:
        code, link = self._code(minibatch, self._stage, True), self._link("grad", self._stage)
        for i, t in enumerate(tensors):
            self._isend(t.detach().contiguous(), peer, _tag(code, i + 1), f"gradient of minibatch {minibatch}", link)

    # -- stages of one process (see pipedream_ft.pipeline.colocated) ---------------------------------------------

    def _code(self, minibatch: int, sender: int, grad: bool = False) -> int:
        """The minibatch field of a tag: the minibatch, and for a stage's messenger also the stage that sends it
        and whether it is a gradient (two stages of a process may send the same minibatch to one rank)."""
        return minibatch if self._lanes == 1 else minibatch * self._lanes + 2 * sender + grad

    def _link(self, channel: str, sender: int) -> str:
        """The link a message travels on: its channel's, of its sending stage for a stage's messenger (under NCCL
        each is a communicator of its own, so every stream between two ranks stays in order)."""
        return channel if self.route is None else f"{channel}:{sender}"

    def _irecv(self, buf: torch.Tensor, peer: int, tag: int, link: str) -> Any:
        if self.route is None:
            return self.group.irecv(buf, peer, tag, link)
        rank = self.route.ranks[peer]
        if rank == self.group.rank:
            assert self.handoff is not None
            return self.handoff.receive((self._stage, link, tag), buf, peer)
        return self.group.irecv(buf, rank, tag, link)

    def _isend(self, t: torch.Tensor, peer: int, tag: int, what: str, kind: str) -> None:
        if self.route is not None:
            rank = self.route.ranks[peer]
            if rank == self.group.rank:  # a stage of this process: nothing travels
                assert self.handoff is not None
                self.handoff.put((peer, kind, tag), t.clone(), what, unique=False)
                return
            peer = rank
        work = self.group.isend(t, peer, tag, kind)
        self._pending.append((work, t, what, peer))
        while len(self._pending) > 64:
            # gloo reports a send complete only once it is waited on: wait for the oldest (long done)
            old, _, what_old, peer_old = self._pending.pop(0)
            self._wait(old, f"send of {what_old}", peer_old)

    def flush(self) -> None:
        """Wait until every send posted so far has completed."""
        for work, _, what, peer in self._pending:
            self._wait(work, f"send of {what}", peer)
        self._pending.clear()

    # -- receiving ----------------------------------------------------------------------------------------

    def post_activations(self, peer: int, minibatch: int, channel: str = "act") -> RecvHandle:
        """Post the receive of minibatch ``minibatch``'s activations (or ``channel``'s message) from ``peer``.

        Until the first header from ``peer`` has been read, at most one receive is posted per link, so that
        backends that match messages by order alone (NCCL) never pair a header buffer with a tensor. On a
        variable-shape channel only the header is posted; wait for one message before posting the next.
        """
        h = RecvHandle(self, peer, minibatch, "activation", channel)
        if channel != "act":
            self._post_header(h)
            return h
        if peer not in self._learned and peer in self._unresolved:
            h.deferred = True
            return h
        self._post_header(h)
        return h

    def _post_header(self, h: RecvHandle) -> None:
        link, base = _CHANNELS[h.channel]
        known = self._learned.get(h.peer) if h.channel == "act" else None
        packing = self._packing(h.peer, False, known) if known is not None and not self.host_headers else None
        if packing is not None:  # header and tensors in one buffer (see Packing)
            h.packing, h.expected = packing, known
            if self.device.type == "cpu":
                h.host = np.empty(packing.size, dtype=np.uint8)
                h.header_buf = torch.from_numpy(h.host)
                if h.peer not in self._tails:
                    self._tails[h.peer] = _template(known)[4:].tobytes()
            else:
                h.header_buf = torch.empty(packing.size, dtype=torch.uint8, device=self.device)
            h.header_work = self._irecv(h.header_buf, h.peer, base + _tag(self._code(h.minibatch, h.peer), 0),
                                        self._link(link, h.peer))
            return
        h.header_buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._header_device)
        h.header_work = self._irecv(h.header_buf, h.peer, base + _tag(self._code(h.minibatch, h.peer), 0),
                                    self._link("hdr" if self.host_headers else link, h.peer))
        if h.channel != "act":
            return
        known = self._learned.get(h.peer)
        if known is not None:
            h._post_tensors(known)
        else:
            self._unresolved.add(h.peer)

    def post_gradients(self, peer: int, minibatch: int, specs: Sequence[TensorSpec]) -> RecvHandle:
        h = RecvHandle(self, peer, minibatch, "gradient")
        h._post_tensors(specs)
        return h

    def _learn(self, peer: int, specs: list[TensorSpec]) -> None:
        self._learned[peer] = specs
        self._tails.pop(peer, None)
        self._unresolved.discard(peer)

    def _wait(self, work: Any, what: str, peer: int) -> None:
        self.wait(work, f"{what} with rank {peer}")

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` at most the timeout; raise :class:`PeerTimeoutError` naming ``what`` otherwise."""
        t0 = time.monotonic()
        try:
            ok = work.wait(self.timeout)
        except Exception as exc:  # backends raise their own error types on timeout or a dead peer
            waited = time.monotonic() - t0
            limit = self.timeout.total_seconds()
            how = f"timed out after {limit:.0f}s" if waited >= 0.99 * limit else f"failed after {waited:.2f}s"
            raise PeerTimeoutError(f"{what} {how}: {backend_reason(exc)}") from None
        if ok is False:
            raise PeerTimeoutError(f"{what} timed out after {self.timeout.total_seconds():.0f}s")
