"""The process groups of one epoch of a job, built from a store namespace and thrown away whole.

The runtime does not use torch.distributed's global default group. Every *epoch* of a job — its start, and
each in-place recovery after a failure — builds its own groups from its own namespace of the job's store, so
that a recovery can abort them and build fresh ones without touching process-wide state:

* ``world``: every rank. Point-to-point transfers (gloo matches them by tag) and, under gloo, the small
  collectives of setup (agreeing on a checkpoint, gathering losses and weights).
* ``control`` (NCCL only): a gloo group over every rank for those small collectives, on the CPU.
* one group per replicated stage, made by its members only, for the gradient all-reduce; under NCCL also a gloo
  group of the same members (``replica_flags``), for the cut flags the replicas tell each other at each update,
  so that no host waits for its device to read them out of the reduced gradients.
* under NCCL, one two-rank group per link and direction (see :meth:`CommGroup.__init__`).

:meth:`CommGroup.abort` cancels everything pending (a failure); :meth:`CommGroup.close` shuts the groups
down cleanly (the end of training), so that no backend thread outlives the trainer.
"""

from __future__ import annotations

import pickle
import re
import threading
from datetime import timedelta
from typing import Any, Callable, ClassVar, Iterable, Sequence

import torch
import torch.distributed as dist

from ..errors import EXIT_RUNTIME

__all__ = ["CommGroup", "GroupError", "PeerTimeoutError", "backend_reason"]


class PeerTimeoutError(RuntimeError):
    """A transfer or collective with a peer failed or did not complete within the timeout."""

    exit_code: ClassVar[int] = EXIT_RUNTIME


class GroupError(PeerTimeoutError):
    """An operation of the group failed: a peer died, stopped answering, or the group was shut down."""


def backend_reason(exc: BaseException) -> str:
    """The useful part of a backend's error: no source location, no boilerplate advice."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    return text.split(" This is typically")[0].strip()


def _new_backend(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 device: torch.device) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


class CommGroup:
    """All the process groups this rank uses in one epoch.

    ``links`` lists the ``(peer, channel)`` pairs (channel ``"act"`` or ``"grad"``) that get a communicator of
    their own under NCCL: NCCL matches point-to-point operations between two ranks by order alone, so giving
    activations and gradients their own communicator per link leaves each with one stream of messages in
    minibatch order, and receives can be posted ahead without the two directions blocking each other. Gloo
    matches by tag and needs none. ``replica_ranks`` are the global ranks of this rank's stage if it is
    replicated (``None`` otherwise).
    """

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, backend: str, device: torch.device,
                 timeout_s: float, links: Iterable[tuple[int, str]] = (), replica_ranks: Sequence[int] | None = None,
                 cancelled: Callable[[], bool] | None = None, poll_s: float = 0.01,
                 flags_on_host: bool | None = None) -> None:
        """``flags_on_host``: a replicated stage's replicas sum their cut flags on the host, over a gloo group of
        their own (:meth:`replica_flags`; default: under a device backend, where reading them out of the gradients'
        all-reduce would wait for the device), not as one more element of the gradients' all-reduce.
        ``cancelled`` (a recovery's groups): asked every ``poll_s`` while the connections are being made; once
        it returns ``True`` (the epoch failed: a peer died meanwhile) the construction is abandoned and
        :class:`GroupError` raised at once, instead of waiting ``timeout_s`` for a peer that will never come. It
        must not use ``store``'s connection (the construction holds it while it waits for the peers)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self._groups: list[Any] = []
        self.closed = False
        self.world: Any = None
        self.control: Any = None
        self.replica: Any = None
        self.replica_ranks = tuple(replica_ranks or ())
        self.flags_on_host = backend != "gloo" if flags_on_host is None else bool(flags_on_host)
        self._replica_flags: Any = None
        self._links: dict[tuple[int, str], tuple[Any, int]] = {}
        links = list(links)
        if cancelled is None:
            self._build(store, links)
        else:
            self._build_unless(cancelled, poll_s, lambda: self._build(store, links))

    def _build(self, store: dist.Store, links: list[tuple[int, str]]) -> None:
        backend, rank, world_size = self.backend, self.rank, self.world_size
        self.world = self._make(backend, dist.PrefixStore("world/", store), rank, world_size)
        self.control = self.world if backend == "gloo" else \
            self._make("gloo", dist.PrefixStore("control/", store), rank, world_size)
        if len(self.replica_ranks) > 1:
            name = "-".join(map(str, self.replica_ranks))
            self.replica = self._make(backend, dist.PrefixStore(f"replica/{name}/", store),
                                      self.replica_ranks.index(rank), len(self.replica_ranks))
            if self.flags_on_host:
                self._replica_flags = self._make("gloo", dist.PrefixStore(f"replica-flags/{name}/", store),
                                                 self.replica_ranks.index(rank), len(self.replica_ranks))
        if backend == "nccl":
            for peer, channel in links:
                low, high = sorted((rank, peer))
                pg = self._make(backend, dist.PrefixStore(f"link/{low}-{high}/{channel}/", store),
                                0 if rank == low else 1, 2)
                self._links[(peer, channel)] = (pg, 1 if rank == low else 0)
        # Gloo's mesh handshake is not symmetric: one side of a pair may return from its constructor before the
        # other has finished, and a rank that then closed its groups at once (a run with nothing to send) would
        # cut the other off mid-handshake. No rank leaves until every rank has built every group.
        self._wait(self.control.allreduce([torch.zeros(1)]), "barrier after connecting")

    def _build_unless(self, cancelled: Callable[[], bool], poll_s: float, build: Callable[[], None]) -> None:
        """Run ``build`` in a thread; give up on it (it closes what it made once it ends) if ``cancelled()``."""
        lock = threading.Lock()
        state: dict[str, Any] = {"done": False, "abandoned": False, "error": None}

        def run() -> None:
            try:
                if self.device.type == "cuda":  # the current device is per thread
                    torch.cuda.set_device(self.device)
                build()
            except BaseException as exc:  # reported by the waiting thread, or dropped with an abandoned group
                state["error"] = exc
            with lock:
                state["done"] = True
                abandoned = state["abandoned"]
            if abandoned:
                self.close()

        thread = threading.Thread(target=run, name="pipedream-ft-connect", daemon=True)
        thread.start()
        while True:
            thread.join(poll_s)
            with lock:
                if state["done"]:
                    break
                try:
                    stop = cancelled()
                except BaseException:  # the store is gone: the job is ending
                    state["abandoned"] = True
                    raise
                if stop:
                    state["abandoned"] = True
                    raise GroupError("the epoch failed while its process groups were being connected")
        error = state["error"]
        if error is not None:
            self.close()
            if isinstance(error, RuntimeError):
                raise GroupError(f"cannot connect the process groups: {backend_reason(error)}") from None
            raise error

    def _make(self, backend: str, store: dist.Store, rank: int, size: int) -> Any:
        pg = _new_backend(backend, store, rank, size, self.timeout, self.device)
        self._groups.append(pg)
        return pg

    # -- point to point ---------------------------------------------------------------------------------------

    def _route(self, peer: int, channel: str) -> tuple[Any, int]:
        if channel.startswith("hdr"):  # headers on the host (see pipedream_ft.pipeline.comm): the gloo group
            return self.control, peer
        return self._links.get((peer, channel), (self.world, peer))

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, channel: str) -> Any:
        pg, dst = self._route(peer, channel)
        try:
            return pg.send([tensor], dst, tag)
        except RuntimeError as exc:  # the connection to the peer is gone
            raise GroupError(f"cannot send to rank {peer}: {backend_reason(exc)}") from None

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, channel: str) -> Any:
        pg, src = self._route(peer, channel)
        try:
            return pg.recv([tensor], src, tag)
        except RuntimeError as exc:
            raise GroupError(f"cannot receive from rank {peer}: {backend_reason(exc)}") from None

    # -- collectives --------------------------------------------------------------------------------------------

    def replica_allreduce(self, tensor: torch.Tensor) -> Any:
        """Start the sum of ``tensor`` over this stage's replicas; returns the work to wait for."""
        if self.replica is None:
            raise RuntimeError("this rank's stage is not replicated")
        try:
            return self.replica.allreduce([tensor])
        except RuntimeError as exc:
            raise GroupError(f"cannot start the replicas' all-reduce: {backend_reason(exc)}") from None

    def replica_flags(self, flags: int) -> tuple[Any, torch.Tensor] | None:
        """Start the sum of ``flags`` over this stage's replicas on the host (see ``flags_on_host``): returns the
        work to wait for and the CPU tensor that then holds the sum; ``None`` when the flags travel with the
        gradients instead."""
        if self._replica_flags is None:
            return None
        out = torch.tensor([flags], dtype=torch.int64)
        try:
            return self._replica_flags.allreduce([out]), out
        except RuntimeError as exc:
            raise GroupError(f"cannot start the replicas' sum of cut flags: {backend_reason(exc)}") from None

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order. A collective over the control group, on the CPU."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(self.control.allgather([sizes], [size]), "exchange of object sizes")
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(self.control.allgather([out], [padded]), "exchange of objects")
        return [pickle.loads(t[: int(n.item())].numpy().tobytes()) for t, n in zip(out, sizes)]

    def barrier(self) -> None:
        self._wait(self.control.barrier(), "barrier")

    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            raise GroupError(f"{what} failed: {backend_reason(exc)}") from None
        if ok is False:
            raise GroupError(f"{what} timed out after {self.timeout.total_seconds():.0f}s")

    # -- ending -------------------------------------------------------------------------------------------------

    def abort(self) -> None:
        """Cancel what the backend can cancel (NCCL: every pending operation). With gloo, pending operations end
        when the group's connections close: call :meth:`close` and drop every pending work. Idempotent."""
        for pg in self._groups:
            try:
                pg.abort()
            except Exception:  # a backend without abort, or one already torn down
                pass

    def close(self) -> None:
        """Shut every group down and let go of it. Once the caller holds no pending work either, its connections
        close (peers waiting on this rank fail at once) and no backend thread outlives it. Idempotent."""
        for pg in self._groups:
            try:
                pg.shutdown()
            except Exception:  # already aborted or shut down
                pass
        self._groups.clear()
        self._links.clear()
        self.world = self.control = self.replica = self._replica_flags = None
        self.closed = True
