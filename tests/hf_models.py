"""Tiny, randomly initialised transformers ``*ForCausalLM`` models of every family :mod:`profiler.hf` covers.

Each config is a few kilobytes of weights (hidden 32, 4 decoder layers, vocabulary 128), dropout off, so tests
can build, profile, plan and train them in seconds. No download: the configs are written out here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import transformers

__all__ = ["FAMILIES", "VOCAB", "tiny"]

transformers.logging.set_verbosity_error()

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _config(name: str, tied: bool) -> Any:
    t = transformers
    if name == "llama":
        return t.LlamaConfig(tie_word_embeddings=tied, **_COMMON)
    if name == "mistral":
        return t.MistralConfig(tie_word_embeddings=tied, sliding_window=8, **_COMMON)
    if name == "qwen2":
        return t.Qwen2Config(tie_word_embeddings=tied, **_COMMON)
    if name == "qwen3":
        return t.Qwen3Config(tie_word_embeddings=tied, head_dim=8, **_COMMON)
    if name == "phi3":
        c = dict(_COMMON, pad_token_id=None)
        return t.Phi3Config(tie_word_embeddings=tied, **c)
    if name == "gemma2":
        return t.Gemma2Config(tie_word_embeddings=tied, head_dim=8, sliding_window=8, final_logit_softcapping=5.0,
                              attn_logit_softcapping=10.0, query_pre_attn_scalar=8, **_COMMON)
    if name == "gemma3":
        return t.Gemma3TextConfig(tie_word_embeddings=tied, head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
                                  final_logit_softcapping=5.0, **_COMMON)
    if name == "gpt_neox":
        return t.GPTNeoXConfig(tie_word_embeddings=tied, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64,
                               rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                               eos_token_id=0)
    if name == "opt":
        return t.OPTConfig(tie_word_embeddings=tied, vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
                           num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64,
                           word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                           bos_token_id=0, eos_token_id=0, pad_token_id=1)
    if name == "gpt2":
        return t.GPT2Config(tie_word_embeddings=tied, vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4,
                            n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                            eos_token_id=0)
    raise ValueError(name)


_CLASSES: dict[str, Callable[[Any], Any]] = {
    "llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
    "phi3": transformers.Phi3ForCausalLM, "gemma2": transformers.Gemma2ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM, "gpt_neox": transformers.GPTNeoXForCausalLM,
    "opt": transformers.OPTForCausalLM, "gpt2": transformers.GPT2LMHeadModel,
}

FAMILIES = tuple(_CLASSES)
"""Family names, as :mod:`profiler.hf_families` spells them."""


def tiny(name: str, tied: bool = False, seed: int = 0) -> Any:
    """A tiny ``name`` model, randomly initialised from ``seed``, in train mode, float32."""
    torch.manual_seed(seed)
    return _CLASSES[name](_config(name, tied))
