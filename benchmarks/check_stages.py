"""One process holding several stages on one device: the V schedules and the interleaved ones under NCCL.

A single process (a world of one rank) trains the example GPT, with its tied embeddings, as a plan of 2 stages
(ZBV, DualPipeV: both halves of the V on the process) and of 4 stages (interleaved 1F1B, interleaved zero bubble,
looped BFS), in flush mode, and compares the weights with single-process gradient accumulation of the same model
on the same device (largest absolute difference), with the time per minibatch of each. On a GPU the backend is
NCCL (one rank, one GPU: nothing is sent between the stages, the activations and gradients are handed over in
memory); on a machine without one, gloo on the CPU.

Run: ``python benchmarks/check_stages.py [--steps 32] [--flush-every 8] [--device cuda|cpu]``. Exit status 0 when
every schedule ran and matched to ``--atol`` (default 1e-5 on the CPU; 1e-4 on a GPU, whose kernels may add in
another order than the plain model's).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

__all__ = ["main"]

SIZE = dict(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
CASES = [("zbv", 2), ("dualpipev", 2), ("interleaved_1f1b", 4), ("interleaved_zero_bubble", 4), ("looped_bfs", 4)]


def _model() -> nn.Module:
    from pipedream_ft_examples.gpt import gpt

    torch.manual_seed(0)
    return gpt(**SIZE)


def _data(device: torch.device):
    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(5000 + b)
        x = torch.randint(0, SIZE["vocab_size"], (8, SIZE["block_size"] + 1), generator=g)
        return x[:, :-1].to(device), x[:, 1:].to(device)
    return data


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _reference(device: torch.device, steps: int, window: int) -> tuple[dict[str, torch.Tensor], float]:
    """Gradient accumulation on one device: the mean of ``window`` minibatches' losses per step."""
    model = _model().to(device)
    opt = _optimizer(list(model.parameters()))
    data = _data(device)
    t0 = time.perf_counter()
    for b in range(steps):
        x, y = data(b)
        (_loss(model(x), y) / window).backward()
        if (b + 1) % window == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1000 / steps
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, ms


def _plan(stages: int):
    from partitioner.plan import Plan
    from profiler.layers import structure_profile

    prof = structure_profile(_model())
    n = len(prof.layers)
    bounds = [round(i * n / stages) for i in range(stages + 1)]
    return Plan.from_stages([list(range(bounds[i], bounds[i + 1])) for i in range(stages)], [1] * stages,
                            profile_hash=prof.structure_hash(), layer_names=[l.name for l in prof.layers])


def _ours(schedule: str, stages: int, device: torch.device, backend: str, steps: int, window: int
          ) -> tuple[dict[str, torch.Tensor], float, str]:
    from pipedream_ft import PipelineConfig, PipelineTrainer

    trainer = PipelineTrainer(_model(), _plan(stages), loss_fn=_loss, optimizer_factory=_optimizer,
                              config=PipelineConfig(mode="flush", flush_every=window, schedule=schedule,
                                                    backend=backend, timeout_s=120, summary=False))
    try:
        data = _data(device)
        trainer.train(data, window)  # warm-up window (its update counts: the reference trains it too)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train(data, steps - window)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000 / (steps - window)
        return trainer.full_state_dict(), ms, type(trainer).__name__
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=32, help="minibatches per run, a multiple of --flush-every")
    p.add_argument("--flush-every", type=int, default=8)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--atol", type=float, default=None)
    args = p.parse_args(argv)
    if args.steps % args.flush_every or args.steps < 2 * args.flush_every:
        p.error("--steps must be a multiple of --flush-every, at least two windows")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    backend = "nccl" if args.device == "cuda" else "gloo"
    atol = args.atol if args.atol is not None else (1e-4 if args.device == "cuda" else 1e-5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", GROUP_RANK="0", TORCHELASTIC_RUN_ID=f"check-stages-{os.getpid()}")
    want, ref_ms = _reference(device, args.steps, args.flush_every)
    print(f"one process, {backend} on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f"; GPT {SIZE}; plain gradient accumulation: {ref_ms:.2f} ms per minibatch")
    print(f"{'schedule':>24} {'stages':>6} {'trainer':>15} {'max |diff|':>11} {'ms/minibatch':>12} {'/ plain':>8}")
    ok = True
    for schedule, stages in CASES:
        try:
            got, ms, kind = _ours(schedule, stages, device, backend, args.steps, args.flush_every)
        except Exception as exc:  # reported in the table; the other schedules still run
            print(f"{schedule:>24} {stages:>6}  FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            ok = False
            continue
        diff = max(float((got[k] - v).abs().max()) for k, v in want.items())
        good = diff <= atol and sorted(got) == sorted(want)
        ok &= good
        print(f"{schedule:>24} {stages:>6} {kind:>15} {diff:>11.2e} {ms:>12.2f} {ms / ref_ms:>8.2f}"
              + ("" if good else f"  MISMATCH (atol {atol:g})"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
