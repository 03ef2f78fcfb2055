"""Models, data and per-rank scenarios shared by the runtime tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from partitioner.plan import Plan
from profiler.layers import structure_profile


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
        nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5),
    )


class SkipNet(nn.Module):
    """Not a Sequential: a skip connection that spans stages."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        g = torch.tanh(self.b(h))
        g = torch.tanh(self.c(g))
        return self.d(g + h)


def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + b)
    return torch.randn(6, 12, generator=g), torch.randint(0, 5, (6,), generator=g)


def plan_for(model: nn.Module, stage_layers: list[list[int]], replicas: list[int] | None = None,
             settings: dict | None = None) -> Plan:
    prof = structure_profile(model)
    return Plan.from_stages(stage_layers, replicas or [1] * len(stage_layers), profile_hash=prof.structure_hash(),
                            layer_names=[l.name for l in prof.layers], settings=settings)


def timed_profile(model: nn.Module):
    """The model's structure with made-up, deterministic costs (the same on every rank)."""
    from dataclasses import replace

    from profiler.profile import Profile

    prof = structure_profile(model)
    layers = tuple(replace(l, forward_ms=1.0 + (i % 3), backward_ms=2.0 + (i % 2), activation_bytes=4096.0)
                   for i, l in enumerate(prof.layers))
    return Profile(layers, prof.edges, dict(prof.meta))


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {"sgd": sgd, "adam": adam}
MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "skip": SkipNet}


def train_case(model_name: str, stage_layers: list[list[int]], replicas: list[int] | None, opt: str,
               steps: int, mode: str = "stash", flush_every: int = 4) -> dict[str, Any]:
    """Per-rank body: train and return the gathered weights, losses and stats."""
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = MODELS[model_name]()
    plan = plan_for(model, stage_layers, replicas)
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=OPTIMIZERS[opt],
                              config=PipelineConfig(mode=mode, flush_every=flush_every, timeout_s=60))
    result = trainer.train(data, steps)
    return {"state": trainer.full_state_dict(), "losses": result.losses, "stats": result.stats,
            "stage": trainer.stage_index}


def plain_training(steps: int) -> dict[str, Any]:
    """Reference for a one-stage pipeline: ordinary PyTorch training of the same model."""
    model = mlp()
    opt = sgd(list(model.parameters()))
    losses = []
    for b in range(steps):
        x, y = data(b)
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


def repeating_data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return data(b % 4)


def replicated_case(steps: int) -> list[float]:
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = mlp()
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6], [7, 8]], [2, 1, 1])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=adam,
                              config=PipelineConfig(timeout_s=60))
    return trainer.train(repeating_data, steps).losses


def replicated_cuts_case(steps: int, modes: list[str], ckpt: str) -> dict[str, dict[str, Any]]:
    """The middle stage replicated on two ranks, a checkpoint every 4 minibatches (under ``ckpt/<mode>``), in each
    of ``modes`` in turn: each cut's flags reach one of the replicas in a header, and the other learns them at the
    update they share."""
    from pipedream_ft import CheckpointConfig, EveryNSteps, PipelineConfig, PipelineTrainer

    out = {}
    for mode in modes:
        model = mlp()
        plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6], [7, 8]], [1, 2, 1])
        trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=sgd,
                                  config=PipelineConfig(mode=mode, flush_every=4, timeout_s=60, summary=False),
                                  checkpoint=CheckpointConfig(url=f"{ckpt}/{mode}", policy=EveryNSteps(4),
                                                              defer_when_behind=False))
        result = trainer.train(data, steps)
        assert trainer.ckpt is not None
        trainer.ckpt.flush_durable(timeout=60)
        out[mode] = {"state": trainer.full_state_dict(), "losses": result.losses}
        trainer.close()
    return out


def bad_input_case(kind: str) -> None:
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model: nn.Module = mlp()
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6], [7, 8]])
    if kind == "world":
        plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]])
    elif kind == "model":
        model = nn.Sequential(*list(mlp())[:-1], nn.Linear(24, 7))
    elif kind == "shapes":
        model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(30, 5))
        plan = plan_for(model, [[0, 1], [2, 3], [4]])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=sgd,
                              config=PipelineConfig(timeout_s=30))
    trainer.train(data, 6)


def stuck_peer_case(stuck_rank: int) -> None:
    import os
    import time

    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = mlp()
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6], [7, 8]])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=sgd,
                              config=PipelineConfig(timeout_s=4))
    trainer.preflight(data)
    if int(os.environ["RANK"]) == stuck_rank:
        time.sleep(15)
        raise SystemExit(0)
    trainer.train(data, 12)


# -- a small GPT with tied embeddings and shape arithmetic (value layers) ------------------------------------

GPT_SIZE = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def tiny_gpt() -> nn.Module:
    from pipedream_ft_examples.gpt import gpt

    torch.manual_seed(0)
    return gpt(**GPT_SIZE)


def lm_data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + b)
    ids = torch.randint(0, GPT_SIZE["vocab_size"], (4, GPT_SIZE["block_size"] + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_plan(workers: int, straight: bool = True) -> dict:
    """The partitioner's plan for :func:`tiny_gpt` (profiled once, in the calling process), as JSON."""
    from partitioner.optimizer import partition
    from profiler.measure import profile_model

    model = tiny_gpt()
    profile = profile_model(model, lm_data(0)[0], warmup=0, repeats=1)
    return partition(profile, workers, 1e9, straight=straight).to_json()


def gpt_case(plan_json: dict, steps: int, mode: str = "stash", opt: str = "adam", flush_every: int = 4,
             ckpt: str | None = None, stop_at: int | None = None, schedule: str = "1f1b") -> dict[str, Any]:
    from pipedream_ft import CheckpointConfig, EveryNSteps, PipelineConfig, PipelineTrainer

    plan = Plan.from_json(plan_json)
    trainer = PipelineTrainer(tiny_gpt(), plan, loss_fn=lm_loss, optimizer_factory=OPTIMIZERS[opt],
                              config=PipelineConfig(mode=mode, flush_every=flush_every, timeout_s=60, summary=False,
                                                    schedule=schedule),
                              checkpoint=CheckpointConfig(url=ckpt, policy=EveryNSteps(4), defer_when_behind=False)
                              if ckpt else None)
    target = stop_at if stop_at is not None else steps
    result = trainer.train(lm_data, target - trainer.position)
    if trainer.ckpt is not None:
        trainer.ckpt.flush_durable(timeout=60)
    state = trainer.full_state_dict()
    trainer.close()
    return {"state": state, "losses": result.losses, "resumed": trainer.resumed_from}


def preflight_case(model: nn.Module, plan_json: dict, example: torch.Tensor) -> bool:
    """Only the pre-flight of ``model`` under ``plan`` (raises what it raises)."""
    from pipedream_ft import PipelineConfig, PipelineTrainer

    trainer = PipelineTrainer(model, Plan.from_json(plan_json), loss_fn=lambda out, y: out.float().mean(),
                              optimizer_factory=sgd, config=PipelineConfig(timeout_s=60, summary=False))
    trainer.preflight(lambda b: (example, None))
    trainer.close()
    return True


class PoolNet(nn.Module):
    """A CNN whose middle (ReLU + max-pooling) has no parameters: a stage of its own in the tests."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.act(self.conv(x))), 1))


def image_data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + b)
    return torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)


def paramless_case(url: str, total: int, stop_at: int | None) -> dict[str, Any]:
    """PoolNet on 3 stages, the middle one without parameters, checkpointing every 4 minibatches."""
    from pipedream_ft import CheckpointConfig, EveryNSteps, PipelineConfig, PipelineTrainer

    model = PoolNet()
    plan = plan_for(model, [[0], [1, 2], [3, 4]])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=adam,
                              config=PipelineConfig(timeout_s=60, summary=False),
                              checkpoint=CheckpointConfig(url=url, policy=EveryNSteps(4), defer_when_behind=False))
    result = trainer.train(image_data, (stop_at or total) - trainer.position)
    trainer.ckpt.writer.flush(timeout=60)
    out = {"state": trainer.full_state_dict(), "losses": result.losses, "resumed": trainer.resumed_from,
           "optimizer": trainer.optimizer is not None}
    trainer.close()
    return out


def tied_mismatch_case() -> None:
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = mlp()
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]])
    PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=sgd,
                    config=PipelineConfig(timeout_s=30), tied_parameters=[["0.weight", "8.weight"]])


def planned_schedule_case(recorded: str | None) -> list[str]:
    """A 2-stage flush-mode trainer given ``schedule="plan"`` on a plan that records ``recorded`` as
    ``pipedream-partition --schedule`` would (``None``: records nothing): its first window's actions."""
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = mlp()
    settings = {"schedule": {"name": recorded, "microbatches": 4}} if recorded is not None else None
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]], None, settings)
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=sgd,
                              config=PipelineConfig(mode="flush", flush_every=4, schedule="plan", timeout_s=30,
                                                    summary=False))
    try:
        return [str(a) for a in trainer.schedule(0, 4)]
    finally:
        trainer.close()


def stages_case(stage_layers: list[list[int]], steps: int, schedule: str, options: dict | None = None
                ) -> dict[str, Any]:
    """Per-process body of a job whose schedule gives each process several stages (no checkpointing): train
    ``steps`` minibatches of the MLP in flush mode (windows of 4) with Adam and report what ran, how and where.
    ``options``: ``trace_dir``, ``stream`` (read the data as a list, once, on stage 0), ``save`` (a path for the
    model as safetensors)."""
    import os
    import threading

    from pipedream_ft import PipelineConfig, PipelineTrainer

    options = options or {}
    save = options.get("save")
    model = mlp()
    plan = plan_for(model, stage_layers)
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=adam,
                              config=PipelineConfig(mode="flush", flush_every=4, timeout_s=60, schedule=schedule,
                                                    trace_dir=options.get("trace_dir"), summary=False))
    source = [data(b) for b in range(steps)] if options.get("stream") else data
    result = trainer.train(source, steps)
    threads = {"python": sorted(t.name.split("-")[0] if t.name.startswith("Thread-") else t.name
                                for t in threading.enumerate()),
               "os": len(os.listdir("/proc/self/task"))}
    evaluated = trainer.evaluate(data, 4)
    if save is not None:
        trainer.save_model(save, format="safetensors")
    out = {"state": trainer.full_state_dict(), "losses": result.losses, "threads": threads,
           "world": trainer.connection.group.world_size if hasattr(trainer, "connection") else None,
           "stages": list(getattr(trainer, "stage_indices", [trainer.topo.stage] if hasattr(trainer, "topo") else [])),
           "eval": evaluated.losses, "kind": type(trainer).__name__}
    trainer.close()
    return out
