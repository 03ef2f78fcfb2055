"""The leader of one launch's process group: pins the CPUs, runs torchrun, passes SIGTERM on, records the exit.

``python -m pipedream_ft.pool.service.shim DIR CORES -- torchrun args...``: writes ``DIR/pid`` (its pid and
start time) first, sets its CPU affinity to ``CORES`` (comma-separated, or ``-`` for none; inherited by torchrun
and the workers), runs the command, and writes ``DIR/exit.json`` (``{"rc": N}``) atomically when it ends. The
service may die meanwhile: a service that comes back finds the shim by its pid file, and its result in the exit
file, although the shim is not its child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["main", "proc_start"]


def proc_start(pid: int) -> str | None:
    """The process's start time from ``/proc/PID/stat`` (None if it is gone): with the pid, its identity."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data.rsplit(")", 1)[1].split()[19]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    out, cores, sep, *cmd = argv
    if sep != "--" or not cmd:
        print("usage: shim DIR CORES -- COMMAND...", file=sys.stderr)
        return 2
    d = Path(out)
    _write_atomic(d / "pid", json.dumps({"pid": os.getpid(), "start": proc_start(os.getpid())}))
    if cores != "-":
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    child = subprocess.Popen(cmd)
    forwarded = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = child.wait()
    _write_atomic(d / "exit.json", json.dumps({"rc": rc, "signalled": bool(forwarded)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
