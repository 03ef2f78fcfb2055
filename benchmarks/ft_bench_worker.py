"""The torchrun training script of the fault-tolerance benchmarks, and the model they share.

Trains an MLP of ``--blocks`` ``Linear(width, width) + ReLU`` blocks (plus a small head) as a straight pipeline
of ``WORLD_SIZE`` stages, checkpointing every ``--every`` minibatches to ``--ckpt``, until ``--total``
minibatches. Every rank of every attempt records what :mod:`bench_recovery` needs in
``--events/r{rank}-a{attempt}.json`` (written at start-up, and again on the way out, normal or not):

- ``proc_start``: ``time.time()`` as the script starts, before torch is imported; ``imported``: once torch,
  ``torch._dynamo`` (which building a torch optimizer imports) and the library are imported;
- ``resume_begin``, ``resume_end``: around the checkpoint load (``Checkpointer.resume``, wrapped here);
- ``pid``, ``rank``, ``attempt``, ``stage``;
- ``timeline``: the trainer's ``start``, ``joined``, ``restored``, ``first_update`` (the file is written again
  as soon as ``first_update`` is set, so a rank killed later still has it);
- ``resumed_from``, ``exit`` (time the script leaves, ``None`` if it was killed), ``error`` (first line), and
  ``minibatch_times`` (last stage: time each minibatch's loss was computed, for throughput).

``--kill RANK:STEP`` kills that rank (SIGKILL, through the library's fault injector) as it starts the forward of
minibatch ``STEP`` on attempt 0, after writing the time to ``--events/fault.json``.
"""

from __future__ import annotations

import time

PROC_START = time.time()

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["mlp", "mlp_plan", "make_data", "make_optimizer", "TimedKill", "main"]


def mlp(width: int = 1024, blocks: int = 10, classes: int = 16) -> nn.Sequential:
    """``blocks`` x (Linear(width, width), ReLU), then Linear(width, classes); seeded, so every rank agrees."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def mlp_plan(model: nn.Sequential, stages: int) -> Any:
    """A straight plan that gives each stage an equal share of the blocks (the head goes to the last)."""
    from partitioner.plan import Plan
    from profiler.layers import structure_profile

    n_blocks = (len(model) - 1) // 2
    if stages < 1 or stages > n_blocks:
        raise ValueError(f"cannot split {n_blocks} blocks into {stages} stages")
    bounds = [round(i * n_blocks / stages) for i in range(stages + 1)]
    stage_layers = [list(range(2 * bounds[i], 2 * bounds[i + 1])) for i in range(stages)]
    stage_layers[-1].append(len(model) - 1)
    prof = structure_profile(model)
    return Plan.from_stages(stage_layers, [1] * stages, profile_hash=prof.structure_hash(),
                            layer_names=[layer.name for layer in prof.layers])


def make_data(batch: int, width: int, classes: int = 16, distinct: int = 8) -> Callable[[int], tuple[Any, Any]]:
    """``data(b)``: ``distinct`` fixed random minibatches, cycled (so producing one costs nothing)."""
    g = torch.Generator().manual_seed(1234)
    xs = [torch.randn(batch, width, generator=g) for _ in range(distinct)]
    ys = [torch.randint(0, classes, (batch,), generator=g) for _ in range(distinct)]

    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return xs[b % distinct], ys[b % distinct]

    return data


def make_optimizer(name: str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``"sgd"`` (momentum 0.9: one state tensor per weight) or ``"adam"`` (two)."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=1e-4)
    raise ValueError(f"unknown optimizer {name!r}")


def _timed_kill_class() -> type:
    from pipedream_ft.ft.faults import FaultInjector

    class _TimedKill(FaultInjector):
        """The library's injector, writing ``time.time()`` to a file just before a fault fires."""

        def __init__(self, faults: list[Any], *, rank: int, attempt: int, stamp: Path) -> None:
            super().__init__(faults, rank=rank, attempt=attempt)
            self.stamp = stamp

        def at_forward(self, step: int) -> None:
            if any(f.kind == "kill" and step >= f.step for f in self.faults):
                self.stamp.write_text(json.dumps({"time": time.time(), "rank": self.rank, "step": step}))
            super().at_forward(step)

    return _TimedKill


def TimedKill(rank: int, step: int, *, me: int, attempt: int, stamp: Path) -> Any:  # noqa: N802
    """A fault injector that SIGKILLs rank ``rank`` at the forward of ``step`` (attempt 0), stamping the time."""
    from pipedream_ft.ft.faults import Fault

    return _timed_kill_class()([Fault("kill", rank, step)], rank=me, attempt=attempt, stamp=stamp)


def _dump_after_first_update(timeline: dict[str, float], dump: Callable[[], None]) -> None:
    """Write the event file again once this attempt's first optimizer step is done (a rank killed later keeps it)."""
    while "first_update" not in timeline:
        time.sleep(0.05)
    dump()


def _time_resume(cls: type, record: dict[str, Any]) -> None:
    """Record when ``cls.resume`` (the checkpoint load, a collective) begins and ends in ``record``."""
    original = cls.resume

    def resume(self: Any) -> Any:
        record["resume_begin"] = time.time()
        try:
            return original(self)
        finally:
            record["resume_end"] = time.time()

    cls.resume = resume  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint URL (a directory or s3://...)")
    ap.add_argument("--storage-options", default=None, help="fsspec storage options as JSON")
    ap.add_argument("--events", required=True, help="directory for the per-rank event files")
    ap.add_argument("--total", type=int, default=60)
    ap.add_argument("--every", type=int, default=10, help="checkpoint every this many minibatches (0: never)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    ap.add_argument("--timeout", type=float, default=10.0, help="PipelineConfig.timeout_s")
    ap.add_argument("--kill", default=None, help="RANK:STEP, on attempt 0")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    importlib.import_module("torch._dynamo")  # building an optimizer imports it: count it as start-up
    from pipedream_ft import checkpointing
    from pipedream_ft import CheckpointConfig
    from pipedream_ft.policies import EveryNSteps, Never
    from pipedream_ft import PipelineConfig, PipelineTrainer

    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = Path(args.events)
    events.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"proc_start": PROC_START, "pid": os.getpid(), "rank": rank, "attempt": attempt,
                              "stage": None, "timeline": {}, "resumed_from": None, "exit": None, "error": None,
                              "minibatch_times": []}
    out = events / f"r{rank}-a{attempt}.json"

    def dump() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(out)

    record["imported"] = time.time()
    dump()
    _time_resume(checkpointing.Checkpointer, record)
    stamps: list[float] = record["minibatch_times"]

    def loss_fn(out_: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # not the pre-flight pass
            stamps.append(time.time())
        return nn.functional.cross_entropy(out_, target)

    trainer = None
    try:
        model = mlp(args.width, args.blocks)
        plan = mlp_plan(model, int(os.environ.get("WORLD_SIZE", "1")))
        options = json.loads(args.storage_options) if args.storage_options else None
        policy = EveryNSteps(args.every) if args.every > 0 else Never()
        trainer = PipelineTrainer(
            model, plan, loss_fn=loss_fn, optimizer_factory=make_optimizer(args.optimizer),
            config=PipelineConfig(timeout_s=args.timeout, watchdog_s=args.timeout + 5),
            checkpoint=CheckpointConfig(url=args.ckpt, storage_options=options, policy=policy, keep=2,
                                        commit_timeout_s=60),
        )
        record.update(stage=trainer.stage_index, resumed_from=trainer.resumed_from, timeline=trainer.timeline)
        dump()
        threading.Thread(target=_dump_after_first_update, args=(trainer.timeline, dump), daemon=True).start()
        if args.kill:
            kill_rank, kill_step = (int(x) for x in args.kill.split(":"))
            trainer.faults = TimedKill(kill_rank, kill_step, me=rank, attempt=attempt, stamp=events / "fault.json")
        trainer.fit(make_data(args.batch, args.width), args.total)
        trainer.close()
    except BaseException as exc:
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        raise
    finally:
        record["exit"] = time.time()
        if trainer is not None:
            record["timeline"] = trainer.timeline
        dump()


if __name__ == "__main__":
    from pipedream_ft.errors import exit_on_error

    exit_on_error(main)
