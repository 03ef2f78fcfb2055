"""Checkpoint overhead: steady-state time per minibatch with and without checkpointing, on local disk and S3,
with ``torch.distributed.checkpoint.async_save`` of the same stage state as a peer.

Run: ``python benchmarks/bench_checkpoint.py [--quick] [--rounds 3] [--minibatches 300] [--every 100]
[--stages 2] [--width 1024] [--blocks 10] [--batch 32] [--optimizer sgd] [--storages local,dcp,s3]``.

The model is an MLP of ``--blocks`` ``Linear(width, width) + ReLU`` blocks and a small head (10.5M parameters by
default), split evenly into ``--stages`` pipeline stages, each on its own spawned CPU process (gloo on loopback,
one thread each). Every run trains ``--minibatches`` minibatches from scratch with a fresh checkpoint location:

- ``none``: a checkpoint configuration whose policy is ``Never()`` (the checkpointer is there, nothing is saved);
- ``local``: ``EveryNSteps(--every)`` to a directory on local disk, through the runtime's own checkpointer: the
  weight versions and the live parameters (the newest version's tensors) referenced, not copied, a due
  checkpoint deferred while the previous one is not committed, and the policy fed the measured costs; the
  benchmark wraps ``writer.save`` only to record each save's handle (and passes the writer's backlog to the
  policy as well, which the runtime already does);
- ``dcp`` (the peer): the same cuts and the same state, saved with ``torch.distributed.checkpoint.async_save``
  (``FileSystemWriter`` on the same disk, ``no_dist=True``: one checkpoint directory per stage and step;
  deferred like ``local`` while the previous save of the stage is not finished);
- ``s3``: like ``local``, to a SeaweedFS S3 server on 127.0.0.1, started fresh for each run.

Time per minibatch is measured on the last stage, which stamps the time each minibatch's loss is computed (the
loss function is wrapped), between minibatch ``every/2`` and ``N - every/2``, so the window holds
``N/every - 1`` checkpoints. Overhead is ``(t_ckpt - t_none) / t_none``, taken per round against that round's
``none`` run (the configurations run one after the other in each round, in rotated order, so a change in machine
load hits them alike), and the median over rounds is reported.

Because other work on a shared machine shifts the time per minibatch between runs by more than the effect
measured, an *in-run* estimate is printed too: per checkpoint interval, the minibatches from the cut to half an
interval later against the median of the same interval's second half (:func:`in_run_overheads`); on the
``none`` run the same computation gives the noise floor. ``--profile`` prints the mean excess time of each
minibatch around a cut (where the cost lands); ``cut-only`` runs the cuts with a writer that does nothing (the
runtime's own share); ``local-nice19`` runs the persist thread at nice 19; ``--s3-nice 19`` runs the SeaweedFS
server at nice 19 (its CPU then stands aside, as a remote server's would).

The second table gives, per configuration and stage, the blocking time of each save (the call), the background
persist time (wall, and CPU of the persist thread for pipedream-ft), the part's size and the commit latency.
Then the disk's and the S3 server's write bandwidth, measured in the same run (a 256 MB file written and fsynced;
a 64 MB object put), and how many checkpoints were deferred because storage had not caught up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "tests"))

__all__ = ["RunConfig", "RunResult", "run_once", "main"]

TARGETS = {"local": 0.01, "s3": 0.02}
"""Overhead targets at a checkpoint every 100 minibatches."""


@dataclass(frozen=True, slots=True)
class RunConfig:
    """One training run of the benchmark."""

    storage: str
    """``"none"``, ``"local"``, ``"dcp"`` or ``"s3"``."""
    url: str
    storage_options: dict[str, Any] | None = None
    every: int = 100
    minibatches: int = 300
    stages: int = 2
    width: int = 1024
    blocks: int = 10
    batch: int = 32
    optimizer: str = "sgd"
    timeout_s: float = 60.0


@dataclass(slots=True)
class RunResult:
    """What one run measured."""

    config: RunConfig
    s_per_minibatch: float
    saves_in_window: int
    load_before: float
    saves: list[dict[str, Any]] = field(default_factory=list)
    """One entry per save and stage: step, stage, snapshot_s, persist_s, persist_cpu_s, bytes, error."""
    deferred: int = 0
    """Checkpoints deferred by stage 0 because the previous one was not finished."""
    in_run: list[float] = field(default_factory=list)
    """Per checkpoint interval: the in-run overhead estimate (see :func:`in_run_overheads`)."""
    profile: list[float] = field(default_factory=list)
    """Mean excess time (s) of the minibatches at offsets -2 .. +12 from each cut, over the quiet median."""
    commits: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per committed step still kept: each part's bytes, commit latency."""
    params: int = 0


# -- one rank -------------------------------------------------------------------------------------------------


def _str_keys(x: Any) -> Any:
    """The state as DCP takes it: string keys, lists of tensors as dicts (no tensor copied)."""
    import torch

    if isinstance(x, dict):
        return {str(k): _str_keys(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in x):
        return {str(i): _str_keys(v) for i, v in enumerate(x)}
    return x


def _busy_policy(inner: Any, backlog: Any) -> Any:
    """``inner``, asked with ``busy=backlog() > 0`` (what stage 0's runtime should pass)."""
    from pipedream_ft.policies import CheckpointPolicy

    class BacklogAware(CheckpointPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def should_save(self, step: int, now: float, *, busy: bool = False) -> bool:
            return self.inner.should_save(step, now, busy=busy or backlog() > 0)

        def decide(self, step: int, now: float) -> bool:
            return self.inner.decide(step, now)

        def record_save(self, step: int, now: float) -> None:
            self.inner.record_save(step, now)

        def observe(self, **kw: Any) -> None:
            self.inner.observe(**kw)

        def reset(self, now: float, step: int | None = None) -> None:
            self.inner.reset(now, step)

        @property
        def deferred(self) -> int:  # type: ignore[override]
            return self.inner.deferred

        @deferred.setter
        def deferred(self, value: int) -> None:
            pass

    return BacklogAware()


def _rank_main(cfg: RunConfig) -> dict[str, Any]:
    import torch
    from torch import nn

    from ft_bench_worker import make_data, make_optimizer, mlp, mlp_plan
    from pipedream_ft.checkpoint import SaveHandle, list_committed, read_commit
    from pipedream_ft.policies import EveryNSteps, Never
    from pipedream_ft import CheckpointConfig, PipelineConfig, PipelineTrainer

    torch.set_num_threads(1)
    stamps: list[float] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # the pre-flight pass runs without gradients
            stamps.append(time.perf_counter())
        return nn.functional.cross_entropy(out, target)

    model = mlp(cfg.width, cfg.blocks)
    params = sum(p.numel() for p in model.parameters())
    plan = mlp_plan(model, cfg.stages)
    futures: list[Any] = []
    holder: dict[str, Any] = {}

    def backlog() -> int:
        if cfg.storage == "dcp":
            return sum(1 for f in futures if not f.done())
        return holder["writer"].backlog if "writer" in holder else 0

    policy = Never() if cfg.storage == "none" else _busy_policy(EveryNSteps(cfg.every), backlog)
    local_url = cfg.url if cfg.storage != "dcp" else cfg.url + "-pdft-unused"
    trainer = PipelineTrainer(
        model, plan, loss_fn=loss_fn, optimizer_factory=make_optimizer(cfg.optimizer),
        config=PipelineConfig(timeout_s=cfg.timeout_s, watchdog_s=cfg.timeout_s + 30),
        checkpoint=CheckpointConfig(url=local_url, storage_options=cfg.storage_options, policy=policy, keep=2,
                                    commit_timeout_s=cfg.timeout_s),
    )
    assert trainer.ckpt is not None
    writer = trainer.ckpt.writer
    if cfg.storage == "local-nice19":  # the same writer with its persist thread at nice 19
        from pipedream_ft.checkpoint import CheckpointWriter

        writer.close()
        writer = trainer.ckpt.writer = CheckpointWriter(
            writer.storage, writer.part_name, expected_parts=list(writer.expected_parts),
            is_committer=writer.is_committer, keep=writer.keep, commit_timeout_s=writer.commit_timeout_s,
            metadata=writer.metadata, persist_nice=19)
    holder["writer"] = writer
    handles: list[tuple[float, Any]] = []
    save = writer.save

    observed: set[int] = set()

    def observe_finished() -> None:
        for _, h in handles:
            if h.done() and h.step not in observed and trainer.is_first:
                policy.observe(persist_s=h.persist_s, persist_cpu_s=h.persist_cpu_s, commit_s=h.commit_s)
                observed.add(h.step)

    def pdft_save(step: int, state: Any, metadata: Any = None) -> Any:
        # the runtime marks the weight versions (and the parameters, which equal the newest one) immutable:
        # the snapshot references them instead of copying
        begun = time.time()
        handle = save(step, state, metadata)
        handles.append((begun, handle))
        observe_finished()
        if trainer.is_first:
            policy.observe(blocking_s=handle.snapshot_s)
        return handle

    def dcp_save(step: int, state: Any, metadata: Any = None) -> Any:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        begun, t0 = time.time(), time.perf_counter()
        fut = dcp.async_save(_str_keys(state), no_dist=True, storage_writer=FileSystemWriter(
            f"{cfg.url}/step-{step:010d}-stage{trainer.stage_index}"))
        handle = SaveHandle(step, time.perf_counter() - t0)

        def done(f: Any) -> None:
            handle.persist_s = time.perf_counter() - t0 - handle.snapshot_s
            handle.error = f.exception()
            handle.finished_at = time.time()
            handle._event.set()

        fut.add_done_callback(done)
        futures.append(fut)
        handles.append((begun, handle))
        return handle

    def cut_only(step: int, state: Any, metadata: Any = None) -> Any:
        # the runtime's side of a cut (capturing the state) without any writer: what a cut costs by itself
        handle = SaveHandle(step, 0.0)
        handle.persist_s, handle.finished_at = 0.0, time.time()
        handle._event.set()
        handles.append((time.time(), handle))
        return handle

    if cfg.storage == "dcp":
        writer.save = dcp_save  # type: ignore[method-assign]
    elif cfg.storage == "cut-only":
        writer.save = cut_only  # type: ignore[method-assign]
    else:
        writer.save = pdft_save  # type: ignore[method-assign]
    trainer.fit(make_data(cfg.batch, cfg.width), cfg.minibatches)
    for f in futures:
        f.result(timeout=cfg.timeout_s)
    for _, h in handles:
        h.wait(cfg.timeout_s)
    out: dict[str, Any] = {"stage": trainer.stage_index, "params": params, "stamps": stamps if trainer.is_last else [],
                           "deferred": policy.deferred if trainer.is_first and cfg.storage != "none" else 0,
                           "saves": [{"step": h.step, "stage": trainer.stage_index, "begun": begun,
                                      "snapshot_s": h.snapshot_s, "persist_s": h.persist_s,
                                      "persist_cpu_s": h.persist_cpu_s, "bytes": h.bytes,
                                      "finished_at": h.finished_at,
                                      "error": None if h.error is None else str(h.error)[:200]}
                                     for begun, h in handles]}
    if trainer.env.rank == 0 and cfg.storage in ("local", "local-nice19", "s3"):
        storage = trainer.ckpt.storage
        out["commits"] = {}
        for step in list_committed(storage):
            record = read_commit(storage, step)
            out["commits"][step] = {"parts": {name: p.size for name, p in record.parts.items()},
                                    "wall_time": record.wall_time}
    trainer.close()
    return out


# -- one run --------------------------------------------------------------------------------------------------


def in_run_overheads(stamps: list[float], every: int) -> list[float]:
    """Overhead of each checkpoint measured inside one run, against the same run's other minibatches.

    For the interval starting at cut ``c`` (a multiple of ``every``): the minibatches ``c - 1 .. c + every/2 - 1``
    (the save and its background persist) are compared with the median of ``c + every/2 .. c + every - 2`` (the
    same interval, storage quiet): ``(sum(affected) - len(affected) * median(quiet)) / (every * median(quiet))``.
    Load that drifts over seconds cancels out; on a ``none`` run (no checkpoint at ``c``) this gives the noise
    floor. Returns one value per complete interval.
    """
    d = [b - a for a, b in zip(stamps, stamps[1:])]  # d[k - 1]: minibatch k - 1 -> k
    out = []
    for c in range(every, len(d) - every + 1, every):
        affected = d[c - 2: c - 1 + every // 2]
        quiet = d[c - 1 + every // 2: c - 2 + every]
        if len(quiet) < 3:
            continue
        base = statistics.median(quiet)
        out.append((sum(affected) - len(affected) * base) / (every * base))
    return out


def cut_profile(stamps: list[float], every: int, before: int = 2, after: int = 12) -> list[float]:
    """Mean excess duration of the minibatches around each cut (offsets ``-before .. after``) over the quiet
    median of the same interval: where in time a checkpoint costs."""
    d = [b - a for a, b in zip(stamps, stamps[1:])]
    rows = []
    for c in range(every, len(d) - every + 1, every):
        quiet = d[c - 1 + every // 2: c - 2 + every]
        if len(quiet) < 3 or c - 1 - before < 0:
            continue
        base = statistics.median(quiet)
        rows.append([d[c - 1 + k] - base for k in range(-before, after + 1)])
    return [statistics.mean(col) for col in zip(*rows)] if rows else []


def run_once(cfg: RunConfig, timeout_s: float = 300.0) -> RunResult:
    """Train once on ``cfg.stages`` spawned processes and measure (see the module docstring)."""
    from dist_helpers import run_world

    load = os.getloadavg()[0]
    outcomes = run_world(_rank_main, cfg.stages, cfg, timeout=timeout_s)
    parts = [payload for _, payload in outcomes.values()]
    last = next(p for p in parts if p["stamps"])
    stamps = last["stamps"]
    half = max(1, cfg.every // 2)
    k0, k1 = half, len(stamps) - half
    per = (stamps[k1] - stamps[k0]) / (k1 - k0)
    saves = sorted((s for p in parts for s in p["saves"]), key=lambda s: (s["step"], s["stage"]))
    saves_in_window = len({s["step"] for s in saves if k0 < s["step"] <= k1})
    commits: dict[int, dict[str, Any]] = {}
    for p in parts:
        for step, c in (p.get("commits") or {}).items():
            begun = min((s["begun"] for s in saves if s["step"] == step), default=None)
            commits[int(step)] = {"parts": c["parts"],
                                  "latency_s": None if begun is None else c["wall_time"] - begun}
    if cfg.storage == "dcp":  # no commit record: the latest stage's save finishing stands for it
        for step in {s["step"] for s in saves}:
            mine = [s for s in saves if s["step"] == step]
            if all(s["finished_at"] for s in mine):
                commits[step] = {"parts": {}, "latency_s": max(s["finished_at"] for s in mine)
                                 - min(s["begun"] for s in mine)}
    deferred = sum(p.get("deferred", 0) for p in parts)
    return RunResult(config=cfg, s_per_minibatch=per, saves_in_window=saves_in_window, load_before=load,
                     saves=saves, deferred=deferred, commits=commits, params=last["params"],
                     in_run=in_run_overheads(stamps, cfg.every), profile=cut_profile(stamps, cfg.every))


# -- bandwidth ------------------------------------------------------------------------------------------------


def disk_bandwidth(directory: Path, mb: int = 256) -> float:
    """MB/s of writing ``mb`` MB to a new file in ``directory`` and fsyncing it (buffered writes, 8 MB each)."""
    data = os.urandom(8 << 20)
    path = directory / "bandwidth.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(mb // 8):
            os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return mb / dt


def s3_bandwidth(server: Any, mb: int = 64) -> float:
    """MB/s of putting one ``mb`` MB object to the S3 server (s3fs, as the checkpoint storage does)."""
    import s3fs

    fs = s3fs.S3FileSystem(**server.storage_options)
    data = os.urandom(mb << 20)
    path = f"{server.bucket}/bandwidth.bin"
    t0 = time.perf_counter()
    fs.pipe_file(path, data)
    dt = time.perf_counter() - t0
    fs.rm_file(path)
    return mb / dt


# -- the benchmark --------------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None or x != x else f"{1000 * x:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--minibatches", type=int, default=None, help="default: 3 x --every (at least 60)")
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    ap.add_argument("--storages", default="local,dcp,s3",
                    help="comma-separated: local, dcp, s3, local-nice19 (persist thread at nice 19)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    ap.add_argument("--s3-nice", type=int, default=0,
                    help="nice value of the SeaweedFS server (19: its CPU stands aside, as a remote server's would)")
    ap.add_argument("--profile", action="store_true", help="print where around a cut the time goes")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 1
    if args.minibatches is None:
        args.minibatches = max(3 * args.every, 60 // args.every * args.every or args.every)
    if args.minibatches % args.every or args.minibatches < 3 * args.every:
        ap.error("--minibatches must be a multiple of --every and at least 3 times it")
    storages = [s.strip() for s in args.storages.split(",") if s.strip()]
    for s in storages:
        if s not in ("local", "local-nice19", "dcp", "s3", "cut-only"):
            ap.error(f"unknown storage {s!r}")

    base = Path(tempfile.mkdtemp(prefix="pdft-bench-ckpt-"))
    results: dict[str, list[RunResult]] = {k: [] for k in ["none", *storages]}
    order = ["none", *storages]
    disk_bw: list[float] = []
    s3_bw: list[float] = []
    print(f"checkpoint overhead: {args.stages} stages, MLP {args.blocks}x{args.width}, batch {args.batch}, "
          f"{args.optimizer}, {args.minibatches} minibatches, checkpoint every {args.every}; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
    try:
        for r in range(args.rounds):
            rotated = order[r % len(order):] + order[: r % len(order)]
            disk_bw.append(disk_bandwidth(base))
            for kind in rotated:
                server = None
                run_dir = base / f"r{r}-{kind}"
                run_dir.mkdir()
                common = dict(every=args.every, minibatches=args.minibatches, stages=args.stages, width=args.width,
                              blocks=args.blocks, batch=args.batch, optimizer=args.optimizer,
                              timeout_s=min(120.0, args.timeout))
                try:
                    if kind == "s3":
                        from s3server import SeaweedS3

                        server = SeaweedS3(run_dir / "seaweed", nice=args.s3_nice)
                        server.start()
                        s3_bw.append(s3_bandwidth(server))
                        cfg = RunConfig(kind, server.url(f"bench-{r}"), server.storage_options, **common)
                    else:
                        cfg = RunConfig(kind, str(run_dir / "ckpt"), None, **common)
                    res = run_once(cfg, timeout_s=args.timeout)
                finally:
                    if server is not None:
                        server.stop()
                    shutil.rmtree(run_dir, ignore_errors=True)
                results[kind].append(res)
                print(f"  round {r} {kind:5s}: {1000 * res.s_per_minibatch:7.2f} ms/minibatch "
                      f"(load {res.load_before:.2f}, {res.saves_in_window} saves in window, "
                      f"{res.deferred} deferred)", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    params = results["none"][0].params
    print(f"\nmodel: {params / 1e6:.2f}M parameters; steady state between minibatch {args.every // 2} and "
          f"{args.minibatches - args.every // 2}\n")
    head = f"{'storage':12s} {'writer':22s} " + " ".join(f"{'round ' + str(r):>9s}" for r in range(args.rounds)) \
        + f" {'median':>9s} {'overhead':>9s}  per-round overheads"
    print(head)
    print("-" * len(head))
    none_t = [x.s_per_minibatch for x in results["none"]]
    writer_names = {"none": "Never()", "local": "pdft, local disk", "local-nice19": "pdft nice 19, local",
                    "dcp": "DCP async_save, local", "cut-only": "cuts, no writer",
                    "s3": "pdft, SeaweedFS S3"}
    overheads: dict[str, float] = {}
    for kind in order:
        ts = [x.s_per_minibatch for x in results[kind]]
        cells = " ".join(f"{1000 * t:8.2f}m" for t in ts)
        if kind == "none":
            print(f"{kind:12s} {writer_names[kind]:22s} {cells} {1000 * _median(ts):8.2f}m {'':>9s}")
            continue
        per_round = [(t - n) / n for t, n in zip(ts, none_t)]
        overheads[kind] = ov = _median(per_round)
        print(f"{kind:12s} {writer_names[kind]:22s} {cells} {1000 * _median(ts):8.2f}m {100 * ov:8.2f}%  "
              + ", ".join(f"{100 * o:+.1f}%" for o in per_round))
    print(f"(times in ms per minibatch, checkpoint every {args.every}; overhead = median over rounds of "
          "(t_ckpt - t_none) / t_none against the same round's none run)")
    in_run: dict[str, float] = {}
    print("\nin-run overhead per checkpoint interval (affected minibatches vs the same interval's quiet ones; "
          "none = noise floor):")
    for kind in order:
        xs = [x for r in results[kind] for x in r.in_run]
        if xs:
            in_run[kind] = _median(xs)
            q = statistics.quantiles(xs, n=4) if len(xs) >= 4 else [float("nan")] * 3
            print(f"  {kind:12s} median {100 * in_run[kind]:+6.2f}%  (quartiles {100 * q[0]:+.2f}% / "
                  f"{100 * q[2]:+.2f}%, {len(xs)} intervals)")

    if args.profile:
        print("\nexcess ms per minibatch around a cut (offset 0: the first minibatch after the save), mean over cuts:")
        print(f"  {'':12s} " + " ".join(f"{k:>5d}" for k in range(-2, 13)))
        for kind in order:
            rows = [r.profile for r in results[kind] if r.profile]
            if rows:
                mean = [statistics.mean(col) for col in zip(*rows)]
                print(f"  {kind:12s} " + " ".join(f"{1000 * x:5.1f}" for x in mean))
    print(f"\n{'storage':12s} {'stage':>5s} {'saves':>5s} {'part MB':>8s} {'blocking ms':>16s} "
          f"{'persist ms':>18s} {'persist CPU ms':>15s} {'commit latency ms':>18s} {'failed':>6s}")
    print(f"{'':12s} {'':5s} {'':5s} {'':8s} {'median / max':>16s} {'median / max':>18s} {'median':>15s} "
          f"{'median / max':>18s}")
    blocking: dict[str, float] = {}
    for kind in storages:
        runs = results[kind]
        saves = [s for x in runs for s in x.saves]
        latencies = [c["latency_s"] for x in runs for c in x.commits.values() if c["latency_s"] is not None]
        blocking[kind] = max(_median([s["snapshot_s"] for s in saves if s["stage"] == st] or [float("nan")])
                             for st in range(args.stages))
        for stage in range(args.stages):
            mine = [s for s in saves if s["stage"] == stage]
            snap = [s["snapshot_s"] for s in mine]
            pers = [s["persist_s"] for s in mine if s["persist_s"] is not None]
            cpu = [s["persist_cpu_s"] for s in mine if s.get("persist_cpu_s") is not None]
            failed = sum(1 for s in mine if s["error"])
            lat = f"{_fmt_ms(_median(latencies)):>8s} / {_fmt_ms(max(latencies) if latencies else None):>7s}" \
                if stage == 0 else ""
            sizes = [s["bytes"] for s in mine if s.get("bytes")]
            size = f"{_median(sizes) / 1e6:.1f}" if sizes else "-"
            print(f"{kind:12s} {stage:5d} {len(mine):5d} {size:>8s} "
                  f"{_fmt_ms(_median(snap)):>7s} / {_fmt_ms(max(snap) if snap else None):>6s} "
                  f"{_fmt_ms(_median(pers)):>8s} / {_fmt_ms(max(pers) if pers else None):>7s} "
                  f"{_fmt_ms(_median(cpu)):>15s} {lat:>18s} {failed:6d}")
    print("(blocking: the save call, training waits for it; persist: background, call -> part durable; persist "
          "CPU: the persist thread's CPU time; commit latency: first save call -> COMMIT.json written (dcp: the "
          "last stage's save done))")
    if "local" in blocking and "dcp" in blocking:
        print(f"blocking time per checkpoint (slowest stage's median), pdft / DCP async_save in this run: "
              f"{blocking['local'] / blocking['dcp']:.2f}x (target <= 0.5x); background CPU per GB: see "
              "bench_checkpoint_write.py")
    deferred = {k: sum(x.deferred for x in results[k]) for k in storages}
    print("checkpoints deferred because the previous one was not finished (interval stretched): "
          + ", ".join(f"{k} {v}" for k, v in deferred.items()))
    if "s3" in storages:
        print(f"SeaweedFS server ran on this machine at nice {args.s3_nice}")
    print(f"\nwrite bandwidth measured in this run: disk {_median(disk_bw):.0f} MB/s (256 MB, buffered, fsync)"
          + (f", S3 server {_median(s3_bw):.0f} MB/s (one 64 MB put)" if s3_bw else ""))
    t_none = _median(none_t)
    for kind in storages:
        saves = [s for x in results[kind] for s in x.saves]
        mb = sum(_median([s["bytes"] or 0 for s in saves if s["stage"] == st] or [0]) for st in range(args.stages))
        if mb:
            need = mb / 1e6 / (args.every * t_none)
            print(f"  {kind}: a checkpoint ({mb / 1e6:.0f} MB, all stages) every {args.every} x {1000 * t_none:.1f} ms "
                  f"needs {need:.0f} MB/s")
    if args.every == 100:
        for kind, target in TARGETS.items():
            if kind in overheads:
                ov, ir = overheads[kind], in_run.get(kind, float("nan"))
                print(f"{kind}: overhead at every 100: {100 * ov:.2f}% across runs, {100 * ir:.2f}% in-run "
                      f"(target {100 * target:.0f}%: {'met' if ov <= target else 'missed'} across runs, "
                      f"{'met' if ir <= target else 'missed'} in-run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
