"""Per-rank bodies for the 2BW and delay-compensation tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

from torch import nn

from runtime_cases import MODELS, OPTIMIZERS, data, plan_for


def async_case(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["model"]`` (default the MLP) on ``spec["stages"]`` in ``spec["mode"]`` and return the gathered
    weights, losses and stats. Keys: stages, replicas, mode, update_every, compensation (a dict of
    :class:`Compensation` fields), opt, total, url, every (checkpoint policy), stop_at."""
    from pipedream_ft import CheckpointConfig, EveryNSteps, PipelineConfig, PipelineTrainer
    from pipedream_ft.pipeline.compensation import Compensation

    model = MODELS[spec.get("model", "mlp")]()
    plan = plan_for(model, spec["stages"], spec.get("replicas"))
    comp = spec.get("compensation")
    config = PipelineConfig(mode=spec["mode"], update_every=spec.get("update_every"), timeout_s=60, summary=False,
                            compensation=Compensation(**comp) if comp is not None else None)
    checkpoint = CheckpointConfig(url=spec["url"], policy=EveryNSteps(spec.get("every", 8)),
                                  defer_when_behind=False) if spec.get("url") else None
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy,
                              optimizer_factory=OPTIMIZERS[spec.get("opt", "sgd")], config=config,
                              checkpoint=checkpoint)
    try:
        target = spec.get("stop_at") or spec["total"]
        result = trainer.train(data, target - trainer.position)
        if trainer.ckpt is not None:
            trainer.ckpt.writer.flush(timeout=60)
        return {"state": trainer.full_state_dict(), "losses": result.losses, "stats": result.stats,
                "resumed": trainer.resumed_from, "stage": trainer.stage_index}
    finally:
        trainer.close()
