"""Per-rank bodies for the memory-tier privacy tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime_cases import OPTIMIZERS, data, mlp, plan_for


def memory_tier_case(total: int, negate: bool = False) -> dict[str, Any]:
    """Train the test MLP as 2 stages to ``total`` minibatches with only the memory tier (every 4), resuming
    from it if it holds a cut; ``negate``: start from other weights (another job's). Returns the final weights,
    where training resumed from and the tier's directory (left in place: ``train`` does not end the job)."""
    from pipedream_ft import CheckpointConfig, PipelineConfig, PipelineTrainer
    from pipedream_ft.policies import EveryNSteps

    model = mlp()
    if negate:
        with torch.no_grad():
            for p in model.parameters():
                p.neg_()
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=OPTIMIZERS["adam"],
                              config=PipelineConfig(timeout_s=60),
                              checkpoint=CheckpointConfig(url=None, memory_policy=EveryNSteps(4), memory_keep=2))
    resumed = trainer.resumed_from
    trainer.train(data, total - trainer.position)
    assert trainer.ckpt is not None
    trainer.ckpt.flush_memory(60)
    state = trainer.full_state_dict()
    tier = trainer.ckpt.memory_tier
    trainer.close()
    return {"state": state, "resumed": resumed, "directory": tier.directory if tier is not None else None}
