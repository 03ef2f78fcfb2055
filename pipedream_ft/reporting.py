"""How a process that stops on an error says so: one line, and the exit status the error carries.

Every error type of the library carries its exit status (``exit_code``: :data:`~pipedream_ft.errors.EXIT_SETUP`
for what is the same on every rank, others for runtime failures, see :mod:`pipedream_ft.errors`); the planning
packages' errors (a bad plan or profile) and the job's store or a process group failing (``DistError``) are
mapped here. Set-up errors print the same line on every rank (whichever rank exits first, torchrun's SIGTERM may
end the others before they print), naming the directory of the ranks' tracebacks; runtime failures print from
every rank that sees them, so that torchrun's log names the rank and the operation. Any other exception propagates (:mod:`pipedream_ft.launch` and
:mod:`pipedream_ft.crashlog` report it with its traceback kept in a file).
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Any, Callable

from torch.distributed import DistError

from partitioner.plan import PlanError
from profiler.profile import ProfileError

from .checkpoint import CheckpointError
from .crashlog import keep_traceback, log_dir, tell_torchrun
from .env import DistEnv, read_env, reported_rank
from .errors import EXIT_RUNTIME, EXIT_SETUP, PipelineError, say
from .failfast import die_if_stop_held, failing, stop_held
from .pipeline.comm import PeerTimeoutError, ShapeMismatchError

__all__ = ["exit_code_of", "run_reporting_errors", "exit_on_error"]

_CARRIERS = (PipelineError, CheckpointError, ShapeMismatchError, PeerTimeoutError)
"""The library's error types: each carries its exit status."""
_PLANNING = (PlanError, ProfileError)
"""Errors of the torch-free planning packages: the same on every rank."""


def exit_code_of(exc: BaseException) -> int | None:
    """The exit status ``exc`` stops a process with, or ``None`` if it is not a known error."""
    if isinstance(exc, _CARRIERS):
        return type(exc).exit_code
    if isinstance(exc, _PLANNING):
        return EXIT_SETUP
    if isinstance(exc, DistError):
        return EXIT_RUNTIME
    return None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(exc).__name__


def run_reporting_errors(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """Call ``fn``; return ``(0, its result)``, or ``(exit status, None)`` after printing one line for a known error
    (see the module docstring). Other exceptions propagate."""
    try:
        return 0, fn(*args, **kwargs)
    except BaseException as exc:
        code = exit_code_of(exc)
        if code is None:
            raise
        rank = reported_rank()
        if code == EXIT_SETUP:
            _setup_failed(exc)
        elif isinstance(exc, DistError):  # the job's store or a process group failed (a peer or the agent went)
            say(f"pipedream-ft: rank {rank}: {type(exc).__name__}: {_first_line(exc)}")
        else:
            say(f"pipedream-ft: rank {rank}: {exc}")
        return code, None


def _setup_failed(exc: BaseException) -> None:
    """Every rank says a set-up error's line, the same text (whichever rank torchrun hears of first, its line is
    out before it exits; torchrun's SIGTERM may end the others at any time), naming where the tracebacks are;
    then keeps its traceback there and gives the line to torchrun for its error block."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    try:
        env: DistEnv | None = read_env()
    except Exception:  # reporting an error must not fail on the rest of the environment
        env = None
    line = f"pipedream-ft: error: {text}" + (f" (tracebacks in {log_dir(env)})" if env is not None else "")
    say(line)  # one write to the terminal, before anything that can block
    if env is not None:
        keep_traceback(env, exc)
    tell_torchrun(line)


def exit_on_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; on a known error print one line to stderr and exit non-zero instead of a traceback
    (see :func:`run_reporting_errors`). Either way, the process groups of every open trainer are shut down
    first, so that no backend thread outlives the interpreter.

    A failed process ends fast when told to stop (see :mod:`pipedream_ft.failfast`): from the moment the error
    escapes ``fn``, SIGTERM ends it at once, and a SIGTERM that arrived while it was still training (held for an
    emergency checkpoint) ends it by that signal as soon as its line is out, without the way out."""
    from .trainer import release_all  # the trainer imports most of the library: only when a script ends

    def guarded() -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException:
            failing()  # before the line is out: torchrun's SIGTERM may follow it at once
            raise

    try:
        code, result = run_reporting_errors(guarded)
    except BaseException as exc:  # not a known error: its traceback, which the way out would print, first
        if not isinstance(exc, SystemExit) and stop_held() is not None:
            traceback.print_exception(exc)
            die_if_stop_held()
        release_all()
        raise
    if code:
        die_if_stop_held()
    release_all()
    if code:
        logging.shutdown()
        sys.exit(code)
    return result
