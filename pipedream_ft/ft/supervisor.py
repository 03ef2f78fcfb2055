"""A rank's supervisor: replaces the rank's training process when it dies, so the other ranks need not restart.

Under torchrun, the worker process of a rank becomes its supervisor (:func:`pipedream_ft.launch`): once the
script's module-level code has run (``import torch`` and the rest, the slow part of starting a process), it
forks the process that trains and waits for it. When that process dies — killed, crashed, or evicted by the
others because it stopped answering — the supervisor counts the failure in the job's store (the other ranks
notice it at once) and forks a replacement, which joins the running group and restores the newest checkpoint
every rank has (see :mod:`pipedream_ft.ft.recovery`). torchrun sees none of this: its ``--max-restarts`` stay
for failures the group cannot recover from in place (a lost machine, a failed recovery), which end every
process and restart them all, as without a supervisor.

The training process dies with its supervisor (``PR_SET_PDEATHSIG``). When torchrun ends the worker group
(SIGTERM: another rank's supervisor died, as an OOM killer or a lost container would do it), a supervisor whose
group is recovering kills its training process at once — the group cannot form again without the lost rank,
and the process's memory-tier parts stay on the node for torchrun's next attempt; a supervisor whose group is
training passes the signal on (a preemption notice: an emergency checkpoint), and still kills the process
as soon as the group turns out to be recovering. Each supervisor has an id of its own, which its processes
publish their group under (see :mod:`pipedream_ft.ft.coordination`): a supervisor of a later attempt never
acts on an earlier attempt's keys. Exit statuses of the training process:
``0`` done; ``2`` a set-up error, the same on every rank (not replaced); ``4`` the recovery failed (not
replaced: the whole group restarts); ``5`` a re-planning cut (every rank's process starts afresh on the new
plan); anything else, or a signal, is replaced (at most ``max_replacements`` times).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import replace
from types import FrameType
from typing import Callable

from ..env import DistEnv, hand_over
from ..errors import EXIT_RECOVERY_FAILED, EXIT_REPLAN, EXIT_SETUP, say
from .coordination import FORMED, Coordinator, LiveGroup, base_store

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: the calling process gets SIGKILL when its parent (the supervisor) dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # not Linux: the child outlives a killed supervisor until torchrun ends it
        pass


class Supervisor:
    """Forks the rank's training process and replaces it when it dies (see the module docstring)."""

    def __init__(self, env: DistEnv, *, max_replacements: int = 16, poll_s: float = 0.02,
                 timeout_s: float = 60.0) -> None:
        if max_replacements < 0:
            raise ValueError(f"max_replacements must be >= 0, got {max_replacements}")
        self.env = env
        self.max_replacements = max_replacements
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.id = uuid.uuid4().hex[:16]
        """This supervisor's id: its processes publish their group's round under it."""
        self.terminating: int | None = None
        """The signal that asked this rank to stop (SIGTERM from torchrun or the machine), if any."""
        self._child: int | None = None
        self._live: LiveGroup | None = None

    def run(self, train: Callable[[], int]) -> int:
        """Run ``train`` (returns an exit status) in a child process, replacing it when it dies; returns the
        status to exit with."""
        _warm_up()
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            incarnation = 0
            fresh = False
            while True:
                pid = self._spawn(train, incarnation, fresh)
                fresh = False
                code = self._watch(pid, incarnation)
                if code == 0 or self.terminating is not None or code in (EXIT_SETUP, EXIT_RECOVERY_FAILED):
                    return code if code >= 0 else 128 - code
                if code == EXIT_REPLAN:  # every rank stopped at a re-planning cut: start afresh on the new plan
                    self._live = None
                    fresh = True
                    continue
                live = self._live_group()
                if live is None:
                    say(f"pipedream-ft: rank {self.env.rank}: the training process died ({_describe(code)}) before "
                        "joining its group; a full restart is needed")
                    return code if code > 0 else 128 - code
                if incarnation >= self.max_replacements:
                    say(f"pipedream-ft: rank {self.env.rank}: the training process died ({_describe(code)}) and "
                        f"{self.max_replacements} replacements are used up")
                    return code if code > 0 else 128 - code
                try:
                    live.report_failure(live.epoch_of(self.env.rank))
                    live.announce_replacement(self.env.rank, incarnation + 1)
                except Exception as exc:  # the job's store is gone: torchrun's agent is ending the job
                    say(f"pipedream-ft: rank {self.env.rank}: the training process died ({_describe(code)}) and the "
                        f"job's store cannot be reached ({type(exc).__name__}); a full restart is needed")
                    return code if code > 0 else 128 - code
                incarnation += 1
                say(f"pipedream-ft: rank {self.env.rank}: training process died ({_describe(code)}); starting "
                    f"replacement {incarnation}")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # -- children -------------------------------------------------------------------------------------------

    def _spawn(self, train: Callable[[], int], incarnation: int, fresh: bool = False) -> int:
        """Fork the training process; a replacement (``incarnation > 0``) joins the running group unless
        ``fresh`` (every rank starts again, as after a re-planning cut)."""
        live = self._live_group() if incarnation and not fresh else None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            self._child = pid
            return pid
        code = 1
        try:  # the training process
            _die_with_parent()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            hand_over(replace(self.env, recovery="in-place", incarnation=incarnation, supervisor=self.id,
                              live_round=live.round_id if live is not None else None))
            code = train()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # the last resort: report and die like any crashed process
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def _watch(self, pid: int, incarnation: int) -> int:
        """Wait for the child; kill it if the group evicted it, or if this rank must stop while its group is
        recovering (see the module docstring). Returns its exit status (``-N``: signal N)."""
        next_check = time.monotonic()
        forwarded = killed = False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self._child = None
                return os.waitstatus_to_exitcode(status)
            now = time.monotonic()
            if self.terminating is not None and not killed and (not forwarded or now >= next_check):
                next_check = now + 0.05
                if self._recovering():
                    log.info("rank %d: stopping while the group recovers: ending the training process now",
                             self.env.rank)
                    os.kill(pid, signal.SIGKILL)
                    killed = True
                elif not forwarded:  # a preemption notice: the training process takes an emergency checkpoint
                    os.kill(pid, self.terminating)
                forwarded = True
            elif now >= next_check and self.terminating is None:
                next_check = now + 0.1
                live = self._live_group()
                if live is not None:
                    try:
                        evicted = live.evicted(self.env.rank) == incarnation
                    except Exception:  # the store is gone: torchrun is ending the job
                        evicted = False
                    if evicted:
                        log.warning("rank %d: the group evicted process %d (it stopped answering); killing it",
                                    self.env.rank, incarnation)
                        os.kill(pid, signal.SIGKILL)
            time.sleep(self.poll_s)

    def _live_group(self) -> LiveGroup | None:
        """The in-place group this rank's processes run in, once the first one has published it."""
        if self._live is None:
            try:
                base = base_store(self.env, self.timeout_s)
                round_id = LiveGroup.published_round(base, self.env.run_id, self.env.rank, self.id)
                if round_id is not None:  # the job's secret verifies the group's eviction records
                    key = Coordinator(self.env, self.timeout_s).secret()
            except Exception:  # no store yet or any more
                return None
            if round_id is not None:
                self._live = LiveGroup(base, self.env.run_id, round_id, key=key)
        return self._live

    def _recovering(self) -> bool:
        """Whether this rank's group is forming again after a failure (or not formed yet, or its store is gone):
        then nothing is left to save and the training process can go at once."""
        live = self._live_group()
        if live is None:
            return True
        try:
            failures = live.failures()
            return failures > 0 and live.decision(failures) != FORMED
        except Exception:  # the store is gone: torchrun is ending the job
            return True

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM/SIGINT to the supervisor: the training process stops (see :meth:`_watch`), and so does this
        rank. Only a flag here: store calls from a signal handler could interleave with the loop's own."""
        self.terminating = signum


def _warm_up() -> None:
    """Import, once, what every training process would otherwise import on its own: building the first torch
    optimizer imports ``torch._dynamo`` (about a second). Nothing here starts a thread (forking after autograd or
    the intra-op pool has started would not be safe)."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"
