"""One background thread serving every checkpoint writer of a process.

A process holds one part per stage it runs, and each part is written to the memory tier (a
:class:`~.tiers.TierWriter`) and to durable storage (a :class:`~.writer.CheckpointWriter`). Each writer keeps its
own queue, handles and bookkeeping, but none owns a thread: they are *clients* of one :class:`Background`, whose
thread serves them all, so the threads of a process do not grow with its number of stages.

A client says, under the background's lock, when it next has work (:meth:`Client.due`: now, a time to come, or
never), and does one unit of it outside the lock (:meth:`Client.serve`: write one part, try a failed write again,
poll for the other parts of a commit, put one part into the fast tiers). A unit never sleeps: a failed write is
tried again later (the client says when), and other clients are served in between. Among the clients ready now,
the one of lowest :attr:`Client.priority` goes first (the fast tiers before durable storage, since what
in-place recovery restores is the memory tier), then in turn.

The clients share the background's condition (:attr:`Background.cond`) as their lock: a save, a flush, a
rewind wake the thread and wait on it directly.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import ABC, abstractmethod

__all__ = ["Background", "Client", "lower_thread_priority"]

logger = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> bool:
    """Set the calling thread's nice value to ``nice`` (Linux: threads have their own). Returns whether it
    worked; raising the priority (lowering the value) needs privileges and is not attempted."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return False
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except OSError:
        return False


class Client(ABC):
    """A writer served by a :class:`Background`."""

    priority: int = 1
    """Among the clients ready at once, lower goes first."""

    @abstractmethod
    def due(self, now: float) -> float | None:
        """Called under the background's lock: when this client next has work (``time.monotonic()`` time; ``<=
        now``: now), or ``None`` if it has none until it wakes the thread (:meth:`Background.wake`)."""

    @abstractmethod
    def serve(self, now: float) -> None:
        """Do one unit of the work that is due (outside the lock; never sleeping)."""


class Background:
    """One daemon thread serving every :class:`Client` attached to it.

    Args:
        name: the thread's name.
        nice: nice value for the thread (``None``: the caller's; see :func:`lower_thread_priority`).
    """

    def __init__(self, name: str = "checkpoint-writer", *, nice: int | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if nice is not None and (isinstance(nice, bool) or not isinstance(nice, int) or not -20 <= nice <= 19):
            raise ValueError(f"nice must be None or an int in [-20, 19], got {nice!r}")
        self.name = name
        self.nice = nice
        self.cond = threading.Condition()
        """The lock of the background and of every client attached to it."""
        self._clients: list[Client] = []
        self._serving: Client | None = None
        self._turn = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def clients(self) -> int:
        """How many clients are attached."""
        with self.cond:
            return len(self._clients)

    @property
    def closed(self) -> bool:
        return self._closing

    def attach(self, client: Client) -> None:
        """Serve ``client`` from now on."""
        if not isinstance(client, Client):
            raise TypeError(f"client must be a Client, got {type(client).__name__}")
        with self.cond:
            if self._closing:
                raise RuntimeError(f"background {self.name!r} is closed: cannot attach {client!r}")
            if client not in self._clients:
                self._clients.append(client)
            self.cond.notify_all()

    def detach(self, client: Client, timeout: float | None = None) -> bool:
        """Serve ``client`` no more; wait (up to ``timeout``) until the thread is not serving it. Returns whether
        it is not (``False``: a unit of it still runs, e.g. a write hanging on storage)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            if client in self._clients:
                self._clients.remove(client)
            self.cond.notify_all()
            while self._serving is client and self._thread is not threading.current_thread():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self.cond.wait(remaining)
        return True

    def wake(self) -> None:
        """A client has new work: look again (the clients' own notifications do it too)."""
        with self.cond:
            self.cond.notify_all()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread (the clients should be detached first: what they hold is theirs to finish). Returns
        whether the thread ended within ``timeout``. Idempotent."""
        with self.cond:
            self._closing = True
            self.cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _next(self) -> tuple[Client, float] | None:
        """Under the lock: the client to serve now, waiting for one to be due; ``None`` once closing."""
        while not self._closing:
            now = time.monotonic()
            wake: float | None = None
            best: Client | None = None
            best_at = 0
            count = len(self._clients)
            for k in range(count):
                at = (self._turn + k) % count
                client = self._clients[at]
                try:
                    due = client.due(now)
                except Exception:  # a broken client must not stop the others
                    logger.exception("checkpoint background %s: %r cannot say when it is due", self.name, client)
                    continue
                if due is None:
                    continue
                if due <= now:
                    if best is None or client.priority < best.priority:
                        best, best_at = client, at
                elif wake is None or due < wake:
                    wake = due
            if best is not None:
                self._turn = best_at + 1
                return best, now
            self.cond.wait(None if wake is None else max(0.0, wake - now))
        return None

    def _run(self) -> None:
        if self.nice is not None:
            lower_thread_priority(self.nice)
        while True:
            with self.cond:
                picked = self._next()
                if picked is None:
                    return
                client, now = picked
                self._serving = client
            try:
                client.serve(now)
            except Exception:  # never let the thread die; the clients' handles carry the errors
                logger.exception("checkpoint background %s: unexpected error serving %r", self.name, client)
            finally:
                with self.cond:
                    self._serving = None
                    self.cond.notify_all()

    def __repr__(self) -> str:
        return f"Background({self.name!r}, clients={len(self._clients)})"
