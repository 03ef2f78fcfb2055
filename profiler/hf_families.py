"""How each covered Hugging Face decoder-only family lays out its ``*ForCausalLM`` (see :mod:`profiler.hf`).

A :class:`Family` names, as attribute paths from the ``*ForCausalLM`` model, the parts the generic wrapper
calls in order — token embedding, learned positions, embedding dropout, decoder layers, final norm, head — and
the few ways families differ: how the positions enter (added learned embeddings, or rotary embeddings computed
for each layer), which attention mask a layer takes (causal, or sliding-window for some layers or all), and
how the decoder layer names its inputs. Everything else (Gemma's embedding scale, GPT-NeoX's parallel residual,
QK norms, biases) lives inside the HF modules themselves and needs no description.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "family_of"]


@dataclass(frozen=True, slots=True)
class Family:
    """The parts of one family's ``*ForCausalLM`` the pipeline wrapper calls (attribute paths from the model)."""

    name: str
    embed: str
    """Token embedding (Gemma's scales by ``sqrt(hidden)`` itself)."""
    layers: str
    """The ``nn.ModuleList`` of decoder layers: each one is a pipeline layer."""
    norm: str | None
    """Final norm, kept with the head (``None``: OPT-350m style models without one)."""
    head: str = "lm_head"
    positions: str | None = None
    """Learned position embedding added to the tokens' (GPT-2, OPT); ``None`` for rotary families."""
    positions_kind: str = ""
    """``"gpt2"``: ``wpe(position_ids)``; ``"opt"``: ``embed_positions(mask, 0, position_ids)`` (offset 2)."""
    dropout: str | None = None
    """Dropout after the embeddings (GPT-2's ``drop``, GPT-NeoX's ``emb_dropout``)."""
    rotary: str | None = None
    """Rotary embedding module, run by every decoder layer for its own ``(cos, sin)``."""
    rotary_by_layer_type: bool = False
    """Gemma 3: ``rotary(x, position_ids, layer_type)`` (local and global bases)."""
    sliding_from_config: bool = False
    """Mistral, Phi-3: every layer uses a sliding-window mask when ``config.sliding_window`` is set."""
    mask_with_positions: bool = True
    """Whether HF builds the mask with ``position_ids`` (not OPT)."""
    project_in: str | None = None
    project_out: str | None = None


_ROPE = dict(embed="model.embed_tokens", layers="model.layers", norm="model.norm", rotary="model.rotary_emb")

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", **_ROPE),
    "MistralForCausalLM": Family("mistral", sliding_from_config=True, **_ROPE),
    "Qwen2ForCausalLM": Family("qwen2", **_ROPE),
    "Qwen3ForCausalLM": Family("qwen3", **_ROPE),
    "Phi3ForCausalLM": Family("phi3", sliding_from_config=True, **_ROPE),
    "Gemma2ForCausalLM": Family("gemma2", **_ROPE),
    "Gemma3ForCausalLM": Family("gemma3", rotary_by_layer_type=True, **_ROPE),
    "GPTNeoXForCausalLM": Family("gpt_neox", embed="gpt_neox.embed_in", layers="gpt_neox.layers",
                                 norm="gpt_neox.final_layer_norm", dropout="gpt_neox.emb_dropout",
                                 rotary="gpt_neox.rotary_emb"),
    "OPTForCausalLM": Family("opt", embed="model.decoder.embed_tokens", layers="model.decoder.layers",
                             norm="model.decoder.final_layer_norm", positions="model.decoder.embed_positions",
                             positions_kind="opt", mask_with_positions=False,
                             project_in="model.decoder.project_in", project_out="model.decoder.project_out"),
    "GPT2LMHeadModel": Family("gpt2", embed="transformer.wte", layers="transformer.h", norm="transformer.ln_f",
                              positions="transformer.wpe", positions_kind="gpt2", dropout="transformer.drop"),
}
"""Covered ``*ForCausalLM`` classes, by class name."""


def family_of(model_class: type) -> Family | None:
    """The family of ``model_class`` or of its nearest covered base class (``None`` if not covered)."""
    for cls in model_class.__mro__:
        if cls.__name__ in FAMILIES and cls.__module__.startswith("transformers."):
            return FAMILIES[cls.__name__]
    return None
