"""Error types of the runtime, each carrying the exit status it ends a process with (the bottom layer: it imports
nothing of the library; :mod:`pipedream_ft.reporting` turns them into one line and that status)."""

from __future__ import annotations

import os
import sys
from typing import Any, ClassVar

__all__ = ["EXIT_PREEMPTED", "EXIT_RECOVERY_FAILED", "EXIT_REPLAN", "EXIT_RUNTIME", "EXIT_SETUP", "InvalidArgument",
           "JobError", "PipelineError", "PipelineSetupError", "mark_training", "say", "training_begun"]

EXIT_RUNTIME = 1
"""Exit status of a runtime failure (a dead or stuck peer, a failed checkpoint, an error in user code)."""
EXIT_SETUP = 2
"""Exit status of a set-up error (a bad plan, profile, model or checkpoint location): the same on every rank."""
EXIT_PREEMPTED = 3
"""Exit status after a preemption notice, once the emergency checkpoint is committed."""
EXIT_RECOVERY_FAILED = 4
"""Exit status when the group could not be formed again in place (a full restart is needed)."""
EXIT_REPLAN = 5
"""Exit status at a re-planning cut: the processes start again on the new plan (see :mod:`pipedream_ft.ft.replan`)."""


class PipelineError(RuntimeError):
    """Training cannot go on."""

    exit_code: ClassVar[int] = EXIT_RUNTIME
    """The status a process that stops on this error exits with; a subclass with :data:`EXIT_SETUP` is the same
    on every rank, and every rank that gets there writes the same line (torchrun may stop the others first)."""


class PipelineSetupError(PipelineError):
    """The pipeline cannot start: the same message is raised on every rank before training begins."""

    exit_code: ClassVar[int] = EXIT_SETUP
    agreed: bool = False
    """Set on one that every rank raised with the same message after agreeing on it (a collective check): the
    group need not be told, and a rank that exits first cannot make another's line differ."""


class InvalidArgument(PipelineSetupError, ValueError):
    """A bad argument to a public call (e.g. ``trainer.fit``'s ``total``): the same on every rank, so a set-up
    error (one line, :data:`EXIT_SETUP`, never a replacement); still a ``ValueError`` for callers that catch one."""


class JobError(PipelineSetupError):
    """An error found by one rank while training that would happen again after any recovery (a data source
    that ended, a minibatch of the wrong kind): the rank publishes it to the group and every rank stops with
    the same message and :data:`EXIT_SETUP`, instead of recovering from it."""


_TRAINING = False


def mark_training() -> None:
    """Called by the trainer when this process starts training: an error from now on is a crash (the process may
    be replaced), not a set-up error (see :mod:`pipedream_ft.crashlog`)."""
    global _TRAINING
    _TRAINING = True


def training_begun() -> bool:
    """Whether this process has started training (:func:`mark_training`)."""
    return _TRAINING


def say(line: str, stream: Any = None) -> None:
    """Write ``line`` and its newline to ``stream`` (default stderr) in one system call, so that the lines of
    ranks sharing one terminal or pipe (torchrun's workers) never interleave within a line."""
    stream = sys.stderr if stream is None else stream
    data = (line + "\n").encode(errors="replace")
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): the stream's own write
        stream.write(line + "\n")
        stream.flush()
        return
    stream.flush()
    while data:
        data = data[os.write(fd, data):]
