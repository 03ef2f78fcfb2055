"""Observability as hooks: the timeline trace, the metrics records and the progress bar.

Each is a :class:`~pipedream_ft.pipeline.hooks.Hooks` the trainer adds when asked for (``PipelineConfig``
``trace_dir``, ``metrics_dir``, ``progress``); none of them can stop training.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

from ..pipeline.executor import RankStats
from ..pipeline.hooks import Hooks
from ..schedules.actions import COMMUNICATION, Action
from .metrics import MetricsWriter
from .timeline import TimelineRecorder

__all__ = ["TimelineHook", "MetricsHook", "ProgressHook"]


class TimelineHook(Hooks):
    """Records every forward, backward, update, wait and checkpoint in this rank's Perfetto trace."""

    def __init__(self, recorder: TimelineRecorder, replica: int) -> None:
        self.recorder = recorder
        self.replica = replica

    def on_action(self, action: Action) -> None:
        if action.kind in COMMUNICATION:  # compute and updates are recorded with their times, when they end
            self.recorder.instant(f"{action.kind.value}{action.index}", "message", stage=action.stage,
                                  minibatch=action.index)

    def on_forward(self, minibatch: int, start: float, end: float) -> None:
        self.recorder.complete(f"F{minibatch}", "forward", start, end, minibatch=minibatch, replica=self.replica)

    def on_backward(self, minibatch: int, start: float, end: float) -> None:
        self.recorder.complete(f"B{minibatch}", "backward", start, end, minibatch=minibatch, replica=self.replica)

    def on_weight_backward(self, minibatch: int, start: float, end: float) -> None:
        self.recorder.complete(f"W{minibatch}", "weight", start, end, minibatch=minibatch, replica=self.replica)

    def on_update(self, round_: int, done: int, start: float, end: float) -> None:
        self.recorder.complete(f"U{round_}", "update", start, end, round=round_, replica=self.replica)

    def on_wait(self, what: str, minibatch: int, peer: int, start: float, end: float) -> None:
        self.recorder.complete("recv", "wait", start, end, minibatch=minibatch, what=what, peer=peer)

    def on_checkpoint(self, cut: int, start: float, end: float, snapshot_s: float) -> None:
        self.recorder.complete("checkpoint", "checkpoint", start, end, cut=cut, snapshot_s=snapshot_s)

    def on_event(self, name: str, **args: Any) -> None:
        self.recorder.instant(name, "restart" if name == "start" else "event", **args)

    def on_train_end(self, start: int, stop: int) -> None:
        self.recorder.flush()

    def close(self) -> None:
        self.recorder.close()


class MetricsHook(Hooks):
    """One JSON record per update: step time, compute vs waiting, bubble fraction, loss, checkpoint figures."""

    def __init__(self, writer: MetricsWriter, *, rank: int, stage: int, attempt: int, stats: Callable[[], RankStats],
                 last_loss: Callable[[], float | None], extra: Callable[[], dict[str, Any]]) -> None:
        self.writer = writer
        self.rank, self.stage, self.attempt = rank, stage, attempt
        self._stats = stats
        self._last_loss = last_loss
        self._extra = extra
        self._mark: dict[str, float] = {}

    def on_train_start(self, start: int, stop: int) -> None:
        s = self._stats()
        self._mark = {"t": time.perf_counter(), "compute": s.forward_s + s.backward_s + s.update_s, "wait": s.wait_s}

    def on_update(self, round_: int, done: int, start: float, end: float) -> None:
        now = time.perf_counter()
        s = self._stats()
        compute = s.forward_s + s.backward_s + s.update_s
        last = self._mark or {"t": now, "compute": compute, "wait": s.wait_s}
        step_time = max(1e-9, now - last["t"])
        d_compute, d_wait = compute - last["compute"], s.wait_s - last["wait"]
        self._mark = {"t": now, "compute": compute, "wait": s.wait_s}
        record: dict[str, Any] = {
            "rank": self.rank, "stage": self.stage, "attempt": self.attempt, "update": round_,
            "minibatches": done, "time": time.time(), "step_time_s": step_time, "compute_s": d_compute,
            "wait_s": d_wait, "bubble_fraction": max(0.0, 1.0 - d_compute / step_time),
        }
        loss = self._last_loss()
        if loss is not None:
            record["loss"] = loss
        record.update(self._extra())
        self.writer.write(record)

    def on_train_end(self, start: int, stop: int) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ProgressHook(Hooks):
    """The progress bar on rank 0 (only when stderr is a terminal), and the job's progress in the store.

    ``report`` (the last stage's first replica) publishes how far training got, from a background thread ten
    times a second so the training loop never waits on the store; a restarted attempt reads it to say how much
    work it redoes. The bar shows the last loss reported.
    """

    def __init__(self, *, bar: bool, report: Callable[[int, float | None], None] | None,
                 last_loss: Callable[[], float | None], reported_loss: Callable[[], float | None]) -> None:
        self._want_bar = bar
        self._report = report
        self._last_loss = last_loss
        self._reported_loss = reported_loss
        self._bar: Any = None
        self._polled = 0.0
        self._value: int | None = None
        self._loss: float | None = None
        self._sent: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_train_start(self, start: int, stop: int) -> None:
        if self._want_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self._polled = 0.0
            self._bar = tqdm(total=stop, initial=start, unit="mb", desc="training", dynamic_ncols=True, leave=True)

    def on_update(self, round_: int, done: int, start: float, end: float) -> None:
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
            now = time.monotonic()
            if now - self._polled > 0.5:
                self._polled = now
                loss = self._reported_loss()
                if loss is not None:
                    self._bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
        self.report(done)

    def report(self, done: int, force: bool = False) -> None:
        """Publish ``done`` (now if ``force``, else from the background thread)."""
        if self._report is None:
            return
        self._value = done
        self._loss = self._last_loss()
        if force:
            self._push()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pipedream-ft-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self._push()

    def _push(self) -> None:
        with self._lock:
            value = self._value
            if value is None or value == self._sent or self._report is None:
                return
            try:
                self._report(value, self._loss)
                self._sent = value
            except Exception:  # progress is informational only
                pass

    def on_train_end(self, start: int, stop: int) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """Stop the thread (before the store goes away)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
