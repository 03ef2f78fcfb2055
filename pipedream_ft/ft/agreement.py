"""The start-up agreement: before the first minibatch, every rank holds the same plan, model, mode and data contract.

Each rank builds its part of the pipeline from what it was given, so two ranks given different plans (a copy of
the plan file cut elsewhere, a plan partitioned on every rank from a noisy profile) would each run their own cut:
a layer run twice or never, training that succeeds and a wrong model. At start-up every rank therefore publishes a
few *facts* — a digest and a short description of each of :data:`AGREED` — in the fresh namespace its group
agreed on (the job's store, which the start-up uses anyway), reads every other rank's, and, if they differ, stops
with one line (the same on every rank) naming what differs and which ranks hold what::

    ranks disagree on the plan: rank 0 holds 3f9a61c2 (2 stages: [0-3]x1 [4-8]x1), rank 1 holds 77c1d0e4
    (2 stages: [0-2]x1 [3-8]x1); every rank must load the same plan file (profile and partition once, outside
    torchrun)

The facts are cheap and deterministic on every rank: the plan's stages, ranks and recomputed layers (not its
predicted times, which two profiles of one model never share); the names of the model's layers and the names,
shapes and dtypes of its parameters and buffers (not their values); the mode and every setting that changes the
training's semantics; the seed and the checkpoint location. :func:`disagreement` is a pure function of the
gathered facts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch.distributed as dist
from torch import nn

from partitioner.plan import Plan

from ..errors import PipelineSetupError

__all__ = ["AGREED", "AgreementError", "Fact", "Facts", "agree", "data_fact", "disagreement", "mode_fact",
           "model_fact", "plan_fact"]

AGREED = ("plan", "model", "mode", "data")
"""What every rank must hold the same of, in the order a disagreement is reported."""

_WHAT = {
    "plan": ("the plan", "every rank must load the same plan file (profile and partition once, outside torchrun)"),
    "model": ("the model's structure", "every rank must build the same model (layers, parameter shapes and dtypes)"),
    "mode": ("the mode and schedule", "every rank must pass the same PipelineConfig (mode, flush_every, "
                                      "update_every, schedule, ...)"),
    "data": ("the data contract", "every rank must pass the same seed and checkpoint location"),
}

_KEY = "agree/{rank}"
_READ = "agree/read/{rank}"


class AgreementError(PipelineSetupError):
    """The ranks hold different plans, models, modes or data contracts: the same line on every rank."""


@dataclass(frozen=True, slots=True)
class Fact:
    """One thing the ranks must agree on: a digest, and what a person reads when it differs."""

    digest: str
    summary: str

    @staticmethod
    def of(value: Any, summary: str) -> Fact:
        """The fact of a JSON-able ``value`` (its canonical JSON's SHA-256)."""
        text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
        return Fact(hashlib.sha256(text.encode()).hexdigest(), summary)


Facts = Mapping[str, Fact]
"""A rank's facts, by the names of :data:`AGREED`."""


def plan_fact(plan: Plan) -> Fact:
    """The plan's layers, replicas and ranks per stage, its recomputed layers and its model's hash."""
    stages = [[list(s.layers), s.replicas, list(s.ranks)] for s in plan.stages]
    cuts = " | ".join(f"{min(s.layers)}-{max(s.layers)}" + (f" x{s.replicas}" if s.replicas > 1 else "")
                      for s in plan.stages)
    return Fact.of({"profile": plan.profile_hash, "stages": stages, "recompute": sorted(plan.recompute)},
                   f"layers {cuts}")


def model_fact(layer_names: list[str], model: nn.Module) -> Fact:
    """The model's layer names and its parameters' and buffers' names, shapes and dtypes."""
    params = [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    buffers = [(n, list(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    count = sum(p.numel() for _, p in model.named_parameters())
    return Fact.of({"layers": layer_names, "parameters": params, "buffers": buffers},
                   f"{len(layer_names)} layers, {count:,} parameters")


def mode_fact(settings: Mapping[str, Any]) -> Fact:
    """The mode and every setting that changes the training's semantics (``None`` values left out of the text)."""
    shown = ", ".join(f"{k} {v}" for k, v in settings.items() if v is not None)
    return Fact.of(dict(settings), shown)


def data_fact(*, seed: int, checkpoint_url: str | None) -> Fact:
    """What the ranks must share about the data: the seed (minibatch randomness) and where checkpoints resume."""
    return Fact.of({"seed": seed, "checkpoint": checkpoint_url},
                   f"seed {seed}, checkpoints {checkpoint_url or 'none'}")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def disagreement(facts: Mapping[int, Facts]) -> str | None:
    """The one line naming the first of :data:`AGREED` the ranks' ``facts`` differ on (every holder, by digest,
    in rank order), or ``None`` if they agree."""
    for name in AGREED:
        holders: dict[str, list[int]] = {}
        summaries: dict[str, str] = {}
        for rank in sorted(facts):
            fact = facts[rank][name]
            holders.setdefault(fact.digest, []).append(rank)
            summaries.setdefault(fact.digest, fact.summary)
        if len(holders) > 1:
            what, fix = _WHAT[name]
            parts = [f"{_ranks(ranks)} {'holds' if len(ranks) == 1 else 'hold'} {digest[:8]} ({summaries[digest]})"
                     for digest, ranks in sorted(holders.items(), key=lambda kv: kv[1][0])]
            return f"ranks disagree on {what}: {', '.join(parts)}; {fix}"
    return None


def _encode(facts: Facts) -> str:
    return json.dumps({name: [facts[name].digest, facts[name].summary] for name in AGREED})


def _decode(raw: bytes) -> dict[str, Fact]:
    data = json.loads(raw)
    return {name: Fact(*data[name]) for name in AGREED}


def agree(store: dist.Store, *, rank: int, world_size: int, facts: Facts, timeout_s: float) -> None:
    """Publish this rank's ``facts`` in ``store`` (a namespace fresh for this group), read every rank's, and raise
    :class:`AgreementError` with :func:`disagreement`'s line if they differ (on every rank: each reads the same
    facts). A collective of one small write and ``world_size`` reads."""
    missing = [name for name in AGREED if name not in facts]
    if missing:
        raise ValueError(f"facts must name {', '.join(AGREED)}; missing {', '.join(missing)}")
    if world_size <= 1:
        return
    store.set(_KEY.format(rank=rank), _encode(facts))
    keys = [_KEY.format(rank=r) for r in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout_s))
    line = disagreement({r: _decode(store.get(key)) for r, key in enumerate(keys)})
    if line is not None:
        # the store's host (rank 0 without torchrun's agent) leaves last: a rank still reading must not lose it
        store.set(_READ.format(rank=rank), "1")
        if rank == 0:
            store.wait([_READ.format(rank=r) for r in range(world_size)], timedelta(seconds=timeout_s))
        raise AgreementError(line)
