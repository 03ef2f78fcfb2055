"""Logging a run of failures once: a WARNING for the first, DEBUG for the rest, INFO when it ends."""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["Trouble"]

logger = logging.getLogger("pipedream_ft.checkpoint.writer")


class Trouble:
    """A run of failures of one thing (``what``: a part's writes, the commits, a tier), logged once."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None
        self.count = 0

    def fail(self, message: str, *args: Any) -> None:
        self.count += 1
        if self.since is None:
            self.since = time.monotonic()
            logger.warning(
                f"{self.what}: {message}; training goes on; further failures are logged at DEBUG until it works again",
                *args,
            )
        else:
            logger.debug(f"{self.what}: {message}", *args)

    def ok(self, message: str) -> None:
        if self.since is not None:
            logger.info("%s: %s after %.1fs (%d failures)", self.what, message, time.monotonic() - self.since, self.count)
        self.since, self.count = None, 0
