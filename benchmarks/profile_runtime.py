"""Where the runtime's own time goes, per action: the executor profiled on a pipeline of layers that sleep.

Run: ``python benchmarks/profile_runtime.py [--stages 2] [--minibatches 400] [--mode stash] [--top 25]``.

``--stages`` CPU processes (gloo on loopback, one thread each) train the sleep model (:mod:`sleep_model`, F/B =
``--forward-ms``/``--backward-ms``, 0/0 by default so that every CPU second is the runtime's) through
:class:`~pipedream_ft.PipelineTrainer`. Each rank reports its CPU seconds per minibatch over the measured run (the
runtime's fixed cost per minibatch per stage, what ``pipedream-probe`` calls ``stage_overhead_s``), and the middle
rank (or the last, with two stages) runs under ``cProfile``: the functions with the most own time, in microseconds
per minibatch. The profiled rank's figure is slower than the others' by the profiler's own cost.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spawned import run_world  # noqa: E402

__all__ = ["main"]


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rank(stages: int, minibatches: int, mode: str, forward_ms: float, backward_ms: float, top: int,
          profiled: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from partitioner.plan import Plan
    from pipedream_ft import PipelineConfig, PipelineTrainer
    from profiler.layers import structure_profile
    from sleep_model import sleep_model

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])

    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)

    torch.manual_seed(0)
    model = sleep_model(stages, forward_ms, backward_ms)
    prof = structure_profile(model)
    plan = Plan.from_stages([[i] for i in range(stages)], [1] * stages, profile_hash=prof.structure_hash(),
                            layer_names=[layer.name for layer in prof.layers])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.mse_loss,
                              optimizer_factory=lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9),
                              config=PipelineConfig(mode=mode, flush_every=stages, timeout_s=120, backend="gloo",
                                                    summary=False))
    window = 2 * stages * (stages if mode == "flush" else 1)
    trainer.train(data, window)  # warm-up and the pre-flight pass
    n = minibatches - minibatches % window
    profiler = cProfile.Profile() if rank == profiled else None
    cpu0, t0 = _cpu_s(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    trainer.train(data, n)
    if profiler is not None:
        profiler.disable()
    cpu, wall = _cpu_s() - cpu0, time.perf_counter() - t0
    trainer.close()
    out: dict[str, Any] = {"rank": rank, "cpu_ms_per_mb": 1e3 * cpu / n, "wall_ms_per_mb": 1e3 * wall / n}
    if profiler is not None:
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        rows = []
        for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
            if name in ("sleep", "<built-in method time.sleep>"):
                continue
            where = f"{Path(file).name}:{line}({name})" if file != "~" else name
            rows.append((own, cum, calls, where))
        rows.sort(reverse=True)
        out["top"] = [(1e6 * own / n, 1e6 * cum / n, calls / n, where) for own, cum, calls, where in rows[:top]]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--minibatches", type=int, default=400)
    p.add_argument("--mode", default="stash", choices=["stash", "flush", "2bw", "vertical"])
    p.add_argument("--forward-ms", type=float, default=0.0)
    p.add_argument("--backward-ms", type=float, default=0.0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--rank", type=int, default=None, help="the rank to profile (default: the middle one, or the last "
                                                           "of two)")
    a = p.parse_args(argv)
    profiled = a.rank if a.rank is not None else a.stages // 2 if a.stages > 2 else a.stages - 1
    outs = run_world(_rank, (a.stages, a.minibatches, a.mode, a.forward_ms, a.backward_ms, a.top, profiled),
                     a.stages, 600.0, "profile")
    print(f"{a.stages} stages, mode {a.mode}, F/B {a.forward_ms:g}/{a.backward_ms:g} ms, {a.minibatches} minibatches; "
          f"{os.cpu_count()} cores")
    print("rank  CPU ms/minibatch  wall ms/minibatch")
    for o in outs:
        mark = "  (profiled)" if o["rank"] == profiled else ""
        print(f"{o['rank']:>4}  {o['cpu_ms_per_mb']:>16.3f}  {o['wall_ms_per_mb']:>17.3f}{mark}")
    top = next(o["top"] for o in outs if "top" in o)
    print(f"\nrank {profiled}, own time per minibatch (µs), most first")
    print(f"{'own µs':>8} {'cum µs':>8} {'calls':>6}  function")
    for own, cum, calls, where in top:
        print(f"{own:>8.1f} {cum:>8.1f} {calls:>6.1f}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
