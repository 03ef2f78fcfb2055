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
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PipelineError
from .comm import Messenger

__all__ = ["FORMATS", "check_format", "gather_to_root", "save_model", "write_state_dict"]

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
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        if format == "torch":
            torch.save(state, tmp)
        else:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, Exception):
            raise PipelineError(f"cannot write the model to {path}: {exc}") from exc
        raise


def save_model(messenger: Messenger, module: nn.Module, *, replica: int, path: str, format: str = "torch") -> None:
    """Gather every stage's ``module.state_dict()`` (from its replica 0) onto rank 0, which writes the whole
    model to ``path`` in ``format`` (see the module docstring). A collective; a write failure raises
    :class:`PipelineError` on every rank."""
    check_format(format)
    mine = {k: v.detach().cpu() for k, v in module.state_dict().items()} if replica == 0 else {}
    parts = gather_to_root(messenger, mine)
    error: str | None = None
    if parts is not None:
        state: dict[str, torch.Tensor] = {}
        for part in parts:
            state.update(part)
        try:
            write_state_dict(state, path, format)
        except PipelineError as exc:
            error = str(exc)
    errors = [e for e in messenger.group.all_gather_object(error) if e]
    if errors:
        raise PipelineError(errors[0])
