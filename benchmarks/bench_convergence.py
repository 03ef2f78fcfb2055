"""Convergence of the training modes and delay compensations on the GPT example (or the digits CNN), simulated in
one process, and their predicted time to a target loss at several pipeline depths.

Each configuration trains ``examples/gpt.py``'s GPT on ``examples/text_data.py``'s text with the one-process
references of the modes' semantics (``tests/pipedream_reference.py``; the runtime is tested exact against
them on real processes): the plain loop, ``flush``, ``stash``, ``vertical`` and ``2bw``, with and without delay
compensation (prediction, delay-aware LR, look-ahead, error feedback; see
``pipedream_ft/pipeline/compensation.py``), for each learning rate of a small sweep, the same number of
minibatches each (``--minibatches``, default 1,000, rounded down to a multiple of the depth), AdamW, at each
pipeline depth of ``--stages`` (default 4, 8 and 16): the depth sets the delays (``S - 1 - s`` on stage s for
``stash``, ``S - 1`` for ``vertical``), the flush window and 2BW's update interval (both ``S`` minibatches). The
plan of each depth is ``partitioner.optimizer.partition``'s straight pipeline over the profile's layers with
deterministic costs (parameter plus activation bytes per layer, not measured times, so that the plan and the
results are the same every run); 16 stages cut inside the GPT's blocks. The plain loop does not depend on the
depth and runs once. The held-out loss (64 fixed windows) is measured at the first update at or after every
``--eval-every`` minibatches (default 20, ``--quick`` 4; the plain loop, ``stash`` and ``vertical`` update every
minibatch, ``flush`` and ``2bw`` every ``S``) and at the end. It writes the curves of each configuration at its
best learning rate (lowest final held-out loss), one panel per depth, to ``<out>.png`` (matplotlib), all curves
to ``<out>.csv``, and the time-to-target table below to ``<out>_time.csv``.

It prints, per depth, a table: per configuration, the final held-out loss at its best learning rate against
the plain loop's at its best, and the minibatches it needs to reach the plain loop's held-out loss at minibatch
300 and at 1,000 (``--targets``; the first evaluation at or below it, ``-`` if never); then the predicted time to
each target: those minibatches times the time per minibatch of the mode on the schedule simulator
(``pipedream_ft.schedules``) with the same cost on every stage (F = I = W = 1, B = I + W = 2, no update or
communication time; the sleep model's shape): the asynchronous modes (``stash``, ``vertical``, ``2bw``) run
PipeDream's steady state, ``F + B`` = 3 per minibatch with no bubble; ``flush`` runs one step of ``S``
microbatches (its window) on the best of the synchronous schedules the runtime has (``1f1b``, ``gpipe``,
``zb_h1``): the simulated step time over ``S``. The plain loop is no pipeline and gets no time. Last, whether
issue 18's target holds: at 8 stages the best asynchronous configuration's predicted time to target below the
best synchronous schedule's (``flush``), for every target that either reaches. Error feedback's ``lam`` defaults
to the tokens per minibatch (``--ef-lambda``; see the compensation module). Deterministic given ``--seed``
(one thread per run, whatever ``--jobs``; dropout seeded per stage and minibatch as in the runtime).

``--model digits`` trains the README's first tutorial instead: ``examples/models.py``'s ``digits_cnn`` on
``examples/train_digits.py``'s digits (shipped with scikit-learn, nothing downloaded; minibatches of 32 images,
the example's seeded 20 % held out), Adam as in the example, default 600 minibatches, LRs 3e-3, 1e-3 and 3e-4,
targets 150 and 600, depths 4 and 8 (the CNN has 11 layers), error feedback's ``lam`` the images per minibatch.
Its curves carry the held-out accuracy too (a CSV column), the best learning rate is the highest final held-out
accuracy (ties to the lower loss), and after the loss table it prints, per depth, instead of the time table, a
non-regression table: per configuration its final held-out loss and accuracy, the accuracy against the plain
loop's and, per compensated configuration, against the same mode without compensation: ``ok`` within 1
percentage point or better, else ``REGRESSED``; then the best asynchronous configuration against the plain loop.
No target line and no ``<out>_time.csv``; ``<out>`` defaults to ``convergence_digits``.
It exits 1 if any compensation regressed.

    python benchmarks/bench_convergence.py --quick   # a smaller GPT (4 x 32 wide, 32 bytes), 100 minibatches,
                                                     # LR 2e-3, targets at 40 and 100, 4 and 8 stages
                                                     # (one to two minutes)
    python benchmarks/bench_convergence.py --small --lrs 2e-3 1e-3   # the smaller GPT, 1,000 minibatches
    python benchmarks/bench_convergence.py --model digits --quick   # the digits CNN, 200 minibatches, LR 3e-3,
                                                                    # 4 and 8 stages (about one minute)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from pipedream_ft_examples.gpt import gpt  # noqa: E402
from pipedream_ft_examples.models import digits_cnn  # noqa: E402
from pipedream_ft_examples.text_data import TextData  # noqa: E402
from pipedream_ft_examples.train_digits import DigitsData  # noqa: E402
from pipedream_ft_examples.train_digits import make_optimizer as digits_optimizer  # noqa: E402
from pipedream_ft_examples.train_gpt import held_out_loss, lm_loss, make_optimizer  # noqa: E402
from pipedream_ft.pipeline.compensation import Compensation  # noqa: E402
from pipedream_ft.schedules import Costs, build, simulate  # noqa: E402
from pipedream_reference import minibatch_sgd_reference, two_bw_reference, weight_stashing_reference  # noqa: E402

Curve = list[tuple[int, float, float | None]]
"""(minibatches trained, held-out loss, held-out accuracy: None for the GPT) triples."""

ASYNC_MODES = ("stash", "vertical", "2bw")
SYNC_SCHEDULES = ("1f1b", "gpipe", "zb_h1")
"""The synchronous (flush) schedules the runtime runs, simulated for ``flush``'s time per minibatch."""


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
        "stash+predict+ef": ("stash", Compensation(predict=True, error_feedback=ef)),
        "stash+predict+lr": ("stash", Compensation(predict=True, lr_scale=True, lr_warmup=100)),
        "stash+predict+lr+ef": ("stash", Compensation(predict=True, lr_scale=True, lr_warmup=100, error_feedback=ef)),
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
MODE = {name: mode for name, (mode, _) in configs(1.0).items()}

@dataclasses.dataclass(frozen=True)
class Workload:
    """What is trained: ``"gpt"`` (``examples/gpt.py``'s GPT of ``size``, empty for its default, on
    ``examples/text_data.py``'s text, AdamW) or ``"digits"`` (``examples/models.py``'s ``digits_cnn`` on
    ``examples/train_digits.py``'s digits, Adam, the example's optimizer); ``data(b)`` is minibatch ``b``."""

    name: str
    data: Any
    size: tuple[tuple[str, int], ...] = ()

    def model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return digits_cnn() if self.name == "digits" else gpt(**dict(self.size))

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, target) if self.name == "digits" else lm_loss(out, target)

    def optimizer(self, lr: float) -> Callable[..., Any]:
        return digits_optimizer("adam", lr) if self.name == "digits" else make_optimizer("adamw", lr)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> tuple[float, float | None]:
        """Held-out loss and accuracy: the GPT's 64 fixed windows (no accuracy); the digits example's held-out
        20 % (359 images)."""
        if self.name != "digits":
            return held_out_loss(model, self.data, 64), None
        model.eval()
        out = model(self.data.test_x)
        return (float(torch.nn.functional.cross_entropy(out, self.data.test_y)),
                float((out.argmax(dim=1) == self.data.test_y).float().mean()))


def run(mode: str, comp: Compensation | None, lr: float, steps: int, stages: int, work: Workload, plan: Any,
        seed: int, eval_every: int, extra: tuple[int, ...] = ()) -> Curve:
    """Train one configuration; its held-out loss (and accuracy) at the first update at or after every
    ``eval_every`` minibatches, after minibatch counts ``extra`` and at the end."""
    opt: Callable[..., Any] = work.optimizer(lr)
    data, loss_fn = work.data, work.loss
    model = work.model(seed)
    probe = work.model(seed)
    curve: Curve = []
    mark = [eval_every]

    def on_update(done: int, modules: list[torch.nn.Module]) -> None:
        if done < mark[0] and done != steps and done not in extra:
            return
        if done >= mark[0]:
            mark[0] = (done // eval_every + 1) * eval_every
        state: dict[str, torch.Tensor] = {}
        for m in modules:
            state.update(m.state_dict())
        probe.load_state_dict(state)
        curve.append((done, *work.evaluate(probe)))

    if mode == "plain":
        minibatch_sgd_reference(model, data, loss_fn, opt, steps, 1, on_update=on_update)
    elif mode == "flush":
        minibatch_sgd_reference(model, data, loss_fn, opt, steps, stages, on_update=on_update)
    elif mode == "2bw":
        two_bw_reference(model, plan, data, loss_fn, opt, steps, stages, compensation=comp, on_update=on_update)
    else:
        weight_stashing_reference(model, plan, data, loss_fn, opt, steps, vertical=mode == "vertical",
                                  compensation=comp, on_update=on_update)
    return curve


def _timed_run(task: tuple) -> tuple[Curve, float]:
    t0 = time.perf_counter()
    return run(*task), time.perf_counter() - t0


def make_plan(profile: Any, stages: int) -> Any:
    """The straight plan of ``stages`` stages for ``profile`` with each tensor layer's forward costing its parameter
    plus activation bytes (backward twice that): deterministic, unlike the measured times."""
    layers = tuple(dataclasses.replace(
        layer, forward_ms=(layer.parameter_bytes + layer.activation_bytes) / 1e4 if layer.kind == "tensor" else 0.0,
        backward_ms=2 * (layer.parameter_bytes + layer.activation_bytes) / 1e4 if layer.kind == "tensor" else 0.0,
        weight_backward_ms=None) for layer in profile.layers)
    from partitioner.optimizer import partition

    return partition(dataclasses.replace(profile, layers=layers), stages, 1e9, straight=True)


def reach(curve: Curve, target: float) -> int | None:
    """The first minibatch count whose held-out loss is at or below ``target``."""
    return next((n for n, loss, _ in curve if loss <= target), None)


def loss_at(curve: Curve, n: int) -> float | None:
    return next((loss for m, loss, _ in curve if m == n), None)


def _best(by_lr: dict[float, Curve]) -> tuple[float, Curve]:
    """The best learning rate and its curve: the lowest final held-out loss, or with an accuracy (digits) the
    highest final held-out accuracy, ties to the lower loss."""
    return min(by_lr.items(), key=lambda kv: (-(kv[1][-1][2] or 0.0), kv[1][-1][1]))


def goals_of(plain: dict[float, Curve] | None, targets: list[int]) -> dict[int, float | None]:
    """The plain loop's held-out loss (at its best learning rate) at each target minibatch count."""
    if not plain:
        return {}
    curve = _best(plain)[1]
    return {t: loss_at(curve, t) for t in targets}


def table(curves: dict[str, dict[float, Curve]], targets: list[int], steps: int,
          goals: dict[int, float | None] | None = None) -> list[str]:
    """The printed table (see the module docstring); ``goals``: the target losses (default: the plain curve's)."""
    best = {name: _best(by_lr) for name, by_lr in curves.items()}
    plain = best.get("plain")
    if goals is None:
        goals = {t: loss_at(plain[1], t) for t in targets} if plain else {}
    head = f"{'configuration':20s} {'best lr':>8s} {'final':>7s} {'vs plain':>9s}" + \
        "".join(f"  {'to plain@' + str(t):>13s}" for t in targets)
    lines = [head]
    if goals:
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


def accuracy_table(curves: dict[str, dict[float, Curve]], tolerance: float = 0.01) -> tuple[list[str], list[str]]:
    """The printed non-regression table (digits) and the configurations that regressed: per configuration at its
    best learning rate, the final held-out loss and accuracy and the accuracy against the plain loop's; per
    compensated configuration, against the same mode without compensation: ``ok`` if at most ``tolerance`` below
    it (or better), else ``REGRESSED``; last, the best asynchronous configuration against the plain loop."""
    best = {name: _best(by_lr) for name, by_lr in curves.items()}
    acc: dict[str, float] = {name: curve[-1][2] or 0.0 for name, (_, curve) in best.items()}
    lines = [f"{'configuration':20s} {'best lr':>8s} {'loss':>7s} {'accuracy':>8s} {'vs plain':>9s}  "
             f"{'vs mode':>9s}  check"]
    regressed = []
    for name, (lr, curve) in best.items():
        a = acc[name]
        vs_plain = f"{100 * (a - acc['plain']):+7.2f}pp" if "plain" in acc and name != "plain" else ""
        mode = MODE[name]
        if name == mode or mode not in acc:
            vs_mode, check = "", ""
        else:
            d = a - acc[mode]
            vs_mode, check = f"{100 * d:+7.2f}pp", "ok" if d >= -tolerance - 1e-9 else "REGRESSED"
            if check != "ok":
                regressed.append(name)
        lines.append(f"{name:20s} {lr:8g} {curve[-1][1]:7.4f} {100 * a:7.2f}% {vs_plain:>9s}  {vs_mode:>9s}  {check}")
    asyn = [n for n in best if MODE[n] in ASYNC_MODES]
    if asyn and "plain" in acc:
        top = max(asyn, key=lambda n: (acc[n], -best[n][1][-1][1]))
        lines.append(f"asynchronous vs plain: best asynchronous {top} {100 * acc[top]:.2f}% against the plain loop's "
                     f"{100 * acc['plain']:.2f}% ({100 * (acc[top] - acc['plain']):+.2f} pp)")
    lines.append(f"(held-out accuracy and loss at the end, best LR per configuration (highest accuracy); pp: "
                 f"percentage points; 'vs mode': against the same mode without compensation, ok within "
                 f"{100 * tolerance:g} pp or better)")
    return lines, regressed


def minibatch_times(stages: int, flush_every: int) -> dict[str, tuple[float, float]]:
    """Time per minibatch and bubble fraction, in units of F with F = I = W = 1 on every stage: ``"async"``
    (PipeDream's steady state, F + B, no bubble) and each synchronous schedule over one step of ``flush_every``
    microbatches (simulated step time / ``flush_every``)."""
    costs = Costs.uniform(stages, 1.0, 1.0, 1.0)
    out = {"async": (costs.forward[0] + costs.input_backward[0] + costs.weight_backward[0], 0.0)}
    for name in SYNC_SCHEDULES:
        built = build(name, stages, flush_every)
        t = simulate(built.schedule, costs, built.placement)
        out[name] = (t.step_time / flush_every, t.bubble_fraction)
    return out


Row = dict[str, Any]


def time_rows(curves: dict[str, dict[float, Curve]], goals: dict[int, float | None], stages: int,
              times: dict[str, tuple[float, float]]) -> list[Row]:
    """Per pipelined configuration: best LR, schedule, time per minibatch and, per target, the minibatches to it
    and the predicted time to it (None: never reached or no target)."""
    sync = min(SYNC_SCHEDULES, key=lambda s: times[s][0])
    rows = []
    for name, by_lr in curves.items():
        mode = MODE[name]
        if mode == "plain":
            continue
        lr, curve = _best(by_lr)
        schedule = sync if mode == "flush" else "pipedream"
        per = times[sync if mode == "flush" else "async"][0]
        reached = {t: (reach(curve, g) if g is not None else None) for t, g in goals.items()}
        rows.append({"stages": stages, "configuration": name, "lr": lr, "sync": mode == "flush",
                     "schedule": schedule, "per_minibatch": per, "reached": reached,
                     "time": {t: (None if n is None else n * per) for t, n in reached.items()}})
    return rows


def verdicts(rows: list[Row], targets: list[int]) -> dict[int, tuple[Row | None, Row | None, str]]:
    """Per target: the best asynchronous row, the best synchronous row (least predicted time; None if none
    reaches) and which wins (``"async"``, ``"sync"`` or ``"neither"`` reaches)."""
    out = {}
    for t in targets:
        pick = {}
        for kind in (False, True):
            reached = [r for r in rows if r["sync"] == kind and r["time"].get(t) is not None]
            pick[kind] = min(reached, key=lambda r: r["time"][t]) if reached else None
        a, s = pick[False], pick[True]
        if a is None and s is None:
            win = "neither"
        elif s is None or (a is not None and a["time"][t] < s["time"][t]):
            win = "async"
        else:
            win = "sync"
        out[t] = (a, s, win)
    return out


def time_table(rows: list[Row], targets: list[int], stages: int, times: dict[str, tuple[float, float]]) -> list[str]:
    """The printed time-to-target table of one depth."""
    lines = [f"time per minibatch (F = I = W = 1 per stage, B = I + W): asynchronous {times['async'][0]:g} "
             f"(PipeDream steady state, no bubble); flush, one step of {stages} microbatches: " +
             ", ".join(f"{s} {times[s][0]:.4g} (bubble {100 * times[s][1]:.1f} %)" for s in SYNC_SCHEDULES)]
    head = f"{'configuration':20s} {'schedule':>9s} {'time/mb':>7s}" + \
        "".join(f"  {'mb@' + str(t):>7s} {'time@' + str(t):>9s}" for t in targets) + "  wins"
    lines.append(head)
    wins = verdicts(rows, targets)
    for r in rows:
        cells = []
        marks = []
        for t in targets:
            n, tt = r["reached"].get(t), r["time"].get(t)
            cells.append(f"  {'-' if n is None else str(n):>7s} {'-' if tt is None else f'{tt:.0f}':>9s}")
            a, s, win = wins[t]
            if r is (a if win == "async" else s if win == "sync" else None):
                marks.append(f"@{t}")
        lines.append(f"{r['configuration']:20s} {r['schedule']:>9s} {r['per_minibatch']:7.4g}" + "".join(cells) +
                     ("  " + " ".join(marks) if marks else ""))
    for t in targets:
        a, s, win = wins[t]
        desc = lambda r: "none reaches it" if r is None else f"{r['configuration']} {r['time'][t]:.0f}"  # noqa: E731
        ratio = f" ({s['time'][t] / a['time'][t]:.2f}x)" if a and s else ""
        lines.append(f"plain@{t}: best async {desc(a)}, best sync {desc(s)}: "
                     f"{'async wins' + ratio if win == 'async' else 'sync wins' if win == 'sync' else 'undecided'}")
    lines.append("('mb@N': minibatches to the plain loop's loss at N; 'time@N' = mb@N x time/mb in units of F; "
                 "'wins': least predicted time to that target)")
    return lines


def target_line(rows_by_depth: dict[int, list[Row]], targets: list[int], depth: int = 8) -> str:
    """Issue 18's target: at ``depth`` stages the best asynchronous time to target below the best synchronous one
    for every target that either reaches (and for at least one)."""
    if depth not in rows_by_depth:
        return f"target (best async faster to target than best sync at {depth} stages): not measured ({depth} stages " \
               "not run)"
    wins = verdicts(rows_by_depth[depth], targets)
    decided = [w for _, _, w in wins.values() if w != "neither"]
    met = bool(decided) and all(w == "async" for w in decided)
    detail = "; ".join(f"plain@{t} {w}" for t, (_, _, w) in wins.items())
    no_sync = [r for r in rows_by_depth[depth] if r["sync"]] == []
    note = " (flush not run at this depth)" if no_sync else ""
    return f"target (best async faster to target than best sync at {depth} stages): {'MET' if met else 'NOT MET'}" \
           f" ({detail}){note}"


def write_curves(curves: dict[int, dict[str, dict[float, Curve]]], out: Path, title: str = "GPT") -> list[Path]:
    """All curves to ``out.csv`` (the plain loop as 1 stage); the best-LR curve per configuration to ``out.png``
    (one panel per depth, titled ``title``) if matplotlib is there."""
    written = [out.with_suffix(".csv")]
    with open(written[0], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stages", "configuration", "lr", "minibatches", "held_out_loss", "held_out_accuracy"])
        plain_done = False
        for stages, by_name in curves.items():
            for name, by_lr in by_name.items():
                if name == "plain":
                    if plain_done:
                        continue
                    plain_done = True
                for lr, curve in by_lr.items():
                    w.writerows([1 if name == "plain" else stages, name, lr, n, f"{loss:.6f}",
                                 "" if acc is None else f"{acc:.6f}"] for n, loss, acc in curve)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: curves written to the CSV only", file=sys.stderr)
        return written
    fig, axes = plt.subplots(1, len(curves), figsize=(10 * len(curves), 6), squeeze=False)
    for ax, (stages, by_name) in zip(axes[0], curves.items()):
        for i, (name, by_lr) in enumerate(by_name.items()):
            lr, curve = _best(by_lr)
            style = "-" if i < 10 else "--"
            ax.plot([p[0] for p in curve], [p[1] for p in curve], style, label=f"{name} (lr {lr:g})",
                    linewidth=2.5 if name == "plain" else 1.2, color="black" if name == "plain" else None)
        ax.set_xlabel("minibatches")
        ax.set_ylabel("held-out loss")
        ax.set_title(f"{title}, {stages}-stage pipeline semantics, best LR per configuration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        finals = [c[-1][1] for by_lr in by_name.values() for c in by_lr.values()]
        ax.set_ylim(min(finals) * 0.97, max(finals) * 1.5)
    fig.tight_layout()
    written.append(out.with_suffix(".png"))
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def write_times(rows: list[Row], goals: dict[int, float | None], out: Path) -> Path:
    """The time-to-target rows to ``out_time.csv``, one per depth, configuration and target."""
    path = out.with_name(out.name + "_time.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stages", "configuration", "best_lr", "schedule", "time_per_minibatch", "target",
                    "target_loss", "minibatches_to_target", "time_to_target"])
        for r in rows:
            for t, n in r["reached"].items():
                g, tt = goals.get(t), r["time"][t]
                w.writerow([r["stages"], r["configuration"], r["lr"], r["schedule"], f"{r['per_minibatch']:g}",
                            t, "" if g is None else f"{g:.6f}", "" if n is None else n,
                            "" if tt is None else f"{tt:g}"])
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt", "digits"), default="gpt",
                   help="the GPT on text (default) or the digits CNN (examples/train_digits.py)")
    p.add_argument("--quick", action="store_true",
                   help="GPT: the smaller GPT, 100 minibatches of 8 x 32 bytes, LR 2e-3, targets 40 100, 4 and 8 "
                   "stages; digits: 200 minibatches, LR 3e-3, targets 50 200, 4 and 8 stages")
    p.add_argument("--minibatches", "--steps", dest="minibatches", type=int, default=None,
                   help="minibatches per run (default: GPT 1000, digits 600)")
    p.add_argument("--stages", type=int, nargs="+", default=None,
                   help="pipeline depths (default GPT 4 8 16, digits 4 8; --quick: 4 8)")
    p.add_argument("--lrs", type=float, nargs="+", default=None,
                   help="learning rates (default GPT 2e-3 1e-3 5e-4 2.5e-4, digits 3e-3 1e-3 3e-4)")
    p.add_argument("--configs", nargs="+", choices=NAMES, default=NAMES)
    p.add_argument("--deep-configs", nargs="+", choices=NAMES, default=None,
                   help="the configurations at the depths after the first (default: --configs)")
    p.add_argument("--small", action="store_true", help="the smaller GPT of --quick (4 x 32 wide, 32 bytes)")
    p.add_argument("--eval-every", type=int, default=None, help="minibatches between held-out evaluations "
                   "(default: 4 with --quick, else 20; at the first update at or after each multiple)")
    p.add_argument("--targets", type=int, nargs="+", default=None,
                   help="minibatch counts of the plain loop whose held-out loss the others must reach "
                   "(default GPT 300 1000, digits 150 600)")
    p.add_argument("--ef-lambda", type=float, default=None, help="error feedback's lam (default: tokens per "
                   "minibatch for the GPT, images per minibatch for digits)")
    p.add_argument("--out", type=Path, default=None,
                   help="path of the .png and .csv, no suffix (default convergence, digits convergence_digits)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="configurations trained at once (processes of one thread; "
                   "the same results)")
    args = p.parse_args(argv)
    digits = args.model == "digits"
    block, batch = (1, 32) if digits else (64, 8)
    if args.quick and digits:
        args.minibatches, args.lrs, args.targets = 200, [3e-3], [50, 200]
        args.eval_every = args.eval_every or 4
        args.stages = args.stages or [4, 8]
    elif args.quick:
        args.minibatches, args.lrs, args.small, args.targets = 100, [2e-3], True, [40, 100]
        args.eval_every = args.eval_every or 4
        args.stages = args.stages or [4, 8]
    args.minibatches = args.minibatches or (600 if digits else 1000)
    args.lrs = args.lrs or ([3e-3, 1e-3, 3e-4] if digits else [2e-3, 1e-3, 5e-4, 2.5e-4])
    args.targets = args.targets or ([150, 600] if digits else [300, 1000])
    args.out = args.out or Path("convergence_digits" if digits else "convergence")
    depths = list(dict.fromkeys(args.stages or ([4, 8] if digits else [4, 8, 16])))
    deep = args.deep_configs or args.configs
    size: dict[str, int] = {}
    if args.small and not digits:
        block = 32
        size.update(n_layer=4, n_head=2, n_embd=32, block_size=32)
    eval_every = args.eval_every or 20
    steps = {S: args.minibatches - args.minibatches % S for S in depths}
    for S in depths:
        if S < 1 or args.minibatches < S:
            raise SystemExit(f"--minibatches must be at least each of --stages ({S}), got {args.minibatches}")
    targets = [-(-t // eval_every) * eval_every for t in args.targets]
    ef = args.ef_lambda if args.ef_lambda is not None else float(block * batch)
    table_of = configs(ef)
    torch.set_num_threads(1)
    from profiler.measure import profile_model

    data = DigitsData(batch, args.seed) if digits else TextData(block, batch, args.seed)
    work = Workload(args.model, data, tuple(size.items()))
    profile = profile_model(work.model(args.seed), data(0)[0], warmup=0, repeats=1)
    plans = {S: make_plan(profile, S) for S in depths}
    names_at = {S: [n for n in (args.configs if i == 0 else deep) if n != "plain"] for i, S in enumerate(depths)}
    jobs: list[tuple[int | None, str, float]] = []
    tasks = []
    if "plain" in args.configs:  # the same at every depth: once, to the longest run, evaluated at each depth's end
        for lr in args.lrs:
            jobs.append((None, "plain", lr))
            tasks.append((*table_of["plain"], lr, args.minibatches, 1, work, None, args.seed, eval_every,
                          tuple(sorted(set(steps.values())))))
    for S in depths:
        for name in names_at[S]:
            for lr in args.lrs:
                jobs.append((S, name, lr))
                tasks.append((*table_of[name], lr, steps[S], S, work, plans[S], args.seed, eval_every))
    results: dict[tuple[int | None, str], dict[float, Curve]] = {}
    t_all = time.perf_counter()

    def got(job: tuple[int | None, str, float], curve: Curve, took: float) -> None:
        S, name, lr = job
        results.setdefault((S, name), {})[lr] = curve
        where = "" if S is None else f"{S:2d} stages "
        acc = "" if curve[-1][2] is None else f" accuracy {100 * curve[-1][2]:.2f}%"
        print(f"{where or 'any depth ':10s}{name:20s} lr {lr:<8g} held-out {curve[-1][1]:.4f}{acc}  ({took:.0f} s)",
              flush=True)

    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs, initializer=torch.set_num_threads,
                                                      initargs=(1,)) as pool:
            for job, (curve, took) in zip(jobs, pool.imap(_timed_run, tasks)):
                got(job, curve, took)
    else:
        for job, task in zip(jobs, tasks):
            got(job, *_timed_run(task))
    plain = results.get((None, "plain"))
    goals = goals_of(plain, targets)
    curves: dict[int, dict[str, dict[float, Curve]]] = {}
    rows_by_depth: dict[int, list[Row]] = {}
    what = f"of {batch} images, Adam" if digits else f"of {batch} x {block} bytes, AdamW"
    print(f"\n{args.model}: {args.minibatches} minibatches {what}, error feedback lam {ef:g}; best "
          f"learning rate per configuration ({time.perf_counter() - t_all:.0f} s in all)")
    regressed: list[str] = []
    for i, S in enumerate(depths):
        by_name: dict[str, dict[float, Curve]] = {}
        if plain:
            by_name["plain"] = {lr: [pt for pt in c if pt[0] <= steps[S]] for lr, c in plain.items()}
        by_name.update({n: results[(S, n)] for n in names_at[S]})
        curves[S] = by_name
        layers = [len(st.layers) for st in plans[S].stages]
        fewer = f"; {len(names_at[S])} of the {len(names_at[depths[0]])} pipelined configurations of " \
                f"{depths[0]} stages" if i and set(names_at[S]) != set(names_at[depths[0]]) else ""
        print(f"\n=== {S} stages (layers per stage {layers}){fewer} ===")
        print("\n".join(table(by_name, targets, steps[S], goals)))
        if digits:
            lines, bad = accuracy_table(by_name)
            print()
            print("\n".join(lines))
            regressed += [f"{n} at {S} stages" for n in bad]
            continue
        times = minibatch_times(S, S)
        rows_by_depth[S] = time_rows(by_name, goals, S, times)
        print()
        print("\n".join(time_table(rows_by_depth[S], targets, S, times)))
    print()
    if digits:
        print("non-regression (every compensation's held-out accuracy within 1 pp of its mode's without "
              f"compensation, or better): {'REGRESSED: ' + ', '.join(regressed) if regressed else 'ok'}")
    else:
        print(target_line(rows_by_depth, targets))
    for path in write_curves(curves, args.out, "digits CNN" if digits else "GPT"):
        print(f"wrote {path}")
    if not digits:
        print(f"wrote {write_times([r for rows in rows_by_depth.values() for r in rows], goals, args.out)}")
    return 1 if regressed else 0


if __name__ == "__main__":
    raise SystemExit(main())
