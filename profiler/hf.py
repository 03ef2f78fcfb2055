"""Hugging Face GPT-2 as a pipeline-ready model, split at its block boundaries.

``torch.fx`` cannot trace ``transformers.GPT2LMHeadModel`` (its forward goes through decorators with
``**kwargs``: "co_varnames is too small"), and transformers 5 dropped its own fx tracer. The wrapper from
:func:`gpt2_for_pipeline` recomputes the language model's logits from the HF model's own submodules with a
forward that fx can trace, and lists ``GPT2Block`` in ``pipeline_leaf_modules`` (see
:mod:`profiler.layers`), so each block is one layer::

    wte(input_ids) + wpe(arange(T)) -> drop -> h.0 -> ... -> h.{n-1} -> ln_f -> lm_head

The wrapper holds the HF model's modules themselves (no copies): its submodule paths, and so its
``state_dict`` keys, are exactly the HF model's (``transformer.wte.weight``, ..., ``lm_head.weight``), and
training it trains the HF model. Its ``forward(input_ids)`` returns the same logits as
``model(input_ids).logits`` without an attention mask and without a key/value cache (the blocks then attend
causally). Only the ``"sdpa"`` attention implementation (transformers' default) is supported: with no mask,
it is the one that masks causally by itself.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GPT2ForPipeline", "gpt2_for_pipeline"]

_CAUSAL_WITHOUT_MASK = ("sdpa",)


class GPT2ForPipeline(nn.Module):
    """``GPT2LMHeadModel`` logits from its embeddings, blocks (fx leaves), final LayerNorm and tied head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.transformer = model.transformer
        self.lm_head = model.lm_head
        self.pipeline_leaf_modules: tuple[type, ...] = tuple(dict.fromkeys(type(b) for b in model.transformer.h))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``(B, T)``."""
        t = input_ids.size(1)
        position_ids = torch.arange(t, device=input_ids.device).unsqueeze(0)
        hidden = self.transformer.wte(input_ids) + self.transformer.wpe(position_ids)
        hidden = self.transformer.drop(hidden)
        for block in self.transformer.h:
            hidden = block(hidden)
        return self.lm_head(self.transformer.ln_f(hidden))


def gpt2_for_pipeline(model: nn.Module) -> GPT2ForPipeline:
    """Wrap a ``transformers.GPT2LMHeadModel`` for profiling, planning and pipelining (module docstring).

    Raises ``TypeError`` for another model and ``ValueError`` for a configuration the wrapper does not
    reproduce (cross-attention, an attention implementation other than sdpa).
    """
    from transformers import GPT2LMHeadModel

    if not isinstance(model, GPT2LMHeadModel):
        raise TypeError(f"gpt2_for_pipeline needs a transformers.GPT2LMHeadModel, got {type(model).__name__}")
    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError("gpt2_for_pipeline: models with cross-attention (config.add_cross_attention) are not supported")
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _CAUSAL_WITHOUT_MASK:
        raise ValueError(
            f"gpt2_for_pipeline: attention implementation {impl!r} is not supported; load the model with "
            'attn_implementation="sdpa" (with no mask its blocks then attend causally)'
        )
    return GPT2ForPipeline(model)
