"""Convergence of the training modes and delay compensations on the GPT example, simulated in one process.

Each configuration trains ``examples/gpt.py``'s GPT on ``examples/text_data.py``'s text with the one-process
references of the modes' semantics (``tests/pipedream_reference.py``; the runtime is tested exact against
them on real processes): the plain loop, ``flush``, ``stash``, ``vertical`` and ``2bw``, with and without delay
compensation (prediction, delay-aware LR, look-ahead, error feedback; see
``pipedream_ft/pipeline/compensation.py``), for each learning rate of a small sweep, the same number of
minibatches each (``--minibatches``, default 1,000), AdamW. The held-out loss (64 fixed windows) is measured
every ``--eval-every`` minibatches (default 20, a multiple of the stages so that it falls on update boundaries). It writes the curves of each configuration at its
best learning rate (lowest final held-out loss) to ``<out>.png`` (matplotlib) and all curves to ``<out>.csv``,
and prints a table: per configuration, the final held-out loss at its best learning rate against the plain
loop's at its best, and the minibatches it needs to reach the plain loop's held-out loss at minibatch 300 and
at 1,000 (``--targets``; the first evaluation at or below it, ``-`` if never). Error feedback's ``lam`` defaults
to the tokens per minibatch (``--ef-lambda``; see the compensation module). Deterministic given ``--seed``
(one thread per run, whatever ``--jobs``; dropout seeded per stage and minibatch as in the runtime).

    python benchmarks/bench_convergence.py --quick   # a smaller GPT (4 x 32 wide, 32 bytes), 100 minibatches,
                                                     # LR 2e-3, targets at 40 and 100 (about two minutes)
    python benchmarks/bench_convergence.py --small --lrs 2e-3 1e-3   # the smaller GPT, 1,000 minibatches
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from examples.gpt import gpt  # noqa: E402
from examples.text_data import TextData  # noqa: E402
from examples.train_gpt import held_out_loss, lm_loss, make_optimizer  # noqa: E402
from pipedream_ft.pipeline.compensation import Compensation  # noqa: E402
from pipedream_reference import minibatch_sgd_reference, two_bw_reference, weight_stashing_reference  # noqa: E402

Curve = list[tuple[int, float]]
"""(minibatches trained, held-out loss) pairs."""


def configs(ef: float) -> dict[str, tuple[str, Compensation | None]]:
    """The configurations, by name: mode and compensation (``ef``: error feedback's ``lam``)."""
    return {
        "plain": ("plain", None),
        "flush": ("flush", None),
        "stash": ("stash", None),
        "stash+predict": ("stash", Compensation(predict=True)),
        "stash+lr": ("stash", Compensation(lr_scale=True, lr_warmup=100)),
        "stash+lookahead": ("stash", Compensation(lookahead=True)),
        "stash+ef": ("stash", Compensation(error_feedback=ef)),
        "stash+lookahead+ef": ("stash", Compensation(lookahead=True, error_feedback=ef)),
        "vertical": ("vertical", None),
        "vertical+predict": ("vertical", Compensation(predict=True)),
        "vertical+lookahead": ("vertical", Compensation(lookahead=True)),
        "2bw": ("2bw", None),
        "2bw+predict": ("2bw", Compensation(predict=True)),
        "2bw+lookahead": ("2bw", Compensation(lookahead=True)),
        "2bw+ef": ("2bw", Compensation(error_feedback=ef)),
        "2bw+predict+ef": ("2bw", Compensation(predict=True, error_feedback=ef)),
    }


NAMES = list(configs(1.0))

SIZE: dict[str, int] = {}
"""The GPT's size (empty: ``examples/gpt.py``'s default); ``--small`` makes it smaller."""


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return gpt(**SIZE)


def run(mode: str, comp: Compensation | None, lr: float, steps: int, stages: int, data: TextData, plan: Any,
        seed: int, eval_every: int) -> Curve:
    """Train one configuration; its held-out loss every ``eval_every`` minibatches (and at the end)."""
    opt: Callable[..., Any] = make_optimizer("adamw", lr)
    model = _model(seed)
    probe = _model(seed)
    curve: Curve = []

    def on_update(done: int, modules: list[torch.nn.Module]) -> None:
        if done % eval_every and done != steps:
            return
        state: dict[str, torch.Tensor] = {}
        for m in modules:
            state.update(m.state_dict())
        probe.load_state_dict(state)
        with torch.no_grad():
            curve.append((done, held_out_loss(probe, data, 64)))

    if mode == "plain":
        minibatch_sgd_reference(model, data, lm_loss, opt, steps, 1, on_update=on_update)
    elif mode == "flush":
        minibatch_sgd_reference(model, data, lm_loss, opt, steps, stages, on_update=on_update)
    elif mode == "2bw":
        two_bw_reference(model, plan, data, lm_loss, opt, steps, stages, compensation=comp, on_update=on_update)
    else:
        weight_stashing_reference(model, plan, data, lm_loss, opt, steps, vertical=mode == "vertical",
                                  compensation=comp, on_update=on_update)
    return curve


def _timed_run(task: tuple) -> tuple[Curve, float]:
    t0 = time.perf_counter()
    return run(*task), time.perf_counter() - t0


def reach(curve: Curve, target: float) -> int | None:
    """The first minibatch count whose held-out loss is at or below ``target``."""
    return next((n for n, loss in curve if loss <= target), None)


def loss_at(curve: Curve, n: int) -> float | None:
    return next((loss for m, loss in curve if m == n), None)


def table(curves: dict[str, dict[float, Curve]], targets: list[int], steps: int) -> list[str]:
    """The printed table (see the module docstring)."""
    best = {name: min(by_lr.items(), key=lambda kv: kv[1][-1][1]) for name, by_lr in curves.items()}
    plain = best.get("plain")
    goals = {t: loss_at(plain[1], t) for t in targets} if plain else {}
    head = f"{'configuration':20s} {'best lr':>8s} {'final':>7s} {'vs plain':>9s}" + \
        "".join(f"  {'to plain@' + str(t):>13s}" for t in targets)
    lines = [head]
    if plain:
        lines.append(f"{'(plain loop target)':20s} {'':8s} {'':7s} {'':9s}" +
                     "".join(f"  {g:13.4f}" if g is not None else f"  {'n/a':>13s}" for g in goals.values()))
    for name, (lr, curve) in best.items():
        final = curve[-1][1]
        rel = f"{100 * (final / plain[1][-1][1] - 1):+8.1f}%" if plain else f"{'':9s}"
        cells = []
        for t in targets:
            goal = goals.get(t)
            got = reach(curve, goal) if goal is not None else None
            cells.append(f"  {'n/a' if goal is None else ('-' if got is None else str(got)):>13s}")
        lines.append(f"{name:20s} {lr:8g} {final:7.4f} {rel}" + "".join(cells))
    lines.append(f"({steps} minibatches; 'to plain@N': minibatches to reach the plain loop's held-out loss at N, "
                 "'-' never)")
    return lines


def write_curves(curves: dict[str, dict[float, Curve]], out: Path) -> list[Path]:
    """All curves to ``out.csv``; the best-LR curve per configuration to ``out.png`` if matplotlib is there."""
    written = [out.with_suffix(".csv")]
    with open(written[0], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["configuration", "lr", "minibatches", "held_out_loss"])
        for name, by_lr in curves.items():
            for lr, curve in by_lr.items():
                w.writerows([name, lr, n, f"{loss:.6f}"] for n, loss in curve)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: curves written to the CSV only", file=sys.stderr)
        return written
    fig, ax = plt.subplots(figsize=(10, 6))
    for i, (name, by_lr) in enumerate(curves.items()):
        lr, curve = min(by_lr.items(), key=lambda kv: kv[1][-1][1])
        style = "-" if i < 10 else "--"
        ax.plot([n for n, _ in curve], [loss for _, loss in curve], style, label=f"{name} (lr {lr:g})",
                linewidth=2.5 if name == "plain" else 1.2, color="black" if name == "plain" else None)
    ax.set_xlabel("minibatches")
    ax.set_ylabel("held-out loss")
    ax.set_title("GPT, 4-stage pipeline semantics, AdamW, best LR per configuration")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    finals = [c[-1][1] for by_lr in curves.values() for c in by_lr.values()]
    ax.set_ylim(min(finals) * 0.97, max(finals) * 1.5)
    fig.tight_layout()
    written.append(out.with_suffix(".png"))
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="the smaller GPT, 100 minibatches of 8 x 32 bytes, LR 2e-3, targets 40 100")
    p.add_argument("--minibatches", "--steps", dest="minibatches", type=int, default=1000)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--lrs", type=float, nargs="+", default=[2e-3, 1e-3, 5e-4, 2.5e-4])
    p.add_argument("--configs", nargs="+", choices=NAMES, default=NAMES)
    p.add_argument("--small", action="store_true", help="the smaller GPT of --quick (4 x 32 wide, 32 bytes)")
    p.add_argument("--eval-every", type=int, default=None, help="minibatches between held-out evaluations "
                   "(default: 4 with --quick, else 20); rounded up to a multiple of --stages")
    p.add_argument("--targets", type=int, nargs="+", default=[300, 1000],
                   help="minibatch counts of the plain loop whose held-out loss the others must reach")
    p.add_argument("--ef-lambda", type=float, default=None, help="error feedback's lam (default: tokens per "
                   "minibatch)")
    p.add_argument("--out", type=Path, default=Path("convergence"), help="path of the .png and .csv, no suffix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="configurations trained at once (processes of one thread; "
                   "the same results)")
    args = p.parse_args(argv)
    block, batch = 64, 8
    if args.quick:
        args.minibatches, args.lrs, args.small, args.targets = 100, [2e-3], True, [40, 100]
        args.eval_every = args.eval_every or 4
    if args.small:
        block = 32
        SIZE.update(n_layer=4, n_head=2, n_embd=32, block_size=32)
    eval_every = args.eval_every or 20
    eval_every = -(-eval_every // args.stages) * args.stages
    args.minibatches -= args.minibatches % args.stages
    if args.minibatches < args.stages:
        raise SystemExit(f"--minibatches must be at least --stages ({args.stages}), got {args.minibatches}")
    targets = [-(-t // eval_every) * eval_every for t in args.targets]
    ef = args.ef_lambda if args.ef_lambda is not None else float(block * batch)
    table_of = configs(ef)
    torch.set_num_threads(1)
    from partitioner.optimizer import partition
    from profiler.measure import profile_model

    data = TextData(block, batch, args.seed)
    profile = profile_model(_model(args.seed), data(0)[0], warmup=0, repeats=1)
    plan = partition(profile, args.stages, 1e9, straight=True)
    curves: dict[str, dict[float, Curve]] = {}
    t_all = time.perf_counter()
    jobs = [(name, lr) for name in args.configs for lr in args.lrs]
    tasks = [(*table_of[name], lr, args.minibatches, args.stages, data, plan, args.seed, eval_every)
             for name, lr in jobs]
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs, initializer=torch.set_num_threads,
                                                      initargs=(1,)) as pool:
            results = pool.imap(_timed_run, tasks)
            for (name, lr), (curve, took) in zip(jobs, results):
                curves.setdefault(name, {})[lr] = curve
                print(f"{name:20s} lr {lr:<8g} held-out {curve[-1][1]:.4f}  ({took:.0f} s)", flush=True)
    else:
        for (name, lr), task in zip(jobs, tasks):
            curve, took = _timed_run(task)
            curves.setdefault(name, {})[lr] = curve
            print(f"{name:20s} lr {lr:<8g} held-out {curve[-1][1]:.4f}  ({took:.0f} s)", flush=True)
    print(f"\n{args.minibatches} minibatches of {batch} x {block} bytes, {args.stages} stages, AdamW, error feedback "
          f"lam {ef:g}; best learning rate per configuration ({time.perf_counter() - t_all:.0f} s in all)")
    print("\n".join(table(curves, targets, args.minibatches)))
    for path in write_curves(curves, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
