"""Error types of the runtime, and a wrapper that turns them into one clear line and an exit status."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

__all__ = ["EXIT_PREEMPTED", "EXIT_RECOVERY_FAILED", "EXIT_REPLAN", "EXIT_RUNTIME", "EXIT_SETUP", "InvalidArgument",
           "JobError", "PipelineError", "PipelineSetupError", "exit_on_error", "mark_training", "run_reporting_errors",
           "say", "training_begun"]


class PipelineError(RuntimeError):
    """Training cannot go on."""


class PipelineSetupError(PipelineError):
    """The pipeline cannot start: the same message is raised on every rank before training begins."""


class InvalidArgument(PipelineSetupError, ValueError):
    """A bad argument to a public call (e.g. ``trainer.fit``'s ``total``): the same on every rank, so a set-up
    error (one line, :data:`EXIT_SETUP`, never a replacement); still a ``ValueError`` for callers that catch one."""


class JobError(PipelineSetupError):
    """An error found by one rank while training that would happen again after any recovery (a data source
    that ended, a minibatch of the wrong kind): the rank publishes it to the group and every rank stops with
    the same message and :data:`EXIT_SETUP`, instead of recovering from it."""


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


def run_reporting_errors(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """Call ``fn``; return ``(0, its result)``, or ``(exit status, None)`` after printing one line for a known error.

    Set-up errors are the same on every rank, so only rank 0 prints them (:data:`EXIT_SETUP`). Runtime failures
    print on every rank that sees them, so that torchrun's log names the rank and the operation
    (:data:`EXIT_RUNTIME`, :data:`EXIT_PREEMPTED`, :data:`EXIT_RECOVERY_FAILED`). Other exceptions propagate.
    """
    from partitioner.plan import PlanError
    from profiler.profile import ProfileError

    from .checkpoint import CheckpointError
    from .ft.checkpointer import Preempted
    from .ft.recovery import RecoveryFailed
    from .ft.replan import RePlanned
    from .pipeline.comm import PeerTimeoutError, ShapeMismatchError
    from torch.distributed import DistError

    rank = os.environ.get("RANK", "0")
    try:
        return 0, fn(*args, **kwargs)
    except (PipelineSetupError, PlanError, ProfileError, ShapeMismatchError, CheckpointError) as exc:
        if rank == "0":
            say(f"pipedream-ft: error: {exc}")
        return EXIT_SETUP, None
    except (PipelineError, PeerTimeoutError) as exc:
        say(f"pipedream-ft: rank {rank}: {exc}")
        if isinstance(exc, Preempted):
            return EXIT_PREEMPTED, None
        if isinstance(exc, RecoveryFailed):
            return EXIT_RECOVERY_FAILED, None
        if isinstance(exc, RePlanned):
            return EXIT_REPLAN, None
        return EXIT_RUNTIME, None
    except DistError as exc:  # the job's store or a process group failed (a peer or torchrun's agent went away)
        say(f"pipedream-ft: rank {rank}: {type(exc).__name__}: {_first_line(exc)}")
        return EXIT_RUNTIME, None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(exc).__name__


def exit_on_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; on a known error print one line to stderr and exit non-zero instead of a traceback
    (see :func:`run_reporting_errors`). Either way, the process groups of every open trainer are shut down
    first, so that no backend thread outlives the interpreter."""
    from .trainer import release_all

    try:
        code, result = run_reporting_errors(fn, *args, **kwargs)
    finally:
        release_all()
    if code:
        logging.shutdown()
        sys.exit(code)
    return result
