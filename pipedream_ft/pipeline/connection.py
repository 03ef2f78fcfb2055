"""This rank's one communication handle, re-configured at every epoch.

A job talks through a new set of process groups after every recovery in place (a new *epoch*: new members,
new store namespace). Rather than hand each new :class:`~pipedream_ft.pipeline.group.CommGroup` and
:class:`~pipedream_ft.pipeline.comm.Messenger` to every component that talks (executor, stepper, data feed,
tied weights, checkpointer), each of them holds this one object, made once with everything that does not
change between epochs — rank, world size, backend, device, timeout, which links to open under NCCL — and asks
it for the current group or messenger when it talks:

* :meth:`Connection.configure` forms the epoch's groups in a store namespace;
* :meth:`Connection.release` aborts and closes them (every peer still waiting on this rank fails at once);
  until the next :meth:`~Connection.configure`, asking for the group or the messenger raises
  :class:`NotConnectedError`, which names the state instead of failing on ``None``.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Sequence

import torch

from ..errors import PipelineSetupError
from .comm import Messenger
from .group import CommGroup

__all__ = ["Connection", "NotConnectedError", "backend_and_device"]


class NotConnectedError(RuntimeError):
    """The connection has no process group now: not yet configured, or released between epochs."""


class Connection:
    """One rank's process groups and messenger across epochs (see the module docstring).

    ``links``: called at every :meth:`configure`, the ``(peer, channel)`` pairs this rank exchanges
    point-to-point messages on (NCCL opens one communicator per link; gloo needs none);
    ``replica_ranks``: the ranks of this rank's stage when it is replicated (their gradient all-reduce group).
    """

    def __init__(self, *, rank: int, world_size: int, backend: str, device: torch.device, timeout_s: float,
                 links: Callable[[], Sequence[tuple[int, str]]] = lambda: (),
                 replica_ranks: Sequence[int] | None = None) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self._links = links
        self.replica_ranks = tuple(replica_ranks) if replica_ranks is not None and len(replica_ranks) > 1 else None
        self._group: CommGroup | None = None
        self._messenger: Messenger | None = None
        self.epochs = 0
        """How many times :meth:`configure` formed groups."""

    @property
    def configured(self) -> bool:
        return self._group is not None

    def configure(self, store: Any, cancelled: Callable[[], bool] | None = None) -> None:
        """Form this epoch's groups in store namespace ``store`` (see :class:`CommGroup` for ``cancelled``).
        Raises ``RuntimeError`` if the previous epoch's were not released."""
        if self._group is not None:
            raise RuntimeError(f"rank {self.rank}: configure() while epoch {self.epochs}'s groups are still held; "
                               "release() them first")
        group = CommGroup(store, rank=self.rank, world_size=self.world_size, backend=self.backend, device=self.device,
                          timeout_s=self.timeout_s,
                          links=tuple(self._links()) if self.backend == "nccl" else (),
                          replica_ranks=self.replica_ranks, cancelled=cancelled)
        self._group = group
        self._messenger = Messenger(group, self.timeout_s)
        self.epochs += 1

    @property
    def group(self) -> CommGroup:
        """The current epoch's groups; :class:`NotConnectedError` between epochs."""
        if self._group is None:
            raise NotConnectedError(self._why())
        return self._group

    @property
    def messenger(self) -> Messenger:
        """The current epoch's messenger; :class:`NotConnectedError` between epochs."""
        if self._messenger is None:
            raise NotConnectedError(self._why())
        return self._messenger

    def flush(self) -> None:
        """Wait for this rank's sends to complete (nothing to do between epochs)."""
        if self._messenger is not None:
            self._messenger.flush()

    def release(self) -> None:
        """Abort and close the current groups, and every operation pending on them; a no-op between epochs."""
        group, self._group, self._messenger = self._group, None, None
        if group is not None:
            group.abort()
            group.close()
        del group
        gc.collect()

    def _why(self) -> str:
        state = "not configured yet" if self.epochs == 0 else f"released after epoch {self.epochs}"
        return f"rank {self.rank} has no process group: its connection is {state}"


def backend_and_device(local_rank: int, backend: str | None) -> tuple[str, torch.device]:
    """The backend (``backend``, or NCCL when CUDA is available, else gloo) and this rank's device (under NCCL
    the GPU ``local_rank``, made current). Raises :class:`PipelineSetupError` naming what is missing."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise PipelineSetupError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False")
        if local_rank >= torch.cuda.device_count():
            raise PipelineSetupError(f"LOCAL_RANK {local_rank} has no GPU ({torch.cuda.device_count()} visible)")
        torch.cuda.set_device(local_rank)
        return backend, torch.device("cuda", local_rank)
    return backend, torch.device("cpu")
