"""Peer copies: my part pushed to a peer rank's process on another node, which keeps it in its own memory tier.

Each rank runs a :class:`PeerServer` (a small TCP server in a background thread, bound to the node's address or
127.0.0.1) serving its node's :class:`~.shm.MemoryTier`; each rank writes its part, through a :class:`PeerTier`,
into the server of a *buddy* rank on another node (e.g. rank ``(r + ranks_per_node) % world``). When a node is
lost, its ranks' parts are still in their buddies' shared memory: the replacement ranks fetch them with
:meth:`PeerTier.get`. The runtime exchanges the servers' addresses (e.g. through the rendezvous store).

Protocol (one request per connection; every message is a 4-byte big-endian length, then that much JSON; a
payload of ``size`` raw bytes follows the JSON where noted):

* ``{"op": "put", "step", "part", "size", "checksum", "ts", "mac"}`` + payload -> ``{"ok": true}``: the server
  reads exactly ``size`` bytes, verifies the checksum and stores the part (so a torn transfer stores nothing);
* ``{"op": "get", "step", "part", "ts", "mac"}`` -> ``{"ok": true, "size", "checksum"}`` + payload;
* ``{"op": "steps", "parts", "ts", "mac"}`` -> ``{"ok": true, "steps": [...]}``;
* ``{"op": "keep", "k", "parts", "ts", "mac"}`` -> ``{"ok": true}``;
* on any error -> ``{"ok": false, "error": "..."}``.

Every socket operation has a timeout (``timeout_s``); a peer that is down or stuck fails the call with a
:class:`PeerError` naming the address, it never blocks training (the :class:`~.tiers.TierWriter` thread calls
it).

``token`` (optional; the runtime passes :func:`peer_token` of the job's key) is a secret shared by the server
and its clients; it never travels: each request carries ``ts`` (the sender's clock) and ``mac``, an HMAC-SHA256
under the token of the request's fields, and the server refuses a request whose MAC does not verify or whose
``ts`` is more than :data:`MAX_SKEW_S` away from its own clock (a replay). The connection is not encrypted:
parts travel in the clear, and someone who can change traffic on the network could alter a payload in a way
its checksum does not catch (use ``sha256`` checksums, or a private network).
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import socketserver
import struct
import threading
import time
from typing import Any, Sequence

from .checksum import Hasher, parse_checksum
from .format import CheckpointError, CorruptCheckpointError, validate_part_name, validate_step
from .reader import decode_verified
from .private import mac
from .shm import MemoryTier
from .storage import Buffers
from .tiers import Tier

__all__ = ["MAX_SKEW_S", "PeerClient", "PeerError", "PeerServer", "PeerTier", "peer_token"]

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_MAX_JSON = 1 << 20
_MAX_PART = 1 << 40
_CHUNK = 4 << 20


MAX_SKEW_S = 300.0
"""A request stamped further than this from the server's clock is refused (see the module docstring)."""


def peer_token(key: bytes) -> str:
    """The peer servers' shared secret, derived from the job's key."""
    return mac(key, "pipedream-ft peer token")


def _request_mac(token: str, req: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in req.items() if k != "mac"}, sort_keys=True)
    return mac(token.encode(), "pipedream-ft peer request", body)


class PeerError(CheckpointError):
    """A peer could not be reached, timed out, or refused a request."""


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> bytes | bytearray:
    buf = bytearray(n) if into is None else None
    view = memoryview(buf) if buf is not None else into
    assert view is not None
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf if buf is not None else b""


def _send_msg(sock: socket.socket, doc: dict[str, Any]) -> None:
    raw = json.dumps(doc).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)


def _recv_msg(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > _MAX_JSON:
        raise ValueError(f"message of {n} bytes is too large")
    doc = json.loads(bytes(_recv_exact(sock, n)))
    if not isinstance(doc, dict):
        raise ValueError(f"message must be a JSON object, got {type(doc).__name__}")
    return doc


class PeerServer:
    """Serves ``tier`` to peers over TCP (see the module docstring); ``port=0`` picks a free port.

    Start it with :meth:`start` (or as a context manager); :attr:`address` is ``(host, port)`` to publish."""

    def __init__(self, tier: MemoryTier, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 30.0,
                 token: str | None = None) -> None:
        if not isinstance(tier, MemoryTier):
            raise TypeError(f"tier must be a MemoryTier, got {type(tier).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.tier = tier
        self.timeout_s = float(timeout_s)
        self.token = token
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler, bind_and_activate=True)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> PeerServer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                            name=f"checkpoint-peer-server-{self.address[1]}", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving (the parts stay in the tier)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5.0)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout_s)
        try:
            req = _recv_msg(sock)
            if self.token is not None:
                ts = req.get("ts")
                if not hmac.compare_digest(str(req.get("mac", "")), _request_mac(self.token, req)):
                    raise PermissionError("request not signed with this job's token")
                if not isinstance(ts, (int, float)) or abs(time.time() - ts) > MAX_SKEW_S:
                    raise PermissionError(f"request stamped {ts!r}, more than {MAX_SKEW_S:.0f}s from this clock")
            op = req.get("op")
            if op == "put":
                self._put(sock, req)
            elif op == "get":
                step, part = validate_step(req.get("step")), validate_part_name(req.get("part"))
                buf, checksum, size = self.tier.read_raw(step, part)
                _send_msg(sock, {"ok": True, "size": len(buf), "checksum": checksum})
                sock.sendall(buf)
            elif op == "steps":
                parts = [validate_part_name(p) for p in req.get("parts") or []]
                _send_msg(sock, {"ok": True, "steps": self.tier.steps(parts)})
            elif op == "keep":
                raw = req.get("parts")
                parts = None if raw is None else [validate_part_name(p) for p in raw]
                self.tier.keep_last(req.get("k"), parts)  # type: ignore[arg-type]
                _send_msg(sock, {"ok": True})
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:
            logger.debug("checkpoint peer server: request failed: %s: %s", type(exc).__name__, exc)
            try:
                _send_msg(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]})
            except OSError:
                pass

    def _put(self, sock: socket.socket, req: dict[str, Any]) -> None:
        step, part = validate_step(req.get("step")), validate_part_name(req.get("part"))
        size, checksum = req.get("size"), req.get("checksum")
        if type(size) is not int or not 0 <= size <= _MAX_PART:
            raise ValueError(f"bad size {size!r}")
        algorithm, _ = parse_checksum(checksum)
        buf = bytearray(size)
        _recv_exact(sock, size, memoryview(buf))
        h = Hasher(algorithm)
        h.update(buf)
        if h.value() != checksum:
            raise CorruptCheckpointError(f"part {part!r} step {step}: received bytes have checksum {h.value()}, "
                                         f"sender says {checksum}")
        self.tier.put(step, part, Buffers([buf]), checksum)
        _send_msg(sock, {"ok": True})


class PeerClient:
    """Talks to one :class:`PeerServer` at ``address``; every call opens a connection with ``timeout_s``."""

    def __init__(self, address: tuple[str, int], *, timeout_s: float = 30.0, token: str | None = None) -> None:
        host, port = address
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"address must be (host, port), got {address!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.address = (host, port)
        self.timeout_s = float(timeout_s)
        self.token = token

    def _call(self, req: dict[str, Any], payload: Buffers | None = None,
              read_payload: bool = False) -> tuple[dict[str, Any], bytearray | None]:
        if self.token is not None:
            req = {**req, "ts": time.time()}
            req["mac"] = _request_mac(self.token, req)
        where = f"{self.address[0]}:{self.address[1]}"
        try:
            with socket.create_connection(self.address, timeout=self.timeout_s) as sock:
                sock.settimeout(self.timeout_s)
                _send_msg(sock, req)
                if payload is not None:
                    for chunk in payload.chunks:
                        sock.sendall(chunk)
                reply = _recv_msg(sock)
                if not reply.get("ok"):
                    raise PeerError(f"checkpoint peer {where} refused {req.get('op')}: {reply.get('error')}")
                data = None
                if read_payload:
                    size = reply.get("size")
                    if type(size) is not int or not 0 <= size <= _MAX_PART:
                        raise PeerError(f"checkpoint peer {where}: bad size {size!r}")
                    data = bytearray(size)
                    _recv_exact(sock, size, memoryview(data))
                return reply, data
        except PeerError:
            raise
        except (OSError, ValueError) as exc:
            kind = "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else "failed"
            raise PeerError(f"checkpoint peer {where}: {req.get('op')} {kind}: {type(exc).__name__}: {exc}") from None

    def put(self, step: int, part: str, data: Buffers | bytes, checksum: str) -> None:
        buffers = data if isinstance(data, Buffers) else Buffers([data])
        self._call({"op": "put", "step": validate_step(step), "part": validate_part_name(part),
                    "size": len(buffers), "checksum": checksum}, payload=buffers)

    def get(self, step: int, part: str) -> tuple[bytearray, str]:
        """The part's bytes and the checksum the peer recorded (verify them: :func:`~.reader.decode_verified`)."""
        reply, data = self._call({"op": "get", "step": validate_step(step), "part": validate_part_name(part)},
                                 read_payload=True)
        assert data is not None
        return data, str(reply.get("checksum"))

    def steps(self, parts: Sequence[str]) -> list[int]:
        reply, _ = self._call({"op": "steps", "parts": [validate_part_name(p) for p in parts]})
        steps = reply.get("steps")
        if not isinstance(steps, list) or not all(type(s) is int for s in steps):
            raise PeerError(f"checkpoint peer {self.address}: bad steps reply {steps!r}")
        return steps

    def keep(self, k: int, parts: Sequence[str] | None) -> None:
        """Keep the newest ``k`` steps of ``parts`` (``None``: of every part) on the peer."""
        self._call({"op": "keep", "k": k, "parts": None if parts is None else [validate_part_name(p) for p in parts]})


class PeerTier(Tier):
    """A peer's memory tier, as a tier of mine (puts go over the network; gets are verified here)."""

    name = "peer"

    def __init__(self, address: tuple[str, int], *, timeout_s: float = 30.0, token: str | None = None) -> None:
        self.client = PeerClient(address, timeout_s=timeout_s, token=token)

    def put(self, step: int, part: str, data: Buffers | bytes, checksum: str) -> None:
        self.client.put(step, part, data, checksum)

    def steps(self, parts: Sequence[str]) -> list[int]:
        return self.client.steps(parts)

    def get(self, step: int, part: str) -> dict[str, Any]:
        data, checksum = self.client.get(step, part)
        return decode_verified(data, checksum, None, f"peer {self.client.address}: part {part!r} step {step}")

    def keep_last(self, k: int, parts: Sequence[str] | None = None) -> None:
        self.client.keep(k, None if parts is None else list(parts))

    def __repr__(self) -> str:
        return f"PeerTier({self.client.address})"
