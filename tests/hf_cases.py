"""Per-rank bodies and data for the Hugging Face models trained on 4 processes (tests/test_hf_pipeline.py).

Minibatches are what a user's DataLoader gives: dicts ``{"input_ids", "attention_mask", "labels"}`` of right-padded
token sequences (padding labelled -100), from a map-style dataset of dict samples in order. The loss is
:func:`profiler.hf.causal_lm_loss` (transformers' own). ``recipe_llama`` is the README's split of a model by
hand: a Llama whose rotary ``(cos, sin)`` tuple is computed once and crosses every stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from hf_models import VOCAB, tiny
from profiler.hf import IGNORE_INDEX, causal_lm_loss, for_pipeline

__all__ = ["BATCH", "LENGTH", "RecipeLlama", "adamw", "hf_case", "hf_cases_in_turn", "loader", "model_for",
           "reference"]

BATCH, LENGTH = 4, 12


def _samples(count: int, seed: int, distinct: int | None = None) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        if distinct is not None and i >= distinct:  # repeat: a loss that can fall in a few steps
            out.append(out[i % distinct])
            continue
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
        keep = int(torch.randint(LENGTH - 4, LENGTH + 1, (1,), generator=g))
        mask = (torch.arange(LENGTH) < keep).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask,
                    "labels": torch.where(mask.bool(), ids, torch.full_like(ids, IGNORE_INDEX))})
    return out


def loader(minibatches: int, seed: int = 0, distinct: int | None = None) -> DataLoader:
    """``minibatches`` dict minibatches of ``BATCH`` samples, in order."""
    return DataLoader(_samples(minibatches * BATCH, seed, None if distinct is None else distinct * BATCH),
                      batch_size=BATCH)


class RecipeLlama(nn.Module):
    """A Llama split by hand, as the README's recipe writes one for a family ``for_pipeline`` does not cover."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.model, self.lm_head = hf.model, hf.lm_head  # the HF model's modules, under its names
        self.pipeline_leaf_modules = (type(hf.model.layers[0]), type(hf.model.norm), type(hf.model.rotary_emb))
        self.pipeline_keep_together = (("model.norm", "lm_head", "<output>"),)  # one stage, whatever the plan

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
        rope = self.model.rotary_emb(hidden, positions)  # (cos, sin): crosses stages as a tuple of tensors
        for layer in self.model.layers:
            hidden = layer(hidden, position_embeddings=rope)  # no mask: sdpa attends causally
        return self.lm_head(self.model.norm(hidden))


def model_for(family: str, inputs: tuple[str, ...]) -> nn.Module:
    if family == "recipe":
        return RecipeLlama(tiny("llama"))
    return for_pipeline(tiny(family, tied=family == "gemma2"), inputs)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def _drop_unused(batch: dict[str, torch.Tensor], inputs: tuple[str, ...]) -> Any:
    if "attention_mask" in inputs:
        return batch
    return ({k: batch[k] for k in inputs}, batch["labels"])  # a (inputs by name, targets) pair


class _Only:
    """The loader's minibatches with only the model's inputs (and the labels)."""

    def __init__(self, source: DataLoader, inputs: tuple[str, ...]) -> None:
        self.source, self.inputs = source, inputs
        self.batches = [_drop_unused(b, inputs) for b in source]

    def __call__(self, b: int) -> Any:
        return self.batches[b]


def data_for(inputs: tuple[str, ...], steps: int, distinct: int | None) -> Any:
    """A DataLoader of dicts for a model that takes the mask; a callable of (dict inputs, labels) otherwise."""
    source = loader(steps, 0, distinct)
    return source if "attention_mask" in inputs else _Only(source, inputs)


def hf_case(family: str, inputs: tuple[str, ...], plan_json: dict[str, Any], mode: str, steps: int, window: int,
            distinct: int | None, out_dir: str) -> dict[str, Any]:
    """One rank: train ``steps`` minibatches, evaluate 2 held-out ones, write the HF directory."""
    import transformers

    from partitioner.plan import Plan
    from pipedream_ft import PipelineConfig, PipelineTrainer

    transformers.logging.set_verbosity_error()
    trainer = PipelineTrainer(model_for(family, inputs), Plan.from_json(plan_json), loss_fn=causal_lm_loss,
                              optimizer_factory=adamw,
                              config=PipelineConfig(mode=mode, flush_every=window, timeout_s=120, summary=False))
    result = trainer.train(data_for(inputs, steps, distinct), steps)
    held_out = loader(2, seed=1)
    evaluation = trainer.evaluate(held_out if "attention_mask" in inputs else _Only(held_out, inputs), 2)
    if family != "recipe":
        trainer.save_pretrained(out_dir, max_shard_bytes=60_000)
    state = trainer.full_state_dict()
    stage = trainer.stage_index
    trainer.close()
    return {"state": state, "losses": result.losses, "eval": evaluation.losses, "stage": stage}


def hf_cases_in_turn(runs: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """One rank: :func:`hf_case` for each argument tuple in turn, each with its own trainer (one spawn for all)."""
    return [hf_case(*args) for args in runs]


def reference(family: str, inputs: tuple[str, ...], steps: int, window: int) -> tuple[nn.Module, list[float], list[float]]:
    """The plain HF model trained like flush mode (one AdamW step per window on the mean loss), its losses and
    its losses on the 2 held-out minibatches."""
    model = tiny(family, tied=family == "gemma2")
    model.train()
    opt = adamw(list(model.parameters()))
    losses = []
    for b, batch in enumerate(loader(steps, 0)):
        kwargs = {k: batch[k] for k in inputs}
        loss = causal_lm_loss(model(**kwargs).logits, batch["labels"])
        losses.append(float(loss.detach()))
        (loss / window).backward()
        if (b + 1) % window == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        held = [float(causal_lm_loss(model(**{k: b[k] for k in inputs}).logits, b["labels"]))
                for b in loader(2, seed=1)]
    return model, losses, held
