"""Error types of the runtime, and a wrapper that turns them into one clear line and an exit status."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

__all__ = ["EXIT_PREEMPTED", "EXIT_RECOVERY_FAILED", "EXIT_REPLAN", "EXIT_RUNTIME", "EXIT_SETUP", "PipelineError",
           "PipelineSetupError", "exit_on_error", "run_reporting_errors"]


class PipelineError(RuntimeError):
    """Training cannot go on."""


class PipelineSetupError(PipelineError):
    """The pipeline cannot start: the same message is raised on every rank before training begins."""


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

    rank = os.environ.get("RANK", "0")
    try:
        return 0, fn(*args, **kwargs)
    except (PipelineSetupError, PlanError, ProfileError, ShapeMismatchError, CheckpointError) as exc:
        if rank == "0":
            print(f"pipedream-ft: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_SETUP, None
    except (PipelineError, PeerTimeoutError) as exc:
        print(f"pipedream-ft: rank {rank}: {exc}", file=sys.stderr, flush=True)
        if isinstance(exc, Preempted):
            return EXIT_PREEMPTED, None
        if isinstance(exc, RecoveryFailed):
            return EXIT_RECOVERY_FAILED, None
        if isinstance(exc, RePlanned):
            return EXIT_REPLAN, None
        return EXIT_RUNTIME, None


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
