"""Per-rank bodies and single-process references for the training-feature tests (data sources, LR
scheduler, gradient clipping, mixed precision, evaluation, the final model). Importable by spawned processes."""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from runtime_cases import MODELS as _RUNTIME_MODELS
from runtime_cases import OPTIMIZERS, plan_for, timed_profile

BATCH = 6


class ToyData(Dataset):
    """A map-style dataset of ``n`` (x, y) samples, each a function of its index; counts its reads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        g = torch.Generator().manual_seed(5000 + i)
        return torch.randn(12, generator=g), torch.randint(0, 5, (), generator=g)


def batch_of(ds: Dataset, indices: list[int]) -> Any:
    return default_collate([ds[i] for i in indices])


def sequential_data(ds: ToyData) -> Callable[[int], Any]:
    """The callable equivalent of ``DataLoader(ds, batch_size=BATCH)``."""
    return lambda b: batch_of(ds, list(range(b * BATCH, min((b + 1) * BATCH, len(ds)))))


def bn_net() -> nn.Sequential:
    """BatchNorm and Dropout: what eval mode changes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Dropout(0.3), nn.Linear(24, 24),
                         nn.Tanh(), nn.Linear(24, 5))


MODELS: dict[str, Callable[[], nn.Module]] = {**_RUNTIME_MODELS, "bn": bn_net}


def make_source(kind: str, n: int, *, shuffle_seed: int = 7, epochs: int = 1) -> tuple[Any, ToyData]:
    """A data source of ``kind`` over a fresh ``ToyData(n)``."""
    ds = ToyData(n)
    if kind == "callable":
        return sequential_data(ds), ds
    if kind == "loader":
        return DataLoader(ds, batch_size=BATCH), ds
    if kind == "sdl":
        from torchdata.stateful_dataloader import StatefulDataLoader

        torch.manual_seed(shuffle_seed)  # StatefulDataLoader seeds its sampler from the global generator
        return StatefulDataLoader(ds, batch_size=BATCH, shuffle=True), ds
    if kind == "epochs":
        from pipedream_ft import Epochs

        loader = DataLoader(ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(shuffle_seed))
        return Epochs(loader, epochs), ds
    if kind == "random_nogen":
        return DataLoader(ds, batch_size=BATCH, shuffle=True), ds
    if kind == "generator":
        return (batch_of(ds, list(range(b * BATCH, (b + 1) * BATCH))) for b in range(n // BATCH)), ds
    raise ValueError(kind)


class NoStateScheduler:
    """A scheduler that cannot be checkpointed."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        pass


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0 / (1 + u)),
    "nostate": NoStateScheduler,
}

DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def feature_case(spec: dict[str, Any]) -> dict[str, Any]:
    """Per-rank body: build a trainer from ``spec``, train (possibly resuming), evaluate, save; return what the
    test checks. Keys: model, stages, replicas, mode, flush_every, opt, source, n, epochs, sched, clip,
    autocast, loss_scale, url, every, stop_at, total, eval (n samples), save (path, format), schedule."""
    from pipedream_ft import CheckpointConfig, EveryNSteps, LossScale, PipelineConfig, PipelineTrainer

    model = MODELS[spec.get("model", "mlp")]()
    elastic = spec.get("elastic", False)  # may re-plan for another world size from a checkpoint
    settings = {"workers": [len(spec["stages"])], "bandwidth": [1e9], "straight": True} if elastic else None
    plan = plan_for(model, spec["stages"], spec.get("replicas"), settings)
    source, ds = make_source(spec.get("source", "callable"), spec.get("n", 600), epochs=spec.get("epochs", 1),
                             shuffle_seed=spec.get("shuffle_seed", 7))
    config = PipelineConfig(mode=spec.get("mode", "stash"), flush_every=spec.get("flush_every", 4), timeout_s=60,
                            schedule=spec.get("schedule", "1f1b"),
                            summary=False, clip_grad_norm=spec.get("clip"), autocast_dtype=DTYPES[spec.get("autocast")],
                            loss_scale=LossScale(**spec.get("loss_scale", {})))
    checkpoint = CheckpointConfig(url=spec["url"], policy=EveryNSteps(spec.get("every", 8)),
                                  defer_when_behind=False) if spec.get("url") else None
    sched = spec.get("sched")
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy,
                              optimizer_factory=OPTIMIZERS[spec.get("opt", "sgd")], config=config,
                              checkpoint=checkpoint, scheduler_factory=SCHEDULERS[sched] if sched else None,
                              profile=timed_profile(model) if elastic else None)
    try:
        out: dict[str, Any] = {"resumed": trainer.resumed_from, "stage": trainer.stage_index, "losses": []}
        target = spec.get("stop_at") or spec["total"]
        for chunk in spec.get("chunks", [None]):
            steps = target - trainer.position if chunk is None else chunk
            out["losses"] += trainer.train(source, steps).losses
            if spec.get("eval") and chunk is not None:
                out.setdefault("rng_kept", []).append(_evaluate_keeps_rng(trainer, spec))
        if trainer.ckpt is not None:
            trainer.ckpt.writer.flush(timeout=60)
        out["reads"] = ds.reads
        out["position"] = trainer.position
        out["lr"] = trainer.optimizer.param_groups[0]["lr"] if trainer.optimizer is not None else None
        out["scale"] = trainer.scaler.scale if trainer.scaler is not None else None
        out["skipped"] = trainer.scaler.skipped if trainer.scaler is not None else None
        out["stages"] = [list(st.layers) for st in trainer.plan.stages]
        out["learned"] = {peer: [str(s.dtype) for s in specs] for peer, specs in trainer.messenger._learned.items()}
        out["state"] = trainer.full_state_dict()
        if spec.get("eval"):
            out["eval"] = evaluate_case(trainer, spec)
        if spec.get("save"):
            path, fmt = spec["save"]
            trainer.save_model(path, format=fmt)
        return out
    finally:
        trainer.close()


def stages_feature_case(spec: dict[str, Any]) -> dict[str, Any]:
    """Per-process body for a schedule that gives a process several stages (no checkpointing): train
    ``spec["total"]`` minibatches with ``spec``'s features (keys as :func:`feature_case`'s: stages, mode, schedule,
    flush_every, opt, source, n, sched, clip, autocast, loss_scale, total); return the losses, the weights and
    each stage's learning rate."""
    from pipedream_ft import LossScale, PipelineConfig, PipelineTrainer

    model = MODELS[spec.get("model", "mlp")]()
    plan = plan_for(model, spec["stages"])
    source, _ = make_source(spec.get("source", "callable"), spec.get("n", 600))
    config = PipelineConfig(mode=spec.get("mode", "flush"), flush_every=spec.get("flush_every", 4), timeout_s=60,
                            schedule=spec["schedule"], summary=False, clip_grad_norm=spec.get("clip"),
                            autocast_dtype=DTYPES[spec.get("autocast")],
                            loss_scale=LossScale(**spec.get("loss_scale", {})))
    sched = spec.get("sched")
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy,
                              optimizer_factory=OPTIMIZERS[spec.get("opt", "sgd")], config=config,
                              scheduler_factory=SCHEDULERS[sched] if sched else None)
    try:
        losses = trainer.train(source, spec["total"]).losses
        return {"losses": losses, "state": trainer.full_state_dict(),
                "lr": {st.index: st.state.optimizer.param_groups[0]["lr"] for st in trainer.stages},
                "skipped": [st.scaler.skipped for st in trainer.stages if st.scaler is not None],
                "scale": [st.scaler.scale for st in trainer.stages if st.scaler is not None]}
    finally:
        trainer.close()


def eval_loader(n: int) -> DataLoader:
    """An evaluation loader whose last batch is partial (unless ``n`` is a multiple of BATCH)."""
    return DataLoader(ToyData(n), batch_size=BATCH)


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y).float().mean()


def evaluate_case(trainer: Any, spec: dict[str, Any]) -> dict[str, Any]:
    loader = eval_loader(spec["eval"])
    before = trainer.full_state_dict()
    was = trainer.module.training
    result = trainer.evaluate(loader, len(loader), metric_fn=accuracy)
    after = trainer.full_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    by_callable = trainer.evaluate(sequential_data(ToyData(spec["eval"])), len(loader), metric_fn=accuracy)
    return {"result": result, "unchanged": unchanged, "mode_kept": trainer.module.training == was,
            "callable": by_callable}


def _evaluate_keeps_rng(trainer: Any, spec: dict[str, Any]) -> bool:
    rng = torch.get_rng_state()
    trainer.evaluate(eval_loader(spec["eval"]), math.ceil(spec["eval"] / BATCH), metric_fn=accuracy)
    return torch.equal(rng, torch.get_rng_state())


def eval_refusals_case() -> list[str]:
    """Per-rank body: evaluate() refuses a source shorter than asked and the training source, on every rank,
    and the trainer goes on working after each refusal."""
    from pipedream_ft import PipelineConfig, PipelineSetupError, PipelineTrainer

    model = MODELS["mlp"]()
    trainer = PipelineTrainer(model, plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]]),
                              loss_fn=nn.functional.cross_entropy, optimizer_factory=OPTIMIZERS["sgd"],
                              config=PipelineConfig(timeout_s=30, summary=False))
    try:
        source, _ = make_source("loader", 60)
        trainer.train(source, 4)
        messages = []
        for data, steps in ((eval_loader(20), 5), (source, 2)):
            try:
                trainer.evaluate(data, steps)
            except PipelineSetupError as exc:
                messages.append(str(exc))
        messages.append(f"{trainer.evaluate(eval_loader(20), 4).loss:.6f}")
        return messages
    finally:
        trainer.close()


def bad_case(kind: str, url: str) -> None:
    """Per-rank body of a start that must be refused with one line on every rank."""
    from pipedream_ft import CheckpointConfig, PipelineConfig, PipelineTrainer

    model = MODELS["mlp"]()
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]])
    n = 36 if kind == "short" else 600
    source, _ = make_source({"short": "loader", "random_nogen": "random_nogen", "generator": "generator",
                             "scheduler": "callable", "fp16": "callable"}[kind], n)
    config = PipelineConfig(timeout_s=30, summary=False,
                            autocast_dtype=torch.float16 if kind == "fp16" else None)
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=OPTIMIZERS["sgd"],
                              config=config, checkpoint=CheckpointConfig(url=url),
                              scheduler_factory=SCHEDULERS["nostate"] if kind == "scheduler" else None)
    try:
        trainer.fit(source, 8)
    finally:
        trainer.close()


# -- single-process references ------------------------------------------------------------------------------


def minibatch_reference(model: nn.Module, data: Callable[[int], Any], steps: int, window: int, opt: str, *,
                        sched: str | None = None, clip: float | None = None, autocast: str | None = None,
                        loss_scale: dict[str, Any] | None = None) -> dict[str, Any]:
    """Plain synchronous SGD of the whole model: one step per ``window`` minibatches on the mean of their losses,
    with the scheduler stepped after each step, ``clip_grad_norm_`` over all parameters, forwards (and losses)
    under autocast, and ``torch.amp.GradScaler`` for float16."""
    params = list(model.parameters())
    optimizer = OPTIMIZERS[opt](params)
    scheduler = SCHEDULERS[sched](optimizer) if sched else None
    dtype = DTYPES[autocast]
    scaler = torch.amp.GradScaler("cpu", **(loss_scale or {})) if dtype == torch.float16 else None
    losses, lrs, norms = [], [], []
    skipped = 0
    for w in range(steps // window):
        total = None
        for b in range(w * window, (w + 1) * window):
            x, y = data(b)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(model(x), y)
            losses.append(float(loss.detach()))
            total = loss / window if total is None else total + loss / window
        assert total is not None
        (scaler.scale(total) if scaler is not None else total).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            with warnings.catch_warnings():  # a skipped first step makes torch warn about the order
                warnings.filterwarnings("ignore", "Detected call of")
                scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses, "lrs": lrs,
            "norms": norms, "skipped": skipped, "scale": scaler.get_scale() if scaler is not None else None}


class ClipThenStep:
    """An optimizer for the weight-stashing reference that does what a stage's update does: clip the stage's
    gradient to ``clip`` (per stage), step, then step the scheduler."""

    def __init__(self, params: list[nn.Parameter], opt: str, clip: float | None, sched: str | None) -> None:
        self.params = params
        self.optimizer = OPTIMIZERS[opt](params)
        self.clip = clip
        self.scheduler = SCHEDULERS[sched](self.optimizer) if sched else None

    def step(self) -> None:
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def plain_eval(model: nn.Module, loader: DataLoader) -> tuple[list[float], list[float]]:
    """Per-minibatch losses and accuracies of the plain model in eval mode."""
    model.eval()
    losses, accs = [], []
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            losses.append(float(nn.functional.cross_entropy(out, y)))
            accs.append(float(accuracy(out, y)))
    return losses, accs


def files_under(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
