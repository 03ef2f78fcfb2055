"""A process whose training failed ends at once when it is told to stop.

While a trainer trains, SIGTERM is a preemption notice: the checkpointer's handler holds it and training takes an
emergency checkpoint (see :class:`~pipedream_ft.policies.PreemptionHandler`). Once the training has failed there is
nothing left to save, and torchrun ending the group (SIGTERM to every surviving worker, right after one died) must
not wait for the way out of a failed process — shutting its process groups down, a garbage collection over the
whole heap, an interpreter shutdown: seconds of CPU on a loaded machine, which delay torchrun's restart by as much,
and an exit status 1 instead of death by the signal. So a failed process:

* :func:`failing` — as soon as the error escapes the training, SIGTERM and SIGINT end it again (their default
  action), whatever handler a trainer installed;
* :func:`die_if_stop_held` — once its one line is out, if a SIGTERM arrived while it was still training (and the
  handler held it), it dies by that signal now, skipping the way out.

:func:`pipedream_ft.launch` (and its supervisor's training processes) and :func:`pipedream_ft.exit_on_error`
(plain scripts) both end this way.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["die_if_stop_held", "failing", "stop_held"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def failing() -> None:
    """The training failed: SIGTERM and SIGINT take their default action (the process ends at once) from now on.
    Only the main thread may change signal handlers; elsewhere this does nothing."""
    for sig in _STOP_SIGNALS:
        try:
            signal.signal(sig, signal.SIG_DFL)
        except ValueError:  # not the main thread
            return


def stop_held() -> int | None:
    """The stop signal a preemption handler of this process holds (it arrived while training), if any."""
    from .trainer import _OPEN  # the trainer imports most of the library: only when a process is failing

    for trainer in list(_OPEN):
        handler = getattr(getattr(trainer, "ckpt", None), "preemption", None)
        if handler is not None and handler.requested:
            return handler.signum or signal.SIGTERM
    return None


def die_if_stop_held() -> None:
    """If a stop signal was held while training, flush the standard streams and die by it now (after
    :func:`failing`, its default action ends the process); otherwise return."""
    signum = stop_held()
    if signum is None:
        return
    failing()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not keep the process alive
            pass
    os.kill(os.getpid(), signum)
    signal.pthread_kill(signal.pthread_self(), signum)  # delivered to this thread, should another one block it
