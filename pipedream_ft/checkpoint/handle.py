"""Progress of one save to the durable tier: what the caller holds of a :meth:`~.writer.CheckpointWriter.save`."""

from __future__ import annotations

import threading

__all__ = ["SaveHandle"]


class SaveHandle:
    """Progress of one :meth:`CheckpointWriter.save`.

    The handle is *done* when this writer has finished with the step: its part is durable (or was given up),
    and on the committer the commit record is written (or the commit was given up).
    """

    __slots__ = (
        "step", "snapshot_s", "copied_bytes", "referenced_bytes", "persist_s", "persist_cpu_s", "bytes",
        "commit_s", "error", "committed", "finished_at", "_event",
    )

    def __init__(self, step: int, snapshot_s: float, copied_bytes: int = 0, referenced_bytes: int = 0) -> None:
        self.step: int = step
        """Update number of the checkpoint."""
        self.snapshot_s: float = snapshot_s
        """Seconds :meth:`CheckpointWriter.save` blocked (the snapshot: the time training waited)."""
        self.copied_bytes: int = copied_bytes
        """Bytes of mutable tensors copied by the snapshot."""
        self.referenced_bytes: int = referenced_bytes
        """Bytes of immutable tensors referenced by the snapshot, not copied."""
        self.persist_s: float | None = None
        """Seconds from the persist thread taking the save to the part being durable (``None`` until then)."""
        self.persist_cpu_s: float | None = None
        """CPU seconds the persist thread spent on it (encoding, checksum, writing; not the waits)."""
        self.bytes: int | None = None
        """Size of the part file written."""
        self.commit_s: float | None = None
        """Committer only: seconds from the part being durable to the commit record being written."""
        self.error: BaseException | None = None
        """Why the part was not persisted or the step not committed; ``None`` on success."""
        self.committed: bool | None = None
        """Committer only: whether the step is committed; ``None`` on other writers."""
        self.finished_at: float | None = None
        """Wall-clock time (``time.time()``) the handle became done."""
        self._event = threading.Event()

    @property
    def blocking_s(self) -> float:
        """Same as :attr:`snapshot_s`."""
        return self.snapshot_s

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or ``timeout`` seconds passed; return :meth:`done`. Errors are in :attr:`error`."""
        return self._event.wait(timeout)

    @property
    def ok(self) -> bool:
        """Done without error."""
        return self.done() and self.error is None

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("ok" if self.error is None else f"error={self.error}")
        return f"SaveHandle(step={self.step}, {state})"
