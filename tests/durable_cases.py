"""Per-rank bodies for the durable-tier tests (importable by spawned processes): a 4-stage run of the test MLP
that checkpoints to a URL, with the storage conditions under test."""

from __future__ import annotations

import os
import resource
from typing import Any

import torch
from torch import nn

from runtime_cases import MODELS, OPTIMIZERS, data, plan_for

STAGES = [[0, 1], [2, 3], [4, 5], [6, 7, 8]]


def durable_case(url: str, total: int, every: int, out: str | None = None, fsize_rank: int | None = None,
                 fsize: int = 4096, commit_timeout_s: float = 60.0) -> dict[str, Any]:
    """Train to ``total`` minibatches, checkpointing every ``every`` (deferring while storage is behind, as
    by default); resume from ``url`` if it holds a checkpoint. ``fsize_rank``: that rank's process may write
    no file larger than ``fsize`` bytes (RLIMIT_FSIZE: its parts fail with EFBIG). ``out``: where rank 0 saves
    the final weights before closing the trainer (which raises if the last checkpoint did not commit)."""
    from pipedream_ft import CheckpointConfig, PipelineConfig, PipelineTrainer
    from pipedream_ft.policies import EveryNSteps

    if fsize_rank == int(os.environ["RANK"]):
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))
    model = MODELS["mlp"]()
    trainer = PipelineTrainer(model, plan_for(model, STAGES), loss_fn=nn.functional.cross_entropy,
                              optimizer_factory=OPTIMIZERS["adam"],
                              config=PipelineConfig(timeout_s=60, summary=False),
                              checkpoint=CheckpointConfig(url=url, policy=EveryNSteps(every), memory_policy=None,
                                                          commit_timeout_s=commit_timeout_s))
    resumed = trainer.resumed_from
    result = trainer.fit(data, total)
    state = trainer.full_state_dict()
    if out is not None and trainer.env.rank == 0:
        torch.save(state, out)
    trainer.close()
    return {"state": state, "resumed": resumed, "losses": result.losses, "position": trainer.position}
