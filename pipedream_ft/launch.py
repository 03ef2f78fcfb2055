"""The one call a training script ends with: ``pipedream_ft.launch(main)``.

It runs ``main`` as this rank's training and exits the process with a meaningful status:

* known errors print one line (set-up errors the same on every rank; runtime failures from every rank that sees them)
  instead of a traceback per rank;
* every trainer's process groups are shut down before the interpreter exits, so no backend thread can abort
  a finished run;
* under torchrun (``recovery="in-place"``, the default there) the rank runs under a
  :class:`~pipedream_ft.ft.supervisor.Supervisor`: a training process that dies is replaced by a fresh one
  forked from the supervisor, with torch already imported, and the surviving ranks keep their processes and
  memory (see :mod:`pipedream_ft.ft.recovery`). ``recovery="restart"`` leaves failures to torchrun, which
  restarts every process.

Any other exception that escapes ``main`` prints one line too, naming the error, where it was raised and the
per-rank log file that holds its full traceback (``$PIPEDREAM_FT_LOG_DIR``, default
``./pipedream-ft-logs/<run id>``); raised before training started, or raised again at the same place by the
rank's next process, it stops the job with exit status 2 instead of a replacement loop (see
:mod:`pipedream_ft.crashlog`).

Launch with ``torchrun --nproc-per-node N [--max-restarts R] script.py``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from typing import Any, Callable, NoReturn

from .crashlog import crashed
from .env import hand_over, read_env, requested_recovery
from .errors import EXIT_RUNTIME, EXIT_SETUP
from .failfast import die_if_stop_held, failing
from .reporting import run_reporting_errors

__all__ = ["RECOVERY_MODES", "launch"]

RECOVERY_MODES = ("in-place", "restart")


def launch(main: Callable[..., Any], *args: Any, recovery: str | None = None, max_replacements: int = 16,
           **kwargs: Any) -> NoReturn:
    """Run ``main(*args, **kwargs)`` as this rank's training and exit (see the module docstring).

    ``recovery``: ``"in-place"`` or ``"restart"``; default ``$PIPEDREAM_FT_RECOVERY``, else ``"in-place"`` under
    torchrun (whose agent hosts the job's store, which must outlive any one worker) and ``"restart"`` otherwise.
    ``max_replacements``: how many times a rank's process may be replaced in place before the failure is left
    to torchrun.
    """
    env = read_env()
    mode = recovery or requested_recovery() or ("in-place" if env.use_agent_store else "restart")
    if mode not in RECOVERY_MODES:
        raise ValueError(f"recovery must be one of {RECOVERY_MODES}, got {mode!r}")
    if mode == "in-place" and not (env.use_agent_store and hasattr(os, "fork")):
        logging.getLogger(__name__).warning(
            "in-place recovery needs torchrun's agent to host the job's store (and fork); failures restart the group")
        mode = "restart"

    def train() -> int:
        from .ft.coordination import stop_job, stopped_job
        from .trainer import release_all

        mine = read_env()  # as the supervisor handed it to this process
        if stopped_job(mine) is not None:  # an earlier attempt stopped on an error that would recur: its line is out
            return EXIT_SETUP
        def guarded() -> Any:
            try:
                return main(*args, **kwargs)
            except BaseException:
                failing()  # before the failure's line is out: torchrun's SIGTERM may follow it at once
                raise

        code = EXIT_RUNTIME
        try:
            code, _ = run_reporting_errors(guarded)
            if code == EXIT_SETUP:
                stop_job(mine, "a set-up error")
        except Exception as exc:  # not a known error: one line, the traceback to a file, no replacement loop
            code = crashed(mine, exc)
        finally:
            if code != 0:
                failing()
                die_if_stop_held()  # the SIGTERM came while this process was failing: it was held, go now
            release_all()
        if code in (0, EXIT_SETUP):  # the job is over for good: its memory-tier parts would only fill RAM
            from .checkpoint.shm import leave_all

            leave_all()
        return code

    if mode == "in-place":
        from .ft.supervisor import Supervisor

        supervisor = Supervisor(env, max_replacements=max_replacements)
        code = supervisor.run(train)
    else:
        hand_over(replace(env, recovery="restart"))
        code = train()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if mode == "in-place" and supervisor.terminating is not None:
        os._exit(code)  # torchrun is ending the group: its training process is gone, nothing is left to wait for
    sys.exit(code)
