"""Checkpoint write micro-benchmark: one process, one stage's state, pipedream-ft's writer against
``torch.distributed.checkpoint.async_save`` (the peer), measured in the same run, interleaved.

The state is what the runtime saves for stage 0 of ``bench_checkpoint.py`` (2 stages, MLP 10x1024: 5.3M
parameters per stage): the model's ``state_dict()``, the SGD optimizer's ``state_dict()`` with momentum, and one
stashed weight version (the runtime keeps ``S - s - 1`` on stage ``s``). Before every save the live weights and
momentum are changed in place (as an update does) and a new version is published (as the runtime does).

Writers compared (each ``--saves`` times, in rotated order, to a fresh directory on ``--dir``, with fsync):

- ``dcp``: ``torch.distributed.checkpoint.async_save(state, storage_writer=FileSystemWriter(...), no_dist=True)``
  (thread executor; its staging copies every tensor to CPU memory before returning);
- ``pdft-copy``: ``CheckpointWriter.save(step, state)`` with every tensor copied (nothing marked immutable);
- ``pdft``: ``CheckpointWriter.save`` as the runtime should call it: the weight versions marked
  ``immutable(...)``, and the model's parameters given as the newest version's tensors (equal right after an
  update, and immutable), so only the optimizer state and buffers are copied;
- ``pdft-proc``: the alternative design, persisting in a separate process at nice 19: the state is copied into
  shared-memory tensors (the other process cannot see the trainer's private memory, so immutable tensors are
  copied too), and a persistent child process encodes, checksums and writes them the same way (O_DIRECT).
  Its background CPU is the child's (``/proc/<pid>/stat``);
- ``pdft+mem``: a cut saved to the memory tier (``/dev/shm``) and durably, as the runtime saves one: one snapshot
  (``CheckpointWriter.snapshot``) handed to both writers, encoded and checksummed once; ``pdft+mem2``: the same
  with a snapshot per writer (how the runtime saved such a cut before: copied, encoded and checksummed twice).

Figures per writer (medians over saves): *blocking* = time ``save`` / ``async_save`` took (training waits);
*total* = from the call to the data being durable; *background CPU* = CPU time of the whole process between
the call and durability minus the calling thread's (which only waits), per GB of state. Ratios are against
``dcp`` in the same run. Targets: blocking <= 0.5x and background CPU per GB <= 0.5x the peer's.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

__all__ = ["main", "make_stage"]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_stage(width: int, blocks: int, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """Stage 0 of the benchmark MLP: ``blocks`` Linear+ReLU layers of ``width`` on ``device``, SGD with momentum."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # creates the momentum buffers
    return model, opt


class Stage:
    """The live state of one stage, with weight versions published like the runtime's ``VersionStore``."""

    def __init__(self, width: int, blocks: int, versions_kept: int, device: str = "cpu") -> None:
        self.model, self.opt = make_stage(width, blocks, device)
        self.params = list(self.model.parameters())
        self.names = [n for n, _ in self.model.named_parameters()]
        self.keep = versions_kept
        self.current = [p.detach().clone() for p in self.params]
        self.history: dict[int, list[torch.Tensor]] = {}
        self.updates = 0

    def update(self) -> None:
        """An optimizer step (in place) and a new published version."""
        for p in self.params:
            p.grad = torch.randn_like(p) * 1e-3
        self.opt.step()
        if self.keep:
            self.history[self.updates] = self.current
            for k in [k for k in self.history if k < self.updates + 1 - self.keep]:
                del self.history[k]
        self.updates += 1
        self.current = [p.detach().clone() for p in self.params]

    def state(self, mark_immutable: bool) -> dict[str, Any]:
        from pipedream_ft.checkpoint import immutable

        model = self.model.state_dict()
        versions = {u: list(v) for u, v in self.history.items()}
        if not mark_immutable:
            return {"position": self.updates, "model": model, "optimizer": self.opt.state_dict(),
                    "versions": versions}
        # parameters equal the newest version right after an update: reference that (immutable) instead
        for name, t in zip(self.names, self.current):
            model[name] = t
        return {"position": self.updates, "model": immutable(model), "optimizer": self.opt.state_dict(),
                "versions": immutable(versions)}

    def nbytes(self) -> int:
        total = 0

        def walk(x: Any) -> None:
            nonlocal total
            if isinstance(x, torch.Tensor):
                total += x.numel() * x.element_size()
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        walk(self.state(False))
        return total


def _str_keys(x: Any) -> Any:
    """DCP wants string keys and no lists of tensors: the same state, re-keyed (no tensor copied)."""
    if isinstance(x, dict):
        return {str(k): _str_keys(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in x):
        return {str(i): _str_keys(v) for i, v in enumerate(x)}
    return x


_children: list[int] = []


def _child_cpu() -> float:
    """CPU seconds of the persist child processes so far."""
    total = 0.0
    for pid in _children:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(save: Callable[[int], Callable[[], None]], step: int) -> tuple[float, float, float]:
    """``save(step)`` returns a ``wait`` callable; returns (blocking_s, total_s, background_cpu_s)."""
    c0, tc0, k0, t0 = _cpu(), time.thread_time(), _child_cpu(), time.perf_counter()
    wait = save(step)
    t1 = time.perf_counter()
    wait()
    t2, c1, tc1, k1 = time.perf_counter(), _cpu(), time.thread_time(), _child_cpu()
    return t1 - t0, t2 - t0, (c1 - c0) - (tc1 - tc0) + (k1 - k0)


def _persist_child(conn: Any, directory: str, nice: int) -> None:
    """The separate-process persister: receives the shared tensors once, then writes them on each step sent."""
    os.nice(nice)
    torch.set_num_threads(1)
    from pipedream_ft.checkpoint import Buffers, Storage
    from pipedream_ft.checkpoint.checksum import checksum
    from pipedream_ft.checkpoint.tensorfile import encode_part

    st = Storage(directory)
    tree = conn.recv()
    while True:
        step = conn.recv()
        if step is None:
            return
        data = Buffers(encode_part(tree).chunks())
        digest = checksum(data)
        st.write_bytes(f"step-{step:010d}/part-stage0.pt", data)
        st.delete(f"step-{step - 2:010d}", recursive=True)
        conn.send(digest)


def _shared_like(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty(x.shape, dtype=x.dtype).share_memory_()  # in host memory, whatever x's device
    if isinstance(x, dict):
        return {k: _shared_like(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_shared_like(v) for v in x)
    return x


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(src, torch.Tensor):
        dst.copy_(src.detach())
    elif isinstance(src, dict):
        for k in src:
            _copy_into(dst[k], src[k])
    elif isinstance(src, (list, tuple)):
        for a, b in zip(dst, src):
            _copy_into(a, b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=8, help="saves per writer")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=5, help="layers of stage 0 (bench_checkpoint: 10 over 2 stages)")
    ap.add_argument("--versions", type=int, default=1, help="stashed versions kept (stage 0 of 2: 1)")
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temporary one)")
    ap.add_argument("--checksum", default="crc32", choices=["crc32", "sha256"])
    ap.add_argument("--nice", type=int, default=-1, help="persist thread nice value (-1: unchanged)")
    ap.add_argument("--device", default="cpu", help="where the stage's state lives: cpu or cuda (default cpu)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from pipedream_ft.checkpoint import CheckpointWriter, MemoryTier, Storage, TierWriter

    base = Path(tempfile.mkdtemp(prefix="pdft-bench-write-", dir=args.dir))
    if args.device != "cpu" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch.cuda.is_available() is False")
    stage = Stage(args.width, args.blocks, args.versions, args.device)
    for _ in range(args.versions + 1):
        stage.update()
    gb = stage.nbytes() / 1e9
    nice = None if args.nice < 0 else args.nice
    writers: dict[str, Any] = {}
    for name in ("pdft", "pdft-copy", "pdft+mem", "pdft+mem2"):
        st = Storage(str(base / name))
        writers[name] = CheckpointWriter(st, "stage0", is_committer=True, keep=2, checksum=args.checksum,
                                         persist_nice=nice, poll_interval_s=0.001, max_poll_interval_s=0.01)

    def pdft(name: str, mark: bool) -> Callable[[int], Callable[[], None]]:
        def save(step: int) -> Callable[[], None]:
            h = writers[name].save(step, stage.state(mark))

            def wait() -> None:
                assert h.wait(120) and h.ok, h.error
            return wait
        return save

    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else str(base)
    memory: dict[str, Any] = {}
    for name in ("pdft+mem", "pdft+mem2"):
        tier = MemoryTier(f"bench-{os.getpid()}-{name[5:]}", key=os.urandom(32), root=shm_root)
        memory[name] = (tier, TierWriter([tier], "stage0", keep=2))

    def both_tiers(name: str, shared: bool) -> Callable[[int], Callable[[], None]]:
        def save(step: int) -> Callable[[], None]:
            durable, fast = writers[name], memory[name][1]
            state = stage.state(True)
            if shared:
                snap = durable.snapshot(state)
                try:
                    h, m = durable.save(step, snap), fast.save(step, snap)
                finally:
                    snap.release()
            else:
                h, m = durable.save(step, state), fast.save(step, state)

            def wait() -> None:
                assert h.wait(120) and h.ok, h.error
                assert m.wait(120) and not m.errors, m.errors
            return wait
        return save

    def peer(step: int) -> Callable[[], None]:
        path = base / "dcp" / f"step-{step}"
        fut = dcp.async_save(_str_keys(stage.state(False)), storage_writer=FileSystemWriter(str(path)), no_dist=True)

        def wait() -> None:
            fut.result()
            old = base / "dcp" / f"step-{step - 2}"
            shutil.rmtree(old, ignore_errors=True)  # keep 2, like the writers
        return wait

    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_persist_child, args=(child_conn, str(base / "proc"), 19), daemon=True)
    child.start()
    _children.append(child.pid)

    def flat_state() -> dict[str, Any]:
        st = stage.state(False)
        return {"model": st["model"], "optimizer": st["optimizer"]["state"],
                "versions": {str(i): v for i, v in enumerate(st["versions"].values())}}

    shared = _shared_like(flat_state())
    parent_conn.send(shared)

    def proc(step: int) -> Callable[[], None]:
        _copy_into(shared, flat_state())  # blocking: every tensor into shared memory
        parent_conn.send(step)

        def wait() -> None:
            parent_conn.recv()
        return wait

    kinds: dict[str, Callable[[int], Callable[[], None]]] = {
        "dcp": peer, "pdft-copy": pdft("pdft-copy", False), "pdft": pdft("pdft", True), "pdft-proc": proc,
        "pdft+mem": both_tiers("pdft+mem", True), "pdft+mem2": both_tiers("pdft+mem2", False)}
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
    order = list(kinds)
    print(f"checkpoint write: state {1000 * gb:.1f} MB (model + SGD momentum + {args.versions} version(s)), "
          f"{args.saves} saves per writer, on {args.device}, checksum {args.checksum}, persist nice {nice}, dir {base}; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
    try:
        for k in kinds:  # warm-up: first allocations, imports, directory creation
            stage.update()
            measure(kinds[k], stage.updates)
        for r in range(args.saves):
            for k in order[r % len(order):] + order[: r % len(order)]:
                stage.update()
                results[k].append(measure(kinds[k], stage.updates))
    finally:
        for w in writers.values():
            w.close(10)
        for tier, fast in memory.values():
            fast.close(10)
            tier.destroy()
        parent_conn.send(None)
        child.join(10)
        shutil.rmtree(base, ignore_errors=True)

    med = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in results.items()}
    print(f"\n{'writer':10s} {'blocking ms':>12s} {'total ms':>9s} {'bg CPU ms':>10s} {'bg CPU s/GB':>12s} "
          f"{'blocking vs dcp':>16s} {'bg CPU/GB vs dcp':>17s}")
    for k in order:
        b, t, c = med[k]
        rb, rc = b / med["dcp"][0], c / med["dcp"][2]
        print(f"{k:10s} {1000 * b:12.2f} {1000 * t:9.1f} {1000 * c:10.1f} {c / gb:12.3f} {rb:15.2f}x {rc:16.2f}x")
    print(f"\nboth tiers at one cut, one snapshot / one per writer: blocking "
          f"{med['pdft+mem'][0] / med['pdft+mem2'][0]:.2f}x, background CPU {med['pdft+mem'][2] / med['pdft+mem2'][2]:.2f}x")
    b, _, c = med["pdft"]
    ok_b, ok_c = b <= 0.5 * med["dcp"][0], c <= 0.5 * med["dcp"][2]
    print(f"\n(medians over {args.saves} saves; blocking: the call; total: call -> durable; bg CPU: process CPU "
          "time during the save minus the calling thread's)")
    print(f"targets vs dcp: blocking <= 0.5x: {'met' if ok_b else 'MISSED'} ({b / med['dcp'][0]:.2f}x); "
          f"background CPU per GB <= 0.5x: {'met' if ok_c else 'MISSED'} ({c / med['dcp'][2]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
