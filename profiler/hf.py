"""Hugging Face decoder-only language models as pipeline-ready models, split at their decoder layers.

``torch.fx`` cannot trace transformers' ``*ForCausalLM`` models (their forwards go through decorators with
``**kwargs``: "co_varnames is too small"), and transformers 5 dropped its own fx tracer. :func:`for_pipeline`
wraps one in a module whose forward fx can trace, recomputing the model's logits from its own submodules::

    embed(input_ids) [+ positions] [-> dropout] -> layer 0 -> ... -> layer n-1 -> final norm -> head [-> soft-cap]

Covered: Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3 (text), Phi-3, GPT-NeoX, OPT and GPT-2, with tied or
untied heads (:mod:`profiler.hf_families` says where each family keeps its parts).

* **Same weights, same keys.** The wrapper holds the HF model's modules themselves (no copies) under the same
  names, so its ``state_dict`` keys are exactly the HF model's (a state dict loads strictly both ways) and
  training the wrapper trains the HF model.
* **Same logits.** ``wrapper(input_ids)`` equals ``model(input_ids).logits`` (float32, no key/value cache).
* **One layer per decoder layer.** The decoder layers, the token embedding and the final norm are fx leaves
  (``pipeline_leaf_modules``, see :mod:`profiler.layers`): the partitioner cuts between decoder layers and the
  final norm stays whole, its weight with it. The final norm, the head and the soft-capping after it form one
  ``pipeline_keep_together`` group (:mod:`profiler.together`): every plan puts them on one stage.
* **Positions and masks computed where they are used.** A decoder layer receives only the hidden states and
  the model's own inputs (``attention_mask``, ``position_ids``: small tensors that cross stages as any input).
  A forward pre-hook on each decoder layer computes, inside the layer, what the HF model would have handed it:
  the rotary ``(cos, sin)`` for its position ids (Gemma 3: for its layer type) and its attention mask (causal,
  or sliding-window, plus padding) with transformers' own mask functions — so no ``(cos, sin)`` tuple or 4-D
  mask ever crosses a stage. The hook acts only on the wrapper's calls; the HF model's own forward is unchanged.

Inputs: ``for_pipeline(model)`` takes ``input_ids`` only (causal attention, positions ``0 .. T-1``: the fast
default); ``inputs=("input_ids", "attention_mask")`` adds a padding mask (1 keep, 0 pad; OPT derives its
positions from it as HF does), and ``"position_ids"`` explicit positions. The wrapper's forward takes them
positionally in that order.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from .hf_families import FAMILIES, Family, family_of
from .layers import fetch_attr
from .together import OUTPUT

__all__ = ["CausalLMForPipeline", "GPT2ForPipeline", "IGNORE_INDEX", "INPUTS", "causal_lm_loss", "for_pipeline",
           "gpt2_for_pipeline"]

INPUTS = ("input_ids", "attention_mask", "position_ids")
"""The inputs a wrapper may take, in the order its forward takes them (``input_ids`` always first)."""

IGNORE_INDEX = -100
"""Label of a position that counts in no loss (padding), as in transformers."""

_MARK = "pipeline_layer_inputs"
"""Keyword the wrapper's layer calls carry so that the pre-hook knows the call is its to complete."""

RECIPE = "README 'Bring your Hugging Face model'"


class _LayerInputs:
    """Forward pre-hook of one decoder layer: from the wrapper's ``(hidden, attention_mask=, position_ids=)``,
    the keyword arguments the HF model's own forward would pass (rotary ``position_embeddings``, the layer's
    attention mask). Calls without the wrapper's mark pass through untouched."""

    def __init__(self, config: Any, family: Family, rotary: nn.Module | None, layer_type: str) -> None:
        self.config = config
        self.family = family
        self.rotary = rotary
        self.layer_type = layer_type

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not kwargs.pop(_MARK, False):
            return None
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        hidden = args[0]
        mask = kwargs.pop("attention_mask", None)
        positions = kwargs.pop("position_ids", None)
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        make = create_sliding_window_causal_mask if self.layer_type == "sliding_attention" else create_causal_mask
        extra = {"position_ids": positions} if self.family.mask_with_positions else {}
        kwargs["attention_mask"] = make(config=self.config, inputs_embeds=hidden, attention_mask=mask,
                                        **_no_cache(make, hidden), **extra)
        kwargs["position_ids"] = positions
        if self.rotary is not None:
            kwargs["position_embeddings"] = (self.rotary(hidden, positions, self.layer_type)
                                             if self.family.rotary_by_layer_type else self.rotary(hidden, positions))
        return args, kwargs


def _no_cache(make: Any, hidden: torch.Tensor) -> dict[str, Any]:
    """The "no key/value cache" arguments of transformers' mask builder ``make``, as the installed version names
    them: ``cache=None`` (5.2x), or ``past_key_values=None`` with ``cache_position`` (5.1x and 4.5x)."""
    params = _parameters(make)
    if "cache" in params:
        return {"cache": None}
    args: dict[str, Any] = {"past_key_values": None} if "past_key_values" in params else {}
    if "cache_position" in params:
        args["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return args


@functools.cache
def _parameters(fn: Any) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _layer_type(config: Any, family: Family, i: int) -> str:
    if family.sliding_from_config:
        return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    types = getattr(config, "layer_types", None)
    return types[i] if types else "full_attention"


class CausalLMForPipeline(nn.Module):
    """A ``*ForCausalLM``'s logits from its own modules, with a forward fx can trace (module docstring).

    Build it with :func:`for_pipeline`. ``forward(input_ids)`` returns logits ``(B, T, vocab_size)``."""

    def __init__(self, model: nn.Module, family: Family) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.pipeline_family = family
        self.config = model.config
        """The HF model's config (what ``trainer.save_pretrained`` writes beside the weights)."""
        self.pipeline_init_weights = model._init_weights
        """The HF model's own initialisation of one module (how a model built on the meta device is initialised,
        see :func:`profiler.materialize.init_function`)."""
        self.pipeline_tied_weights_keys: dict[str, str] = dict(getattr(model, "_tied_weights_keys", None) or {})
        layers = fetch_attr(self, family.layers)
        leaves = [type(layer) for layer in layers] + [type(fetch_attr(self, family.embed))]
        for part in (family.norm, family.positions):
            if part is not None and fetch_attr(self, part) is not None:
                leaves.append(type(fetch_attr(self, part)))
        self.pipeline_leaf_modules: tuple[type, ...] = tuple(dict.fromkeys(leaves))
        self.pipeline_softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        tail = [p for p in (family.norm, family.project_out, family.head) if self._part(p) is not None]
        self.pipeline_keep_together: tuple[tuple[str, ...], ...] = ((*tail, OUTPUT),)
        """The final norm, the head and what follows them (soft-capping) share one stage (:mod:`profiler.together`)."""
        rotary = fetch_attr(self, family.rotary) if family.rotary else None
        for i, layer in enumerate(layers):
            if not getattr(layer, "_pipeline_inputs_hooked", False):
                hook = _LayerInputs(model.config, family, rotary, _layer_type(model.config, family, i))
                layer.register_forward_pre_hook(hook, with_kwargs=True)
                layer._pipeline_inputs_hooked = True

    def _part(self, path: str | None) -> Any:
        return None if path is None else fetch_attr(self, path)

    def _logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None) -> torch.Tensor:
        f = self.pipeline_family
        hidden = self._part(f.embed)(input_ids)
        if f.positions_kind == "gpt2":
            if position_ids is None:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
            hidden = hidden + self._part(f.positions)(position_ids)
        elif f.positions_kind == "opt":
            keep = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            project_in = self._part(f.project_in)
            if project_in is not None:
                hidden = project_in(hidden)
            hidden = hidden + self._part(f.positions)(keep, 0, position_ids=position_ids)
        if f.dropout is not None:
            hidden = self._part(f.dropout)(hidden)
        extra: dict[str, Any] = {_MARK: True}
        if attention_mask is not None:
            extra["attention_mask"] = attention_mask
        if position_ids is not None and f.positions_kind != "opt":
            extra["position_ids"] = position_ids
        for layer in self._part(f.layers):
            hidden = layer(hidden, **extra)
        norm = self._part(f.norm)
        if norm is not None:
            hidden = norm(hidden)
        project_out = self._part(f.project_out)
        if project_out is not None:
            hidden = project_out(hidden)
        logits = self._part(f.head)(hidden)
        if self.pipeline_softcap is not None:
            logits = logits / self.pipeline_softcap
            logits = torch.tanh(logits)
            logits = logits * self.pipeline_softcap
        return logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``(B, T)``, attending causally."""
        return self._logits(input_ids, None, None)


class _WithMask(CausalLMForPipeline):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Logits for token ids and their padding mask ``(B, T)`` (1: a token, 0: padding)."""
        return self._logits(input_ids, attention_mask, None)


class _WithPositions(CausalLMForPipeline):
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Logits for token ids and their positions ``(B, T)``."""
        return self._logits(input_ids, None, position_ids)


class _WithMaskAndPositions(CausalLMForPipeline):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,  # type: ignore[override]
                position_ids: torch.Tensor) -> torch.Tensor:
        """Logits for token ids, their padding mask and their positions, each ``(B, T)``."""
        return self._logits(input_ids, attention_mask, position_ids)


_CLASSES = {
    ("input_ids",): CausalLMForPipeline,
    ("input_ids", "attention_mask"): _WithMask,
    ("input_ids", "position_ids"): _WithPositions,
    ("input_ids", "attention_mask", "position_ids"): _WithMaskAndPositions,
}

GPT2ForPipeline = CausalLMForPipeline
"""The GPT-2 wrapper of earlier versions: now the generic one."""


def for_pipeline(model: nn.Module, inputs: tuple[str, ...] = ("input_ids",)) -> CausalLMForPipeline:
    """Wrap a transformers ``*ForCausalLM`` for profiling, planning and pipelining (module docstring).

    ``inputs``: the wrapper's forward arguments, ``input_ids`` first, then ``attention_mask`` and/or
    ``position_ids`` in that order. Raises ``TypeError`` for a model of a family not covered (naming its class
    and the recipe to split one by hand) and ``ValueError`` for a configuration the wrapper does not reproduce.
    """
    family = family_of(type(model))
    if family is None:
        covered = ", ".join(FAMILIES)
        raise TypeError(f"for_pipeline does not cover {type(model).__name__} (covered: {covered}); write its split "
                        f"by hand as in the {RECIPE} recipe")
    key = tuple(inputs)
    if key not in _CLASSES:
        raise ValueError(f"for_pipeline: inputs must be input_ids, then attention_mask and/or position_ids in "
                         f"that order, got {key}")
    config = model.config
    name = type(model).__name__
    for flag in ("add_cross_attention", "use_bidirectional_attention"):
        if getattr(config, flag, False):
            raise ValueError(f"for_pipeline: {name} with config.{flag} is not supported")
    if family.positions_kind == "opt" and "position_ids" in key:
        raise ValueError(f"for_pipeline: {name} derives its positions from attention_mask; drop position_ids")
    if getattr(model, "gradient_checkpointing", False) or getattr(fetch_attr(model, family.layers.rsplit(".", 1)[0]),
                                                                  "gradient_checkpointing", False):
        raise ValueError(f"for_pipeline: {name} has gradient checkpointing on; turn it off "
                         "(the pipeline recomputes nothing inside a layer)")
    return _CLASSES[key](model, family)


def gpt2_for_pipeline(model: nn.Module) -> CausalLMForPipeline:
    """:func:`for_pipeline` for a ``transformers.GPT2LMHeadModel`` (``TypeError`` for another model)."""
    from transformers import GPT2LMHeadModel

    if not isinstance(model, GPT2LMHeadModel):
        raise TypeError(f"gpt2_for_pipeline needs a transformers.GPT2LMHeadModel, got {type(model).__name__}")
    return for_pipeline(model)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy as transformers' ``model(..., labels=labels).loss`` computes it: the logits at
    position ``t`` predict ``labels[:, t + 1]``; labels equal to :data:`IGNORE_INDEX` (padding) count in nothing;
    the mean over the counted positions. A ``loss_fn`` for the trainer with dict minibatches' ``"labels"``."""
    vocab = logits.size(-1)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1),
                                       ignore_index=IGNORE_INDEX)
