"""The torchrun training script of the recovery benchmark (:mod:`bench_recovery`).

Trains the fault-tolerance benchmarks' MLP (:mod:`ft_bench_worker`: ``--blocks`` ``Linear(width, width) +
ReLU`` blocks, 8.4M parameters by default) as a straight 4-stage pipeline until ``--total`` minibatches, under
:func:`pipedream_ft.launch` (``PIPEDREAM_FT_RECOVERY`` picks in-place recovery or torchrun restarts).
``--kills R:S,R:S,...``: the ``k``-th entry kills rank ``R`` (SIGKILL, or SIGSTOP with ``--hang``) as it starts
the forward of minibatch ``S`` in the group's attempt ``k`` (restart count plus in-place recoveries), after
writing the time to ``--events/kill-k.json``. ``--supervisor``: SIGKILL the rank's supervisor (the torchrun
worker process, the training process's parent) instead; ``--double S``: the replacement of a killed process
kills itself too, ``S`` seconds after it starts (while the group forms again). ``--plain``: run as a plain script
(:func:`pipedream_ft.exit_on_error`, no :func:`pipedream_ft.launch`).

Every process writes ``--events/r{rank}-a{attempt}-i{incarnation}.json``: when its interpreter started running
this file (``started``; a forked replacement inherits its supervisor's), when ``main`` started, the trainer's
milestones (``timeline``: start, joined, formed, restored, first_update) and, for the processes that survived
failures, one record per in-place recovery (failed, formed, restored, first_update, epoch, cut); the last stage
also the time each minibatch's loss was computed.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ft_bench_worker import make_data, make_optimizer, mlp, mlp_plan  # noqa: E402

import pipedream_ft  # noqa: E402
from pipedream_ft import CheckpointConfig, EveryNSteps, Hooks, PipelineConfig, PipelineTrainer, read_env  # noqa: E402

__all__ = ["main"]


class _Killer(Hooks):
    """Kills this process at the forward of a minibatch, in one attempt of the group, stamping the time first."""

    def __init__(self, kills: list[tuple[int, int]], rank: int, events: Path, hang: bool,
                 supervisor: bool = False) -> None:
        self.kills = kills
        self.rank = rank
        self.events = events
        self.hang = hang
        self.supervisor = supervisor
        self.attempt = 0

    def on_event(self, name: str, **args: Any) -> None:
        if name == "recovered":
            self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + args["epoch"]

    def on_action(self, action: Any) -> None:
        if action.kind != "F" or self.attempt >= len(self.kills):
            return
        rank, step = self.kills[self.attempt]
        if rank == self.rank and action.index >= step:
            (self.events / f"kill-{self.attempt}.json").write_text(
                json.dumps({"time": time.time(), "rank": rank, "step": action.index, "attempt": self.attempt}))
            if self.supervisor:
                os.kill(os.getppid(), signal.SIGKILL)  # the training process dies with it (PDEATHSIG)
                time.sleep(60)
            os.kill(os.getpid(), signal.SIGSTOP if self.hang else signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    main_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", required=True)
    ap.add_argument("--ckpt", default=None, help="durable checkpoints here (default: none)")
    ap.add_argument("--every", type=int, default=50, help="durable checkpoint interval")
    ap.add_argument("--memory-every", type=int, default=4, help="memory-tier checkpoint interval")
    ap.add_argument("--total", type=int, default=200)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--kills", default="")
    ap.add_argument("--hang", action="store_true", help="SIGSTOP instead of SIGKILL")
    ap.add_argument("--supervisor", action="store_true", help="kill the rank's supervisor instead")
    ap.add_argument("--double", type=float, default=None,
                    help="a replacement process kills itself this many seconds after it starts")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    incarnation = read_env().incarnation
    events = Path(args.events)
    events.mkdir(parents=True, exist_ok=True)
    if args.double is not None and incarnation == 1:
        def die() -> None:
            time.sleep(args.double)
            (events / "double.json").write_text(json.dumps({"time": time.time(), "rank": rank}))
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die, daemon=True).start()
    record: dict[str, Any] = {"rank": rank, "attempt": attempt, "incarnation": incarnation, "pid": os.getpid(),
                              "started": STARTED, "main_start": main_start, "timeline": {}, "recoveries": [],
                              "losses_at": []}
    out = events / f"r{rank}-a{attempt}-i{incarnation}.json"

    lock = threading.Lock()

    def dump() -> None:  # from the main thread and the one below: one at a time
        with lock:
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(out)

    stamps: list[float] = record["losses_at"]

    def loss_fn(out_: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            stamps.append(time.time())
        return nn.functional.cross_entropy(out_, target)

    kills = [(int(r), int(s)) for r, s in (k.split(":") for k in args.kills.split(",") if k)]
    model = mlp(args.width, args.blocks)
    plan = mlp_plan(model, int(os.environ.get("WORLD_SIZE", "1")))
    trainer = PipelineTrainer(
        model, plan, loss_fn=loss_fn, optimizer_factory=make_optimizer("sgd"),
        config=PipelineConfig(timeout_s=args.timeout, watchdog_s=args.timeout + 5, summary=False),
        checkpoint=CheckpointConfig(url=args.ckpt, policy=EveryNSteps(args.every),
                                    memory_policy=EveryNSteps(args.memory_every), keep=2, commit_timeout_s=60),
    )
    killer = _Killer(kills, rank, events, args.hang, args.supervisor)
    killer.attempt = trainer.faults.attempt
    trainer.hooks.add(killer)
    record["timeline"] = trainer.timeline
    record["recoveries"] = trainer.recoveries
    dump()

    def keep_dumping() -> None:  # a process killed later keeps what it recorded
        while True:
            time.sleep(0.2)
            dump()

    threading.Thread(target=keep_dumping, daemon=True).start()
    try:
        trainer.fit(make_data(args.batch, args.width), args.total)
    finally:
        record["exit"] = time.time()
        dump()
    trainer.close()


if __name__ == "__main__":
    if "--plain" in sys.argv:  # a plain script: no launch, its failures left to torchrun's restarts
        sys.argv.remove("--plain")
        pipedream_ft.exit_on_error(main)
    else:
        pipedream_ft.launch(main)
