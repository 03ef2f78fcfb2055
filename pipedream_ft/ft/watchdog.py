"""A per-rank watchdog that turns a hang into a prompt, named failure, and a health file for probes.

The training loop calls :meth:`Watchdog.beat` with what it is about to do ("waiting for the gradient of
minibatch 12 from rank 3"). If no beat comes for ``timeout_s``, the watchdog prints that description and ends
the process with a non-zero status, so torchrun restarts the group instead of waiting forever on a stopped
peer, a partitioned network or a stuck collective.

With a health file (``PipelineConfig.health_file``, or the ``PIPEDREAM_FT_HEALTH_FILE`` environment variable)
each beat also refreshes that file, so a Kubernetes liveness probe can restart a pod whose file goes stale.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from ..errors import say
from ..pipeline.hooks import Hooks
from ..schedules.actions import Action

__all__ = ["Watchdog", "WatchdogHook", "WATCHDOG_EXIT_CODE"]

WATCHDOG_EXIT_CODE = 70


class Watchdog:
    """Fails the process if :meth:`beat` is not called for ``timeout_s`` seconds while armed."""

    def __init__(self, timeout_s: float, *, rank: int = 0,
                 on_timeout: Callable[[str], None] | None = None, health_file: str | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.rank = rank
        self._on_timeout = on_timeout or self._exit
        self._what: str | Action = "starting"
        self._last = time.monotonic()
        self._armed = False
        self.health_file = health_file
        """Touched at most once a second while the rank makes progress: a liveness probe can check its age."""
        self._touched = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipedream-ft-watchdog", daemon=True)
        self._thread.start()

    def beat(self, what: str | Action) -> None:
        """Progress: the rank is now ``what`` (an action: running it; words are made only when they are read)."""
        self._what = what
        self._last = time.monotonic()
        if self.health_file is not None and self._last - self._touched > 1.0:
            self._touched = self._last
            try:
                with open(self.health_file, "w") as f:
                    f.write(f"{time.time():.0f} {self.doing}\n")
            except OSError:
                pass

    @property
    def doing(self) -> str:
        """What the rank was last doing, in words."""
        what = self._what
        return what if isinstance(what, str) else f"running {what} on stage {what.stage}"

    def arm(self) -> None:
        self._last = time.monotonic()
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            if self._armed and time.monotonic() - self._last > self.timeout_s:
                self._armed = False
                self._on_timeout(f"no progress for {self.timeout_s:g}s while {self.doing}")

    def _exit(self, message: str) -> None:
        say(f"pipedream-ft: rank {self.rank}: watchdog: {message}; exiting so the group restarts")
        os._exit(WATCHDOG_EXIT_CODE)


class WatchdogHook(Hooks):
    """Arms the watchdog while a run of minibatches trains and beats it before every action."""

    def __init__(self, watchdog: Watchdog, stage: int) -> None:
        self.watchdog = watchdog
        self.stage = stage

    def on_train_start(self, start: int, stop: int) -> None:
        self.watchdog.arm()

    def on_action(self, action: Action) -> None:
        self.watchdog.beat(action)

    def on_event(self, name: str, **args: Any) -> None:
        if name == "draining":
            self.watchdog.beat("waiting for the last sends")
        elif name == "gathering":  # a collective, bounded by the group's timeout
            self.watchdog.beat("gathering the losses")
        elif name == "finishing":  # waits for storage, bounded by the commit timeout (longer than the watchdog's)
            self.watchdog.beat("waiting for the last checkpoints to commit")
            self.watchdog.disarm()
        elif name == "failure":  # the recovery has its own deadline
            self.watchdog.disarm()
        elif name == "recovered":
            self.watchdog.arm()

    def on_train_end(self, start: int, stop: int) -> None:
        self.watchdog.disarm()

    def close(self) -> None:
        self.watchdog.close()
