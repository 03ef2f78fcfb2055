"""Error types of the runtime, and a wrapper that turns them into one clear line and an exit status."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

__all__ = ["PipelineError", "PipelineSetupError", "exit_on_error"]


class PipelineError(RuntimeError):
    """Training cannot go on."""


class PipelineSetupError(PipelineError):
    """The pipeline cannot start: the same message is raised on every rank before training begins."""


def exit_on_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; on a known error print one line to stderr and exit non-zero instead of a traceback.

    Set-up errors (a bad plan, profile or checkpoint location) are the same on every rank, so only rank 0
    prints them (exit status 2). Runtime failures
    (a dead or stuck peer, a failed checkpoint) print on every rank that sees them (exit status 1), so that
    torchrun's log names the rank and the operation.
    """
    from partitioner.plan import PlanError
    from profiler.profile import ProfileError

    from .checkpoint import CheckpointError
    from .pipeline.comm import PeerTimeoutError, ShapeMismatchError

    rank = os.environ.get("RANK", "0")
    try:
        return fn(*args, **kwargs)
    except (PipelineSetupError, PlanError, ProfileError, ShapeMismatchError, CheckpointError) as exc:
        if rank == "0":
            print(f"pipedream-ft: error: {exc}", file=sys.stderr, flush=True)
        logging.shutdown()
        sys.exit(2)
    except (PipelineError, PeerTimeoutError) as exc:
        print(f"pipedream-ft: rank {rank}: {exc}", file=sys.stderr, flush=True)
        logging.shutdown()
        sys.exit(1)
