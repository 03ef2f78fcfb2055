"""A deterministic fault injector, for tests and drills.

Faults are given in code or in the environment variable ``PIPEDREAM_FT_FAULTS``, ``;``-separated::

    PIPEDREAM_FT_FAULTS="kill@rank=1,step=20;exception@rank=2,step=35,attempt=1"

Each fault fires once, on ``rank``, when that rank starts the forward of minibatch ``step``, during attempt
``attempt`` (default 0) of the group: torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``), plus, with
in-place recovery, the number of times the group was formed again — so a restarted or recovered run is not hit
again unless asked to be (two failures in a row: a second fault with ``attempt=1``). Kinds:

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
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import say
from ..pipeline.hooks import Hooks
from ..pipeline.schedule import Action

__all__ = ["KINDS", "Fault", "InjectedFault", "FaultInjector", "parse_faults"]

KINDS = ("kill", "exception", "hang", "term", "supervisor", "ckpt_crash", "corrupt", "rejoin", "connect",
         "drained")
ENV_VAR = "PIPEDREAM_FT_FAULTS"


class InjectedFault(RuntimeError):
    """The ``exception`` fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    rank: int
    step: int
    attempt: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if self.rank < 0 or self.step < 0 or self.attempt < 0:
            raise ValueError(f"fault rank, step and attempt must be >= 0, got {self}")

    def __str__(self) -> str:
        return f"{self.kind}@rank={self.rank},step={self.step},attempt={self.attempt}"


def parse_faults(text: str) -> list[Fault]:
    """Parse ``kind@rank=R,step=S[,attempt=A];...``."""
    faults = []
    for item in filter(None, (p.strip() for p in text.split(";"))):
        kind, sep, rest = item.partition("@")
        if not sep:
            raise ValueError(f"fault {item!r} must look like kind@rank=R,step=S[,attempt=A]")
        fields: dict[str, int] = {}
        for kv in rest.split(","):
            key, eq, value = kv.strip().partition("=")
            if not eq or key not in ("rank", "step", "attempt"):
                raise ValueError(f"fault {item!r}: unknown field {kv.strip()!r}")
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"fault {item!r}: {key} must be an integer, got {value!r}") from None
        if "rank" not in fields or "step" not in fields:
            raise ValueError(f"fault {item!r} needs rank= and step=")
        faults.append(Fault(kind.strip(), **fields))
    return faults


class FaultInjector(Hooks):
    """Fires the faults meant for this rank and attempt (a hook: the training loop knows nothing of it)."""

    def __init__(self, faults: list[Fault], *, rank: int, attempt: int) -> None:
        self._mine = [f for f in faults if f.rank == rank]
        self.rank = rank
        self.faults: list[Fault] = []
        self.set_attempt(attempt)

    def set_attempt(self, attempt: int) -> None:
        """Arm the faults of ``attempt``: the group's restart count plus, with in-place recovery, the number of
        times the group was formed again (so a fault hits the attempt it names, whichever process runs it)."""
        self.attempt = attempt
        self.faults = [f for f in self._mine if f.attempt == attempt]

    @staticmethod
    def from_env(*, rank: int, attempt: int, environ: dict[str, str] | None = None) -> FaultInjector:
        env = os.environ if environ is None else environ
        return FaultInjector(parse_faults(env.get(ENV_VAR, "")), rank=rank, attempt=attempt)

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
        f = self._take(("kill", "exception", "hang", "term", "supervisor"), step)
        if f is None:
            return
        say(f"pipedream-ft: rank {self.rank}: injecting fault {f}", sys.stdout)
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "exception":
            raise InjectedFault(f"injected fault {f}")
        elif f.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "supervisor":
            if not os.environ.get("PIPEDREAM_FT_SUPERVISOR"):
                raise InjectedFault(f"{f}: this process has no supervisor (in-place recovery under launch only)")
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(60)  # this process dies with its supervisor (PR_SET_PDEATHSIG)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def at_drained(self) -> None:
        """Called as the rank has run the last action of a ``train`` call (``drained``)."""
        f = next((f for f in self.faults if f.kind == "drained"), None)
        if f is not None:
            self.faults.remove(f)
            say(f"pipedream-ft: rank {self.rank}: injecting fault {f}", sys.stdout)
            os.kill(os.getpid(), signal.SIGKILL)

    def instrument(self, checkpointer: Any) -> None:
        """Arm the checkpoint faults on ``checkpointer``: ``ckpt_crash`` through its storage's writes, ``corrupt``
        before its saves."""
        storage = checkpointer.storage
        if storage is not None:  # None: the memory tier alone (no durable writes to crash in)
            storage.write_bytes = self.wrap_part_write(storage.write_bytes)
        if any(f.kind == "corrupt" for f in self.faults):
            checkpointer.before_save = lambda cut: self._corrupt_before(checkpointer, cut)

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

    def wrap_part_write(self, write: Callable[[str, bytes], Any]) -> Callable[[str, bytes], Any]:
        """Wrap ``Storage.write_bytes`` so a ``ckpt_crash`` fault kills the rank mid-write of its part."""
        if not any(f.kind == "ckpt_crash" for f in self._mine):
            return write

        def crashing_write(rel: str, data: bytes) -> Any:
            step = _step_of(rel)
            # the faults armed now: a replacement process (in place) is started at attempt 0 and armed for its own
            # attempt once the group is formed, before it writes anything
            if step is not None and rel.endswith(".pt") and self._take(("ckpt_crash",), step) is not None:
                say(f"pipedream-ft: rank {self.rank}: injecting fault ckpt_crash while writing {rel}", sys.stdout)
                write(rel + ".partial", data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            return write(rel, data)

        return crashing_write

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
