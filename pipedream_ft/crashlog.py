"""What an unexpected error in a training process leaves behind, and whether the job should go on after it.

An error the runtime knows (:mod:`pipedream_ft.errors`) prints its one line. Any other exception — a bug in the
training script, a ``ValueError`` deep in user code — used to print a full traceback on every rank and be
treated as a crash: the process was replaced (or torchrun restarted the group), met the same error again, and
so on until the replacements ran out. Now, under :func:`pipedream_ft.launch`:

* the full traceback goes to a per-rank log file, ``$PIPEDREAM_FT_LOG_DIR`` (default
  ``./pipedream-ft-logs/<torchrun run id>``) ``/rank<R>-attempt<A>-process<I>.log``, and the rank prints one
  line naming the error, where it was raised and that file;
* an error raised before the process started training (its first ``trainer.fit``/``train``), in the job's first
  processes, is a set-up error: exit status 2 (:data:`~pipedream_ft.errors.EXIT_SETUP`), the job stops;
* an error raised while training is a crash the first time (the process is replaced, or the group restarted),
  but if the same rank's next process raises the same exception type from the same place (file, line and
  function of the raising frame), it will recur: the job stops with exit status 2 instead of looping.

A job stopped this way records its line in the job's store (:func:`~pipedream_ft.ft.coordination.stop_job`), so
that the processes of any later torchrun attempt (``--max-restarts``) exit at once with status 2 instead of
training again; an attempt with another world size (an elastic resize) is not stopped by it.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from .env import DistEnv
from .errors import EXIT_RUNTIME, EXIT_SETUP, say, training_begun

__all__ = ["crashed", "keep_traceback", "log_dir", "log_path", "signature", "tell_torchrun"]


def log_dir(env: DistEnv) -> Path:
    """The directory of every rank's traceback files (see the module docstring): the same on every rank."""
    return Path(env.log_dir) if env.log_dir else Path.cwd() / "pipedream-ft-logs" / env.run_id


def log_path(env: DistEnv) -> Path:
    """Where this process writes the traceback of an unexpected error (see the module docstring)."""
    return log_dir(env) / f"rank{env.rank}-attempt{env.restart_count}-process{env.incarnation}.log"


def keep_traceback(env: DistEnv, exc: BaseException) -> bool:
    """Append ``exc``'s traceback to :func:`log_path` (a set-up error's line names the directory); ``False`` if
    it could not be written."""
    return _write(log_path(env), exc).startswith("full traceback")


def tell_torchrun(line: str) -> None:
    """Give torchrun this process's error ``line`` (its ``TORCHELASTIC_ERROR_FILE``, unless something wrote one
    already), so that its ``ChildFailedError`` block shows the line instead of a link to its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            # the format torchrun's own @record writes; its block shows py_callstack: the line, not a traceback
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
        os.replace(tmp, path)
    except OSError:  # the line is out on stderr already
        pass


def signature(exc: BaseException) -> str:
    """The exception's type and the place that raised it (file, line, function of the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "unknown place"
    return f"{type(exc).__module__}.{type(exc).__qualname__} at {where}"


def _write(path: Path, exc: BaseException) -> str:
    """Append the traceback to ``path``; returns how the one line names the file (or why there is none)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n")
            f.write("".join(traceback.format_exception(exc)))
        return f"full traceback in {path}"
    except OSError as err:  # an unwritable log directory must not hide the error itself
        return f"(the traceback could not be written to {path}: {err.strerror})"


def crashed(env: DistEnv, exc: Exception) -> int:
    """Report ``exc``, which escaped the training script: write its traceback to :func:`log_path`, print one line,
    and return the exit status: :data:`EXIT_SETUP` (the job stops) for an error before training in the job's
    first processes or one that recurs at the same place, :data:`EXIT_RUNTIME` (a crash) otherwise."""
    from .ft.coordination import previous_crash, record_crash, stop_job

    where = _write(log_path(env), exc)
    text = " ".join(str(exc).split()) or "(no message)"
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    head = f"pipedream-ft: rank {env.rank}: {type(exc).__name__}: {text}{at}"
    first = env.restart_count == 0 and env.incarnation == 0
    if not training_begun() and first:
        line = f"{head} (before training started: the job stops); {where}"
        say(line)
        tell_torchrun(line)
        stop_job(env, line)
        return EXIT_SETUP
    sig = signature(exc)
    if previous_crash(env) == sig:
        line = f"{head}, the same error at the same place as this rank's previous process: it recurs, the job " \
               f"stops; {where}"
        say(line)
        tell_torchrun(line)
        stop_job(env, line)
        return EXIT_SETUP
    record_crash(env, sig)
    say(f"{head}; {where}")
    return EXIT_RUNTIME
