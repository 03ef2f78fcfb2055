"""A deterministic fault injector, for tests and drills.

Faults are given in code or in the environment variable ``PIPEDREAM_FT_FAULTS``, ``;``-separated::

    PIPEDREAM_FT_FAULTS="kill@rank=1,step=20;exception@rank=2,step=35,attempt=1"

Each fault fires once, on ``rank``, when that rank starts the forward of minibatch ``step``, during attempt
``attempt`` (default 0) of the group: torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``), plus, with
in-place recovery, the number of times the group was formed again — so a restarted or recovered run is not hit
again unless asked to be (two failures in a row: a second fault with ``attempt=1``).

Faults that share a ``together=NAME`` tag fire at once: each rank that reaches its fault waits (in the job's store)
until every fault of the tag has been reached, then they all fire — two machines lost in the same instant, which
no choice of steps can arrange otherwise (a rank that notices the first loss recovers before it reaches its own
step). Only the faults fired as a rank starts a forward (``kill`` to ``supervisor`` below) take a tag, and a tag's
faults must be reachable while the first to arrive waits (each at a step its rank can reach without it). Kinds:

``kill``        SIGKILL itself (a machine fault)
``exception``   raise :class:`InjectedFault` in the training loop (a runtime error in user code)
``hang``        SIGSTOP itself (a hung peer or a network partition; the others' watchdogs must notice)
``term``        SIGTERM itself (a preemption notice: an emergency checkpoint, then exit)
``supervisor``  SIGKILL its supervisor, the torchrun worker process (as an OOM killer would; under
                :func:`pipedream_ft.launch`'s in-place recovery only): it dies with it, torchrun restarts the group
``ckpt_crash``  die (SIGKILL) while writing its part of the first checkpoint at or after ``step``
``corrupt``     at a save after checkpoint ``step`` has committed, flip a byte in its part of the newest
                committed checkpoint, then die
``rejoin``      die (SIGKILL) right after joining an in-place recovery of attempt ``attempt`` (a failure while
                the group forms again; ``step`` is ignored)
``connect``     die (SIGKILL) as the groups of an in-place recovery of attempt ``attempt`` are about to connect
                (every rank restored the cut; the others wait for this one's address; ``step`` is ignored)
``drained``     die (SIGKILL) once the rank has run the last action of a ``train`` call, before the call's closing
                gather of the losses (the ranks that finished first wait there; ``step`` is ignored)
``finishing``   die (SIGKILL) at the end of a ``fit``, once every rank has gathered the call's losses and is
                finishing the last checkpoint (this rank's part of it may still be being written; the others wait
                for the commit; ``step`` is ignored)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from ..env import read_env, setting
from ..errors import say
from ..pipeline.hooks import Hooks
from ..schedules.actions import Action

__all__ = ["KINDS", "Fault", "InjectedFault", "FaultInjector", "parse_faults"]

KINDS = ("kill", "exception", "hang", "term", "supervisor", "ckpt_crash", "corrupt", "rejoin", "connect",
         "drained", "finishing")
AT_FORWARD = ("kill", "exception", "hang", "term", "supervisor")
"""The kinds fired as a rank starts a forward: the only ones a ``together`` tag may join."""
ENV_VAR = "PIPEDREAM_FT_FAULTS"
TOGETHER_WAIT_S = 120.0
"""How long a tagged fault waits for the rest of its tag before the drill is called misconfigured."""


class InjectedFault(RuntimeError):
    """The ``exception`` fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    rank: int
    step: int
    attempt: int = 0
    together: str = ""
    """A tag: the faults that share it fire at once (see the module docstring); empty: alone."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if self.rank < 0 or self.step < 0 or self.attempt < 0:
            raise ValueError(f"fault rank, step and attempt must be >= 0, got {self}")
        if self.together and self.kind not in AT_FORWARD:
            raise ValueError(f"fault {self}: only the kinds {AT_FORWARD} take together=, got {self.kind!r}")
        if self.together and not self.together.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"fault {self}: together= must be letters, digits, '-' or '_', got {self.together!r}")

    def __str__(self) -> str:
        tag = f",together={self.together}" if self.together else ""
        return f"{self.kind}@rank={self.rank},step={self.step},attempt={self.attempt}{tag}"


def parse_faults(text: str) -> list[Fault]:
    """Parse ``kind@rank=R,step=S[,attempt=A][,together=NAME];...``."""
    faults = []
    for item in filter(None, (p.strip() for p in text.split(";"))):
        kind, sep, rest = item.partition("@")
        if not sep:
            raise ValueError(f"fault {item!r} must look like kind@rank=R,step=S[,attempt=A][,together=NAME]")
        fields: dict[str, Any] = {}
        for kv in rest.split(","):
            key, eq, value = kv.strip().partition("=")
            if not eq or key not in ("rank", "step", "attempt", "together"):
                raise ValueError(f"fault {item!r}: unknown field {kv.strip()!r}")
            if key == "together":
                fields[key] = value.strip()
                continue
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"fault {item!r}: {key} must be an integer, got {value!r}") from None
        if "rank" not in fields or "step" not in fields:
            raise ValueError(f"fault {item!r} needs rank= and step=")
        faults.append(Fault(kind.strip(), **fields))
    tags = Counter((f.together, f.attempt) for f in faults if f.together)
    alone = sorted(tag for (tag, _), n in tags.items() if n < 2)
    if alone:
        raise ValueError(f"faults tagged together={alone[0]!r} need at least two faults of one attempt to fire "
                         f"together, got one")
    return faults


class FaultInjector(Hooks):
    """Fires the faults meant for this rank and attempt (a hook: the training loop knows nothing of it)."""

    def __init__(self, faults: list[Fault], *, rank: int, attempt: int,
                 connect: Callable[[], Any] | None = None, key_prefix: str = "pipedream-ft/faults") -> None:
        """``connect`` opens a connection to the job's store, where faults tagged ``together`` meet (needed only
        when some are); ``key_prefix`` names this job's keys there."""
        self._mine = [f for f in faults if f.rank == rank]
        self._tag_sizes = Counter((f.together, f.attempt) for f in faults if f.together)
        self._finishing = {f.attempt for f in faults if f.kind == "finishing"}
        """The attempts in which some rank's ``finishing`` fault waits for every rank to check in."""
        if any(f.together for f in self._mine) and connect is None:
            raise ValueError(f"rank {rank}: faults tagged together= need the job's store (connect=), got none")
        if self._finishing and connect is None:
            raise ValueError(f"rank {rank}: a finishing fault needs the job's store (connect=), got none")
        self._connect = connect
        self._key_prefix = key_prefix
        self.rank = rank
        self.faults: list[Fault] = []
        self.set_attempt(attempt)

    def set_attempt(self, attempt: int) -> None:
        """Arm the faults of ``attempt``: the group's restart count plus, with in-place recovery, the number of
        times the group was formed again (so a fault hits the attempt it names, whichever process runs it)."""
        self.attempt = attempt
        self.faults = [f for f in self._mine if f.attempt == attempt]

    @staticmethod
    def from_env(*, rank: int, attempt: int, environ: dict[str, str] | None = None,
                 connect: Callable[[], Any] | None = None, key_prefix: str = "pipedream-ft/faults"
                 ) -> FaultInjector:
        return FaultInjector(parse_faults(setting(ENV_VAR, environ) or ""), rank=rank, attempt=attempt, connect=connect,
                             key_prefix=key_prefix)

    def __bool__(self) -> bool:
        """Whether any fault is meant for this rank (in any attempt)."""
        return bool(self._mine)

    def _take(self, kinds: tuple[str, ...], step: int) -> Fault | None:
        for f in self.faults:
            if f.kind in kinds and step >= f.step:
                self.faults.remove(f)
                return f
        return None

    def on_action(self, action: Action) -> None:
        if action.kind == "F" and self.faults:
            self.at_forward(action.index)

    def at_forward(self, step: int) -> None:
        """Called as the rank starts the forward of minibatch ``step``."""
        f = self._take(AT_FORWARD, step)
        if f is None:
            return
        if f.together:
            self._meet(f)
        say(f"pipedream-ft: rank {self.rank}: injecting fault {f}", sys.stdout)
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "exception":
            raise InjectedFault(f"injected fault {f}")
        elif f.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "supervisor":
            if not read_env().supervisor:
                raise InjectedFault(f"{f}: this process has no supervisor (in-place recovery under launch only)")
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(60)  # this process dies with its supervisor (PR_SET_PDEATHSIG)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def _meet(self, fault: Fault) -> None:
        """Wait until every fault tagged like ``fault`` (in its attempt) has been reached by its rank."""
        size = self._tag_sizes[(fault.together, fault.attempt)]
        arrived = self._arrive(f"{fault.attempt}/{fault.together}", size, wait=True)
        if arrived < size:
            raise InjectedFault(f"fault {fault}: {arrived} of the {size} faults tagged together="
                                f"{fault.together} were reached within {TOGETHER_WAIT_S:.0f}s: a tagged fault "
                                f"must be at a step its rank reaches while the others wait")

    def _arrive(self, name: str, size: int, *, wait: bool, poll_s: float = 0.002) -> int:
        """Check in at the meeting point ``name`` of this job's store; with ``wait``, until ``size`` have (at most
        :data:`TOGETHER_WAIT_S`). Returns how many have."""
        assert self._connect is not None
        key = f"{self._key_prefix}/{name}"
        store = self._connect()
        arrived = store.add(key, 1)
        deadline = time.monotonic() + TOGETHER_WAIT_S
        while wait and arrived < size and time.monotonic() <= deadline:
            time.sleep(poll_s)
            arrived = store.add(key, 0)
        return arrived

    def at_finishing(self, world_size: int) -> None:
        """Called as the rank starts finishing the last checkpoint of a ``fit``, the call's losses gathered. When
        some rank's ``finishing`` fault is armed in this attempt every rank checks in, and that rank dies once all
        ``world_size`` have."""
        if self.attempt not in self._finishing:
            return
        f = next((f for f in self.faults if f.kind == "finishing"), None)
        arrived = self._arrive(f"{self.attempt}/finishing", world_size, wait=f is not None)
        if f is None:
            return
        if arrived < world_size:
            raise InjectedFault(f"fault {f}: {arrived} of the {world_size} ranks began finishing within "
                                f"{TOGETHER_WAIT_S:.0f}s")
        self.faults.remove(f)
        say(f"pipedream-ft: rank {self.rank}: injecting fault {f}", sys.stdout)
        os.kill(os.getpid(), signal.SIGKILL)

    def at_drained(self) -> None:
        """Called as the rank has run the last action of a ``train`` call (``drained``)."""
        f = next((f for f in self.faults if f.kind == "drained"), None)
        if f is not None:
            self.faults.remove(f)
            say(f"pipedream-ft: rank {self.rank}: injecting fault {f}", sys.stdout)
            os.kill(os.getpid(), signal.SIGKILL)

    @property
    def checkpoint_faults(self) -> bool:
        """Whether any fault acts through the checkpointer's seams (:meth:`before_part_write`,
        :meth:`before_save`)."""
        return any(f.kind in ("ckpt_crash", "corrupt") for f in self._mine)

    def before_save(self, checkpointer: Any, cut: int) -> None:
        """The checkpointer's seam before each save of ``cut``: a ``corrupt`` fault acts here."""
        self._corrupt_before(checkpointer, cut)

    def _corrupt_before(self, ckpt: Any, cut: int) -> None:
        """``corrupt``: at a save after checkpoint ``step``, damage this rank's part of the newest committed
        checkpoint (the one it saved last, once committed) and die, before this save can commit — so the damaged
        checkpoint is the one a restart finds first."""
        from ..checkpoint import list_committed
        from ..checkpoint.format import part_data_path

        if not any(f.kind == "corrupt" and f.step < cut for f in self.faults):
            return
        newest = ckpt.last_saved
        deadline = time.monotonic() + 5.0
        while newest not in list_committed(ckpt.storage):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

        def damage() -> None:
            rel = part_data_path(newest, ckpt.part)
            data = bytearray(ckpt.storage.read_bytes(rel))
            data[len(data) // 2] ^= 0xFF
            ckpt.storage.write_bytes(rel, bytes(data))

        self.after_commit(newest, damage)

    def at_join(self, attempt: int, kind: str = "rejoin") -> None:
        """Called right after this rank joined the in-place recovery that starts ``attempt`` (``rejoin``), and
        as its groups are about to connect (``connect``)."""
        f = next((f for f in self._mine if f.kind == kind and f.attempt == attempt), None)
        if f is not None:
            self._mine.remove(f)
            say(f"pipedream-ft: rank {self.rank}: injecting fault {f}", sys.stdout)
            os.kill(os.getpid(), signal.SIGKILL)

    def before_part_write(self, storage: Any, rel: str, data: Any) -> None:
        """The storage's seam before each write (``Storage(before_write=...)``): a ``ckpt_crash`` fault kills the
        rank mid-write of its part, leaving half of it behind."""
        step = _step_of(rel)
        # the faults armed now: a replacement process (in place) is started at attempt 0 and armed for its own
        # attempt once the group is formed, before it writes anything
        if step is not None and rel.endswith(".pt") and self._take(("ckpt_crash",), step) is not None:
            say(f"pipedream-ft: rank {self.rank}: injecting fault ckpt_crash while writing {rel}", sys.stdout)
            storage.write_bytes(rel + ".partial", data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

    def after_commit(self, step: int, corrupt: Callable[[], None]) -> None:
        """Called once checkpoint ``step`` is known committed; a ``corrupt`` fault damages it and dies."""
        f = self._take(("corrupt",), step)
        if f is None:
            return
        say(f"pipedream-ft: rank {self.rank}: injecting fault {f} into checkpoint {step}", sys.stdout)
        corrupt()
        os.kill(os.getpid(), signal.SIGKILL)


def _step_of(rel: str) -> int | None:
    for part in rel.split("/"):
        if part.startswith("step-"):
            try:
                return int(part[5:])
            except ValueError:
                return None
    return None
