"""Processes: a launch of ``torchrun --nproc-per-node n`` per job allocation, its stop, and re-attaching to it.

Each launch runs under :mod:`.shim` in a session of its own (the shim leads the process group; torchrun's
workers live in sessions of their own under it). On ``cuda:`` devices a launch sees its devices through
``CUDA_VISIBLE_DEVICES``; on ``cpu:N`` slots its processes are pinned to the slots' cores (slot ``i`` is core
``i mod cores``) with one thread each. A stop is SIGTERM to the shim, which passes it to torchrun and so to the
workers (their emergency checkpoint); past the deadline the whole tree is killed. A launch is found again by
the pid and start time its shim wrote, and its result by the exit file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import PoolError
from .shim import proc_start

__all__ = ["Devices", "Runner", "LaunchHandle", "descendants"]


@dataclass(frozen=True)
class Devices:
    """The pool's devices: ``kind`` ``cpu`` (``count`` slots) or ``cuda`` (``ids``)."""

    kind: str
    ids: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.ids)

    @classmethod
    def parse(cls, spec: str) -> "Devices":
        kind, _, rest = spec.partition(":")
        if kind == "cpu":
            try:
                n = int(rest)
            except ValueError:
                n = 0
            if n < 1:
                raise PoolError(f"--devices {spec!r}: cpu:N needs N >= 1 slots")
            return cls("cpu", tuple(str(i) for i in range(n)))
        if kind == "cuda":
            ids = tuple(x.strip() for x in rest.split(",") if x.strip())
            if not ids or not all(x.isdigit() for x in ids) or len(set(ids)) != len(ids):
                raise PoolError(f"--devices {spec!r}: cuda: needs distinct device numbers, e.g. cuda:0,1,2,3")
            return cls("cuda", ids)
        raise PoolError(f"--devices {spec!r}: expected cpu:N or cuda:0,1,...")

    def spec(self) -> str:
        return f"cpu:{self.count}" if self.kind == "cpu" else "cuda:" + ",".join(self.ids)

    def environment(self, slots: Sequence[int]) -> tuple[dict[str, str], str]:
        """The environment and the shim's core list for a launch on ``slots``."""
        if self.kind == "cuda":
            return {"CUDA_VISIBLE_DEVICES": ",".join(self.ids[s] for s in slots)}, "-"
        cores = sorted(os.sched_getaffinity(0))
        return {"OMP_NUM_THREADS": "1"}, ",".join(str(cores[s % len(cores)]) for s in sorted(set(slots)))


@dataclass
class LaunchHandle:
    """A running launch: ``pid`` (the shim) and, when the service started it, its ``Popen``."""

    pid: int
    start: str | None
    proc: subprocess.Popen | None = None

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return proc_start(self.pid) == self.start and self.start is not None


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from /proc), children first reached breadth-first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, frontier = [], [pid]
    while frontier:
        for c in children.get(frontier.pop(), []):
            out.append(c)
            frontier.append(c)
    return out


class Runner:
    """Starts, stops and finds launches for the pool's ``devices``."""

    def __init__(self, devices: Devices, python: str = sys.executable) -> None:
        self.devices = devices
        self.python = python

    def start(self, launch_dir: Path, workers: int, slots: Sequence[int], argv: Sequence[str], cwd: str,
              env: Mapping[str, str], log_path: Path) -> LaunchHandle:
        """Start ``torchrun --nproc-per-node workers ARGV`` on ``slots``; returns once the shim has written its
        pid file (so the launch can be found again)."""
        launch_dir.mkdir(parents=True, exist_ok=True)
        dev_env, cores = self.devices.environment(slots)
        full_env = {**os.environ, **env, **dev_env, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        cmd = [self.python, "-m", "pipedream_ft.pool.service.shim", str(launch_dir), cores, "--",
               self.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
               "--max-restarts", "0", *argv]
        log = open(log_path, "ab")
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise PoolError(f"cannot start {cmd[0]}: {exc.strerror}") from None
        finally:
            log.close()
        return LaunchHandle(proc.pid, None, proc)

    @staticmethod
    def read_pid(launch_dir: Path) -> tuple[int, str | None] | None:
        try:
            d = json.loads((launch_dir / "pid").read_text())
        except (OSError, ValueError):
            return None
        return int(d["pid"]), d.get("start")

    @staticmethod
    def exit_status(launch_dir: Path) -> int | None:
        """The exit status torchrun ended with (the shim's record), or None if there is none."""
        try:
            return int(json.loads((launch_dir / "exit.json").read_text())["rc"])
        except (OSError, ValueError, KeyError):
            return None

    def attach(self, launch_dir: Path, pid: int | None, start: str | None) -> LaunchHandle | None:
        """The launch recorded with ``pid``/``start`` (or in its pid file), if its shim still runs."""
        if pid is None or start is None:
            found = self.read_pid(launch_dir)
            if found is None:
                return None
            pid, start = found
        h = LaunchHandle(pid, start)
        return h if h.alive() else None

    @staticmethod
    def terminate(h: LaunchHandle) -> None:
        """SIGTERM to the shim, which passes it on to torchrun (and torchrun to its workers)."""
        try:
            os.kill(h.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    @staticmethod
    def kill(h: LaunchHandle) -> None:
        """SIGKILL to the shim and everything under it (torchrun's workers run in sessions of their own)."""
        pids = [h.pid, *descendants(h.pid)]
        for p in reversed(pids):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
