"""The final model: every stage's weights gathered onto rank 0 and written as one whole-model state dict.

The keys are the original model's (stage modules mirror its module tree), so the plain, unpartitioned model's
``load_state_dict(state, strict=True)`` accepts the file: parameters and buffers (BatchNorm's running
statistics included) of every layer, each written once (by replica 0 of its stage). Formats:

* ``"torch"``: ``torch.save`` of the dict (``torch.load(path)``);
* ``"safetensors"``: ``safetensors.torch.save_file`` (``safetensors.torch.load_file(path)``); tensors that
  share memory (tied weights) are written as separate copies, which safetensors requires and
  ``load_state_dict`` accepts.

Rank 0 writes to a temporary file beside ``path`` and renames it, so ``path`` is either the complete model or
untouched; a failure to write is raised on every rank.

:func:`save_pretrained` writes a Hugging Face directory instead (the model was a transformers model, or a
:func:`profiler.hf.for_pipeline` wrapper of one, whose ``config`` it keeps): ``config.json`` and the weights as
safetensors — ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards and
``model.safetensors.index.json`` when they exceed ``max_shard_bytes`` — without the tied copies transformers
itself leaves out (``lm_head.weight`` of a tied head), so ``AutoModelForCausalLM.from_pretrained(directory)``
loads it with no missing and no unexpected keys.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..atomic import replace_atomically
from ..errors import PipelineError
from .comm import Messenger

__all__ = ["FORMATS", "Pretrained", "check_format", "gather_to_root", "pretrained_of", "save_model", "save_pretrained",
           "write_pretrained", "write_state_dict"]

FORMATS = ("torch", "safetensors")


def check_format(format: str) -> None:
    """Raise ``ValueError`` unless ``format`` is one of :data:`FORMATS`."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")


def gather_to_root(messenger: Messenger, obj: Any, root: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` (picklable) on rank ``root``, in rank order (``None`` elsewhere). A collective over
    the control group (gloo, CPU); unlike an all-gather, only ``root`` holds everything."""
    group = messenger.group
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(group.world_size)]
    messenger.wait(group.control.allgather([sizes], [size]), "exchange of state sizes")
    longest = int(max(int(s) for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    opts = dist.GatherOptions()
    opts.rootRank = root
    out = [[torch.zeros(longest, dtype=torch.uint8) for _ in range(group.world_size)]] if group.rank == root else []
    messenger.wait(group.control.gather(out, [padded], opts), f"gather of the model's weights onto rank {root}")
    if group.rank != root:
        return None
    return [pickle.loads(t[: int(n)].numpy().tobytes()) for t, n in zip(out[0], sizes)]


def write_state_dict(state: dict[str, torch.Tensor], path: str, format: str) -> None:
    """Write ``state`` to ``path`` in ``format``, atomically (temporary file, then rename)."""
    check_format(format)

    def write(tmp: str) -> None:
        if format == "torch":
            torch.save(state, tmp)
        else:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, tmp)

    try:
        replace_atomically(path, write, tmp=f"{path}.tmp-{os.getpid()}")
    except Exception as exc:
        raise PipelineError(f"cannot write the model to {path}: {exc}") from exc


def save_model(messenger: Messenger, module: nn.Module, *, replica: int, path: str, format: str = "torch") -> None:
    """Gather every stage's ``module.state_dict()`` (from its replica 0) onto rank 0, which writes the whole
    model to ``path`` in ``format`` (see the module docstring). A collective; a write failure raises
    :class:`PipelineError` on every rank."""
    check_format(format)
    _gather_and_write(messenger, module, replica, lambda state: write_state_dict(state, path, format))


def _gather_and_write(messenger: Messenger, module: nn.Module, replica: int, write: Any) -> None:
    """Gather every stage's ``module.state_dict()`` (from its replica 0) onto rank 0, which calls
    ``write(state)``; a :class:`PipelineError` there is raised on every rank. A collective."""
    mine = {k: v.detach().cpu() for k, v in module.state_dict().items()} if replica == 0 else {}
    parts = gather_to_root(messenger, mine)
    error: str | None = None
    if parts is not None:
        state: dict[str, torch.Tensor] = {}
        for part in parts:
            state.update(part)
        try:
            write(state)
        except PipelineError as exc:
            error = str(exc)
    errors = [e for e in messenger.group.all_gather_object(error) if e]
    if errors:
        raise PipelineError(errors[0])


@dataclass(frozen=True, slots=True)
class Pretrained:
    """What :func:`save_pretrained` needs of the original transformers model besides its weights."""

    config: Any
    """Its ``PretrainedConfig`` (written as ``config.json``)."""
    tied_copies: tuple[str, ...]
    """Keys transformers does not save because they are tied to another (e.g. ``lm_head.weight``)."""


def pretrained_of(model: Any) -> Pretrained | None:
    """The :class:`Pretrained` of a transformers model or of a wrapper holding its ``config`` (``None`` for a
    model without one)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return None
    tied: dict[str, str] = dict(getattr(model, "pipeline_tied_weights_keys", None)
                                or getattr(model, "_tied_weights_keys", None) or {})
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    copies = tuple(tied) if getattr(text, "tie_word_embeddings", False) else ()
    return Pretrained(config, copies)


def write_pretrained(state: dict[str, torch.Tensor], directory: str, pretrained: Pretrained, *,
                     max_shard_bytes: int = 5 * 10**9) -> list[str]:
    """Write ``state`` and the config as a transformers directory (module docstring); the weight files written."""
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items() if k not in pretrained.tied_copies}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += n
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        replace_atomically(os.path.join(directory, name),
                           lambda tmp, shard=shard: save_file(shard, tmp, metadata={"format": "pt"}))
    index = os.path.join(directory, "model.safetensors.index.json")
    if len(shards) > 1:
        body = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}

        def write_index(tmp: str) -> None:
            with open(tmp, "w") as f:
                f.write(json.dumps(body, indent=2, sort_keys=True))

        replace_atomically(index, write_index)
    elif os.path.exists(index):
        os.unlink(index)
    pretrained.config.save_pretrained(directory)
    return names


def save_pretrained(messenger: Messenger, module: nn.Module, *, replica: int, directory: str,
                    pretrained: Pretrained | None, max_shard_bytes: int = 5 * 10**9) -> None:
    """Gather every stage's weights onto rank 0, which writes them with :func:`write_pretrained`. A collective;
    any failure raises :class:`PipelineError` on every rank."""
    if pretrained is None:
        raise PipelineError("save_pretrained needs a transformers model (with a config): this model has none; "
                            "use save_model(path, format='safetensors')")

    def write(state: dict[str, torch.Tensor]) -> None:
        try:
            write_pretrained(state, directory, pretrained, max_shard_bytes=max_shard_bytes)
        except Exception as exc:
            raise PipelineError(f"cannot write the model to {directory}: {type(exc).__name__}: {exc}") from None

    _gather_and_write(messenger, module, replica, write)
