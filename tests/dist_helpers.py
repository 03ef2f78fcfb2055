"""Run a function on N real processes joined by torch.distributed (gloo on loopback)."""

from __future__ import annotations

import io
import multiprocessing as mp
from multiprocessing import reduction
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

__all__ = ["free_port", "run_world", "WorldError"]


class WorldError(AssertionError):
    """Some rank failed or the world timed out; carries every rank's outcome."""

    def __init__(self, message: str, outcomes: dict[int, tuple[bool, Any]]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: Any, timeout: float = 120.0) -> None:
    """Wait until something listens on 127.0.0.1:``port`` (``proc``, a torchrun agent hosting its rendezvous
    store), so that an agent started next is a client of it rather than racing it for the port."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the agent that should host the store on port {port} exited ({proc.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on port {port} after {timeout:g} s") from None
            time.sleep(0.1)


_PRELOAD = ["torch", "torch.distributed", "pipedream_ft.trainer", "pipedream_ft.launch", "partitioner",
            "profiler.measure"]
"""Imported once by the fork server that starts every rank, so no rank pays for importing them again."""


def _context() -> Any:
    """Ranks fork from a server that has imported torch and this package once (per test process), instead of
    each starting a fresh interpreter: ``spawn`` spent seconds of CPU per rank on imports alone. A forked rank is
    as fresh as a spawned one for what the tests need: no thread, no process group and no CUDA exists in the
    server, ``random`` reseeds itself at a fork, and each rank gets the caller's environment (below)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _Output:
    """The caller's stdout and stderr as they are when a rank starts (a test's capture, ``capfd``), handed to the
    forked rank, which writes to them as a spawned one would."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _attach_output, (reduction.DupFd(1), reduction.DupFd(2))


def _attach_output(out: Any, err: Any) -> None:
    for fd, target in ((out.detach(), 1), (err.detach(), 2)):
        os.dup2(fd, target)
        os.close(fd)


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, q: Any, args: tuple, environ: dict,
           env: dict, output: None = None) -> None:
    os.environ.clear()  # the caller's environment as it is now, as a spawned process would get it
    os.environ.update(environ)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(*args)
        buf = io.BytesIO()
        torch.save(result, buf)  # tensors through a Queue would need the sender alive
        q.put((rank, True, buf.getvalue()))
    except BaseException as exc:  # report everything, including SystemExit
        q.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_world(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, env: dict | None = None,
              expect_failure: bool = False) -> dict[int, tuple[bool, Any]]:
    """Run ``fn(*args)`` on ``world`` spawned ranks; return ``{rank: (ok, result or (type, msg, tb))}``.

    Raises :class:`WorldError` if a rank fails (unless ``expect_failure``) or the world outlives ``timeout``
    (then every process is killed).
    """
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, q, args, dict(os.environ), env or {}, _Output()),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorldError(f"world of {world} timed out after {timeout}s; finished: {sorted(outcomes)}", outcomes)
            try:
                rank, ok, payload = q.get(timeout=min(left, 1.0))
                if ok:
                    import torch

                    payload = torch.load(io.BytesIO(payload), weights_only=False)
                outcomes[rank] = (ok, payload)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in outcomes]
                if dead and all(p.exitcode is not None for p in procs):
                    for i in dead:
                        outcomes[i] = (False, ("Exit", f"exit code {procs[i].exitcode}", ""))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failed = {r: o for r, o in outcomes.items() if not o[0]}
    if failed and not expect_failure:
        # the root cause first: a rank whose error is not a peer's failure seen from its side
        causes = [r for r in sorted(failed) if failed[r][1][0] != "PeerTimeoutError"] or sorted(failed)
        first = causes[0]
        lines = "\n".join(f"  rank {r}: {o[1][0]}: {o[1][1].splitlines()[0] if o[1][1] else ''}"
                          for r, o in sorted(failed.items()))
        codes = {i: p.exitcode for i, p in enumerate(procs)}
        raise WorldError(f"rank {first} failed (every failed rank below; exit codes {codes}):\n{lines}\n"
                         f"{failed[first][1][2]}", outcomes)
    return outcomes
