"""``pipedream-probe``: measure the machine a plan is for, and write its machine profile.

Launched like training, one process per worker::

    torchrun --nproc-per-node 4 -m pipedream_ft.probe -o machine.json          # or: pipedream-probe ...
    pipedream-partition model.prof.json --machine machine.json -o plan.json

gloo on CPU, NCCL on GPU (``--backend``). The levels of the machine (innermost first) are ``--workers``
if given (their product must be the world size), else torchrun's: ``LOCAL_WORLD_SIZE`` workers per machine
and ``WORLD_SIZE / LOCAL_WORLD_SIZE`` machines (one level when everything is on one machine). Ranks are taken
to be laid out innermost level first, as torchrun numbers them (rank = GROUP_RANK · LOCAL_WORLD_SIZE +
LOCAL_RANK).

What it measures (medians of repeated runs, everything in the same run):

* **point-to-point**, per level: rank 0 and the first rank whose nearest common level with it is that
  level ping-pong a small and a large tensor; half a round trip is ``L + bytes / B``, solved for the latency
  ``L`` and bandwidth ``B`` from the two sizes;
* **all-reduce**, per level and replica-group size ``r = 2 .. n_l`` (ranks ``0, s, 2s, ...`` with ``s`` the
  level's stride): a small and a large all-reduce, fitted to ``4 (r-1)/r · (λ + bytes / B_ar)``
  (:func:`partitioner.machine.fit_allreduce`);
* **CPU parallelism** (CPU backends): rank 0 runs a fixed CPU-bound work alone, then every rank runs it at
  once; ``W · t_alone / t_together`` is how many cores the machine's workers really get together (fewer
  than it has when others load it), for the cost model's contention bound;
* **the runtime's fixed cost per minibatch per stage**: a ``WORLD_SIZE``-stage pipeline of layers that
  compute nothing (``x · w`` on ``(8, 64)`` tensors) trains through :class:`~pipedream_ft.PipelineTrainer`;
  each stage's CPU seconds per minibatch are its fixed cost (``stage_overhead_s``), the median is
  ``overhead_s``; the pipeline's measured time per minibatch is recorded beside them. Its peer, measured in the
  same run, two floors no pipeline runtime goes under: the CPU per minibatch of each stage sending and receiving
  the same messages with nothing else (the backend's share, ``samples["runtime"]["messages"]``), and of a plain
  PyTorch loop of the stage's layer alone (forward, backward, the optimizer's step; ``["plain"]``).

Bounded waits: every rank announces itself in the job's store; a rank that does not within ``--timeout``
seconds makes every rank that is running fail with one line naming it (exit status 2); so does a transfer or
an all-reduce that does not complete.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["main", "probe", "levels_of", "ProbeSettings"]

PROG = "pipedream-probe"


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """How long and how hard to probe."""

    small_bytes: int = 64
    large_bytes: int = 4 << 20
    repeats: int = 20
    """Repeats of each small measurement (large ones: a quarter, at least 3)."""
    minibatches: int = 120
    """Minibatches of the runtime measurement (after a warm-up of 2 per stage)."""
    timeout_s: float = 30.0
    backend: str | None = None
    runtime: bool = True
    """Measure the runtime's fixed cost (False: record 0)."""


def levels_of(world: int, local_world: int | None, workers: Sequence[int] | None) -> list[int]:
    """The machine's workers per level, innermost first (see the module docstring)."""
    from profiler.cliutil import CliError

    if workers:
        if math.prod(workers) != world:
            raise CliError(f"--workers {' x '.join(map(str, workers))} = {math.prod(workers)} workers, but the "
                           f"world has {world}")
        return list(workers)
    if not local_world or local_world >= world:
        return [world]
    if world % local_world:
        raise CliError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}; give --workers")
    return [local_world, world // local_world]


# -- rendezvous with a bounded wait -----------------------------------------------------------------------------


def _join(settings: ProbeSettings) -> Any:
    """Announce this rank in the job's store and wait for every other; one line naming the missing ones."""
    import torch.distributed as dist

    from profiler.cliutil import CliError

    from .env import read_env
    from .ft.coordination import base_store, init_distributed

    env = read_env()
    try:
        store = base_store(env, settings.timeout_s)
    except Exception as exc:  # the store host (rank 0 or torchrun's agent) is not there
        raise CliError(f"rank {env.rank}: cannot reach rank 0's store at {env.master_addr}:{env.master_port} "
                       f"within {settings.timeout_s:g} s ({type(exc).__name__})") from None
    ns = dist.PrefixStore(f"pipedream_ft/{env.run_id}/probe/{env.restart_count}/", store)
    hosts_store = env.rank == 0 and not env.use_agent_store
    missing = list(range(env.world_size))
    verdict: str | None = None
    try:
        ns.set(f"arrived/{env.rank}", "1")
        deadline = time.monotonic() + settings.timeout_s
        while True:
            if ns.check(["verdict"]):  # another rank gave up first: fail with its words, the same everywhere
                verdict = ns.get("verdict").decode()
                break
            missing = [r for r in missing if not ns.check([f"arrived/{r}"])]
            if not missing:
                break
            if time.monotonic() > deadline:
                names = ", ".join(map(str, missing))
                mine = f"no answer from rank{'s' if len(missing) > 1 else ''} {names} within {settings.timeout_s:g} s"
                verdict = ns.compare_set("verdict", "", mine).decode()  # the first rank to give up decides
                break
            time.sleep(0.01)
    except Exception:  # the store's host gave up (and left) while this rank was still waiting
        names = ", ".join(map(str, missing))
        raise CliError(f"rank {env.rank}: no answer from rank{'s' if len(missing) > 1 else ''} {names} "
                       f"within {settings.timeout_s:g} s") from None
    if verdict is not None:
        try:
            ns.set(f"read_verdict/{env.rank}", "1")
        except Exception:  # the store's host stopped lingering: the verdict is read, nobody waits for this rank
            pass
        if hosts_store:  # keep the store up until every rank that came has read the verdict (bounded)
            came = [r for r in range(env.world_size) if r != env.rank and ns.check([f"arrived/{r}"])]
            linger = time.monotonic() + min(settings.timeout_s, 10.0)
            while time.monotonic() < linger and not all(ns.check([f"read_verdict/{r}"]) for r in came):
                time.sleep(0.01)
        raise CliError(f"rank {env.rank}: {verdict}")
    try:
        init_distributed(env, backend=settings.backend, timeout_s=settings.timeout_s)
    except Exception as exc:
        raise CliError(f"rank {env.rank}: joining the group failed: {' '.join(str(exc).split())[:300]}") from None
    return env


# -- measurements ---------------------------------------------------------------------------------------------


def _median_time(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _guard(what: str, fn: Callable[[], Any]) -> Any:
    from profiler.cliutil import CliError

    try:
        return fn()
    except CliError:
        raise
    except Exception as exc:
        raise CliError(f"{what} failed: {' '.join(str(exc).split())[:300]}") from None


def _p2p(rank: int, a: int, b: int, nbytes: int, repeats: int, device: Any, sync: Callable[[], None]) -> float:
    """Half the median round trip of ``nbytes`` between ranks ``a`` and ``b`` (others return 0)."""
    import torch
    import torch.distributed as dist

    if rank not in (a, b):
        return 0.0
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)

    def once() -> None:
        if rank == a:
            dist.send(buf, b)
            dist.recv(buf, b)
        else:
            dist.recv(buf, a)
            dist.send(buf, a)

    once()  # connect
    return _median_time(once, repeats, sync) / 2.0


def _two_point(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """``(latency, bandwidth)`` through ``(bytes, seconds)`` points: ``t = L + bytes / B`` (L, B clamped)."""
    (s1, t1), (s2, t2) = small, large
    slope = (t2 - t1) / (s2 - s1)
    if not slope > 0:  # the large transfer was not slower: no measurable bandwidth cost
        return max(t1, 0.0), s2 / max(t2, 1e-9)
    return max(t1 - s1 * slope, 0.0), 1.0 / slope


def _measure_links(env: Any, levels: list[int], settings: ProbeSettings, device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from partitioner.machine import fit_allreduce

    rank = env.rank
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    big_reps = max(3, settings.repeats // 4)
    out: dict[str, Any] = {"p2p": [], "allreduce": []}
    stride = 1
    for lvl, n in enumerate(levels):
        if n >= 2:
            peer = stride  # rank 0 and rank `stride` first meet at this level
            pts = []
            for nbytes, reps in ((settings.small_bytes, settings.repeats), (settings.large_bytes, big_reps)):
                t = _guard(f"rank {rank}: transfer of {nbytes} bytes between ranks 0 and {peer}",
                           lambda: _p2p(rank, 0, peer, nbytes, reps, device, sync))
                pts.append((nbytes, t))
            sent = torch.tensor([[p[1] for p in pts]], dtype=torch.float64)
            _guard(f"rank {rank}: sharing the transfer times", lambda: dist.broadcast(sent, 0))
            pts = [(pts[i][0], float(sent[0, i])) for i in range(2)]
            for nbytes, t in pts:
                out["p2p"].append({"level": lvl, "ranks": [0, peer], "bytes": nbytes, "seconds": t})
            # all-reduce over groups 0, s, 2s, ... of size r
            for r in range(2, n + 1):
                members = [k * stride for k in range(r)]
                group = _guard(f"rank {rank}: making the group {members}", lambda: dist.new_group(members))
                for nbytes, reps in ((settings.small_bytes, settings.repeats), (settings.large_bytes, big_reps)):
                    t = 0.0
                    if rank in members:
                        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
                        what = f"rank {rank}: all-reduce of {nbytes} bytes over ranks {members}"
                        _guard(what, lambda: dist.all_reduce(buf, group=group))
                        t = _guard(what, lambda: _median_time(lambda: dist.all_reduce(buf, group=group), reps, sync))
                    sent = torch.tensor([t], dtype=torch.float64)
                    _guard(f"rank {rank}: sharing the all-reduce times", lambda: dist.broadcast(sent, 0))
                    out["allreduce"].append({"level": lvl, "replicas": r, "bytes": nbytes, "seconds": float(sent[0])})
        _guard(f"rank {rank}: barrier after level {lvl}", lambda: dist.barrier())
        stride *= n
    # per level: the fits
    fits = []
    for lvl, n in enumerate(levels):
        p = [(s["bytes"], s["seconds"]) for s in out["p2p"] if s["level"] == lvl]
        a = [(s["replicas"], s["bytes"], s["seconds"]) for s in out["allreduce"] if s["level"] == lvl]
        if len(p) == 2:
            lat, bw = _two_point(p[0], p[1])
        else:
            lat, bw = 0.0, math.inf
        if len(a) >= 2:
            lam, bar = fit_allreduce(a)
        else:
            lam, bar = 0.0, math.inf
        fits.append((lat, bw, lam, bar))
    out["fits"] = fits
    return out


def _spin(seconds_hint: float = 0.15) -> Callable[[], None]:
    """A fixed amount of CPU work (small matrix products, one thread) taking about ``seconds_hint`` alone."""
    import torch

    a = torch.randn(96, 96)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.02:
        a = torch.tanh(a @ a)
        n += 1
    reps = max(1, int(n * seconds_hint / 0.02))

    def work() -> None:
        b = a
        for _ in range(reps):
            b = torch.tanh(b @ b)

    return work


def _measure_parallelism(env: Any, levels: list[int], settings: ProbeSettings) -> dict[str, Any]:
    """Cores the workers of one machine get together: ``W · t_alone / t_together`` (medians of 3), where
    rank 0 runs a fixed CPU-bound work alone, then every rank runs it at once."""
    import torch
    import torch.distributed as dist

    work = _spin()
    sizes = torch.zeros(1, dtype=torch.int64)
    alone, together = [], []
    for _ in range(3):
        _guard(f"rank {env.rank}: barrier", lambda: dist.barrier())
        if env.rank == 0:
            t0 = time.perf_counter()
            work()
            alone.append(time.perf_counter() - t0)
        _guard(f"rank {env.rank}: barrier", lambda: dist.barrier())
        t0 = time.perf_counter()
        work()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        _guard(f"rank {env.rank}: sharing CPU times", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX))
        together.append(float(t[0]))
    del sizes
    t_alone = torch.tensor([statistics.median(alone) if alone else 0.0], dtype=torch.float64)
    _guard(f"rank {env.rank}: sharing CPU times", lambda: dist.broadcast(t_alone, 0))
    w = levels[0]
    par = min(float(w), w * float(t_alone[0]) / statistics.median(together))
    return {"alone_s": float(t_alone[0]), "together_s": together, "parallelism": par}


def _measure_runtime(env: Any, settings: ProbeSettings, device: Any) -> dict[str, Any]:
    """Train a ``WORLD_SIZE``-stage pipeline of layers that compute nothing; per-stage CPU and wall figures."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from partitioner.plan import Plan
    from profiler.layers import structure_profile

    from .trainer import PipelineConfig, PipelineTrainer

    S = env.world_size

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)

    torch.manual_seed(0)
    model = nn.Sequential(*(Scale() for _ in range(S)))
    prof = structure_profile(model)
    plan = Plan.from_stages([[i] for i in range(S)], [1] * S, profile_hash=prof.structure_hash(),
                            layer_names=[l.name for l in prof.layers])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.mse_loss,
                              optimizer_factory=lambda p: torch.optim.SGD(p, lr=1e-4),
                              config=PipelineConfig(timeout_s=settings.timeout_s, backend=settings.backend,
                                                    summary=False, progress=False))
    try:
        trainer.train(data, 2 * S)
        before = trainer.stats.as_dict()
        dist.barrier()
        cpu0, t0 = time.process_time(), time.perf_counter()
        trainer.train(data, settings.minibatches)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        dist.barrier()
        after = trainer.stats.as_dict()
    finally:
        trainer.close()
    n = settings.minibatches
    mine = {"stage": trainer.stage_index, "cpu_s": cpu / n, "wall_s": wall / n,
            "busy_s": (after["forward_s"] + after["backward_s"] + after["update_s"]
                       - before["forward_s"] - before["backward_s"] - before["update_s"]) / n,
            "wait_s": (after["wait_s"] - before["wait_s"]) / n}
    rows: list[Any] = [None] * S
    dist.all_gather_object(rows, mine)
    floors = (trainer.stage_index, _measure_messages(trainer.stage_index, S, n, device),
              _measure_plain(Scale().to(device), data, trainer.is_last, n, device))
    gathered: list[Any] = [None] * S
    dist.all_gather_object(gathered, floors)
    gathered.sort()
    return {"stages": sorted(rows, key=lambda r: r["stage"]), "minibatches": n,
            "messages": [m for _, m, _ in gathered], "plain": [p for _, _, p in gathered]}


def _measure_plain(layer: Any, data: Callable[[int], Any], last: bool, n: int, device: Any) -> float:
    """CPU seconds per minibatch of a plain PyTorch loop of ``layer`` alone, as one stage of the pipeline of
    :func:`_measure_runtime` runs it (the last stage from a loss, the others from an incoming gradient), on
    ``device`` (on a GPU: the host's CPU time, kernels queued, the device waited for at the end)."""
    import torch
    from torch import nn

    opt = torch.optim.SGD(layer.parameters(), lr=1e-4)
    grad = torch.zeros(8, 64, device=device)

    def rounds(start: int, count: int) -> None:
        for b in range(start, start + count):
            x, y = (t.to(device) for t in data(b))
            out = layer(x)
            if last:
                nn.functional.mse_loss(out, y).backward()
            else:
                out.backward(grad)
            opt.step()
            opt.zero_grad()

    rounds(0, 4)
    cpu0 = time.process_time()
    rounds(4, n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.process_time() - cpu0) / n


def _measure_messages(stage: int, stages: int, n: int, device: Any) -> float:
    """CPU seconds per minibatch of stage ``stage`` (rank ``stage``) sending and receiving what it does in the
    pipeline of :func:`_measure_runtime` — an ``(8, 64)`` activation to the next stage, its gradient to the
    previous one, and theirs from them — with nothing else: the backend's own share of the fixed cost."""
    import torch
    import torch.distributed as dist

    def rounds(count: int) -> None:
        act_in, grad_in = (torch.empty(8, 64, device=device) for _ in range(2))
        act_out, grad_out = (torch.zeros(8, 64, device=device) for _ in range(2))
        for b in range(count):
            works = []
            if stage > 0:
                works += [dist.irecv(act_in, stage - 1, tag=2 * b), dist.isend(grad_out, stage - 1, tag=2 * b + 1)]
            if stage < stages - 1:
                works += [dist.isend(act_out, stage + 1, tag=2 * b), dist.irecv(grad_in, stage + 1, tag=2 * b + 1)]
            for w in works:
                w.wait()

    rounds(4)  # connect
    dist.barrier()
    cpu0 = time.process_time()
    rounds(n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.process_time() - cpu0) / n


def probe(levels: Sequence[int] | None = None, settings: ProbeSettings | None = None) -> Any:
    """Measure this job's machine; every rank returns the :class:`~partitioner.machine.MachineProfile`.

    A collective: every rank of the job calls it. Raises :class:`~profiler.cliutil.CliError` (one line) when
    a peer does not answer within ``settings.timeout_s`` or a measurement fails.
    """
    import torch

    from partitioner.machine import MachineLevel, MachineProfile

    settings = settings or ProbeSettings()
    env = _join(settings)
    lv = levels_of(env.world_size, env.local_world_size or None, levels)
    device = torch.device("cuda", env.local_rank) if torch.distributed.get_backend() == "nccl" \
        else torch.device("cpu")
    links = _measure_links(env, lv, settings, device)
    par = _measure_parallelism(env, lv, settings) if device.type == "cpu" else None
    runtime = _measure_runtime(env, settings, device) if settings.runtime and env.world_size >= 2 else None
    stage_cpu = tuple(r["cpu_s"] for r in runtime["stages"]) if runtime else ()
    overhead = statistics.median(stage_cpu) if stage_cpu else 0.0
    mlevels = []
    for n, (lat, bw, lam, bar) in zip(lv, links["fits"]):
        bw = bw if math.isfinite(bw) else 1e12
        mlevels.append(MachineLevel(n, lat, bw, lam, bar if math.isfinite(bar) else bw))
    cores = os.cpu_count()
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    samples = {"p2p": links["p2p"], "allreduce": links["allreduce"], "runtime": runtime, "cpu": par}
    meta = {"backend": torch.distributed.get_backend(), "world_size": env.world_size, "torch": torch.__version__,
            "host": os.uname().nodename, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "settings": {"small_bytes": settings.small_bytes, "large_bytes": settings.large_bytes,
                         "repeats": settings.repeats, "minibatches": settings.minibatches}}
    return MachineProfile(tuple(mlevels), overhead, stage_cpu, cores, par["parallelism"] if par else None,
                          samples, meta)


# -- command line ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from profiler.cliutil import OneLineParser, number

    ap = OneLineParser(prog=PROG, description="Measure the machine (links, all-reduce, the runtime's fixed cost) "
                                              "and write a machine profile for pipedream-partition --machine.")
    ap.add_argument("-o", "--output", required=True, help="where rank 0 writes the machine profile JSON")
    ap.add_argument("--workers", "-n", action="append", type=number("workers", integer=True, low=1),
                    help="workers per level, innermost first (default: torchrun's LOCAL_WORLD_SIZE per machine)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: NCCL with CUDA, else gloo")
    ap.add_argument("--timeout", type=number("timeout", low=0, unit=" of seconds"), default=30.0,
                    help="seconds to wait for a peer before failing (default 30)")
    ap.add_argument("--repeats", type=number("repeats", integer=True, low=1), default=20,
                    help="repeats of each small measurement (default 20)")
    ap.add_argument("--large-bytes", type=number("large-bytes", integer=True, low=1), default=4 << 20,
                    help="size of the large transfers and all-reduces (default 4 MiB)")
    ap.add_argument("--minibatches", type=number("minibatches", integer=True, low=1), default=120,
                    help="minibatches of the runtime measurement (default 120)")
    ap.add_argument("--no-runtime", action="store_true", help="skip the runtime's fixed-cost measurement")
    return ap


def _run(argv: list[str] | None) -> int:
    import torch

    from profiler.cliutil import CliError, check_writable

    from .env import read_env
    from .ft.coordination import shutdown

    args = _parser().parse_args(argv)
    out = Path(args.output)
    env = read_env()
    if env.rank == 0:
        check_writable(out)
    if env.world_size < 2:
        raise CliError("the probe needs at least 2 processes (launch it with torchrun --nproc-per-node N)")
    torch.set_num_threads(1)
    settings = ProbeSettings(large_bytes=int(args.large_bytes), repeats=int(args.repeats),
                             minibatches=int(args.minibatches), timeout_s=float(args.timeout),
                             backend=args.backend, runtime=not args.no_runtime)
    try:
        machine = probe([int(n) for n in args.workers] if args.workers else None, settings)
    finally:
        try:
            shutdown()
        except Exception:
            pass
    if env.rank == 0:
        from profiler.cliutil import write_atomic

        write_atomic(out, machine.dumps())
        print(machine.describe())
        rt = machine.samples.get("runtime")
        if rt:
            walls = [r["wall_s"] for r in rt["stages"]]
            print(f"  runtime, {len(walls)}-stage pipeline of empty layers: {max(walls) * 1e3:.3f} ms per minibatch; "
                  f"CPU per stage " + " ".join(f"{r['cpu_s'] * 1e3:.3f}" for r in rt["stages"]) + " ms")
            if rt.get("messages") and rt.get("plain"):
                print(f"  floors of that CPU: the same messages alone "
                      + " ".join(f"{c * 1e3:.3f}" for c in rt["messages"]) + " ms; a plain PyTorch loop of each "
                      "stage's layer " + " ".join(f"{c * 1e3:.3f}" for c in rt["plain"]) + " ms")
        print(f"machine profile written to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line on this rank; returns the exit status (0, or 2 on any error)."""
    from profiler.cliutil import run_cli

    return run_cli(PROG, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
