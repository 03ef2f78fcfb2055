"""The final model, written by the stages themselves: no process ever holds more than its own stages.

The keys are the original model's (stage modules mirror its module tree), so the plain, unpartitioned model's
``load_state_dict(state, strict=True)`` accepts what is written: parameters and buffers (BatchNorm's running
statistics included) of every layer, each written once (by replica 0 of the first stage holding it). Formats:

* ``"safetensors"``: one safetensors file (``safetensors.torch.load_file(path)``). Every process learns every
  tensor's name, dtype and shape (not its values), so all agree on the file's layout; rank 0 writes the header
  into a temporary file beside ``path`` and each stage's replica 0 writes its own tensors at their offsets.
  Tensors that share memory (tied weights) are written as separate copies, which ``load_state_dict`` accepts.
* ``"torch"``: ``torch.save`` of the dict (``torch.load(path)``); that format cannot be written in pieces, so the
  weights are gathered onto rank 0, which writes them.

``path`` is either the complete model or untouched (a temporary file, renamed at the end); a failure to write
is raised on every rank.

:func:`save_pretrained` writes a Hugging Face directory instead (the model was a transformers model, or a
:func:`profiler.hf.for_pipeline` wrapper of one, whose ``config`` it keeps): ``config.json`` and the weights as
safetensors shards, each stage writing its own — ``model-00001-of-0000N.safetensors``, at least one per stage
holding weights (more where a stage's exceed ``max_shard_bytes``), in stage order — and
``model.safetensors.index.json`` (or ``model.safetensors`` alone when one shard holds everything), without the tied
copies transformers itself leaves out (``lm_head.weight`` of a tied head), so
``AutoModelForCausalLM.from_pretrained(directory)`` loads it with no missing and no unexpected keys.
:func:`write_pretrained` writes such a directory from one process's whole state dict.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..atomic import replace_atomically
from ..checkpoint.safetensors_layout import Entry, entry_of, layout, write_file, write_header, write_tensor
from ..errors import PipelineError
from .comm import Messenger

__all__ = ["FORMATS", "Pretrained", "check_format", "gather_to_root", "pretrained_of", "save_model", "save_pretrained",
           "shard_names", "write_pretrained", "write_state_dict"]

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


def save_model(messenger: Messenger, module: nn.Module, *, replica: int, path: str, format: str = "torch",
               stage: int = 0) -> None:
    """Write the whole model to ``path`` in ``format`` (see the module docstring): ``"safetensors"`` by every
    stage into one file, ``"torch"`` gathered onto rank 0. A collective; a write failure raises
    :class:`PipelineError` on every rank."""
    check_format(format)
    if format == "safetensors":
        _write_in_place(messenger, module, replica, path, stage)
    else:
        _gather_and_write(messenger, module, replica, lambda state: write_state_dict(state, path, format))


def _agree(group: Any, error: str | None) -> None:
    """Raise the first rank's error on every rank (a collective)."""
    errors = [e for e in group.all_gather_object(error) if e]
    if errors:
        raise PipelineError(errors[0])


def _claims(group: Any, tensors: dict[str, torch.Tensor], stage: int, skip: tuple[str, ...] = (),
            extra: Any = None) -> tuple[list[tuple[int, list[Entry]]], list[Any]]:
    """Which rank writes which tensor: every rank's entries gathered; a key goes to the first rank holding it in
    (stage, rank) order. Returns ``[(rank, its entries)]`` in that order, and every rank's ``extra``."""
    mine = [entry_of(k, t) for k, t in tensors.items() if k not in skip]
    gathered = group.all_gather_object((stage, mine, extra))
    seen: set[str] = set()
    out = []
    for rank in sorted(range(len(gathered)), key=lambda r: (gathered[r][0], r)):
        owned = [e for e in gathered[rank][1] if e.key not in seen]
        seen.update(e.key for e in owned)
        out.append((rank, owned))
    return out, [g[2] for g in gathered]


def _write_in_place(messenger: Messenger, module: nn.Module, replica: int, path: str, stage: int = 0) -> None:
    """Every stage's replica 0 writes its tensors into one safetensors file at ``path`` (module docstring)."""
    group = messenger.group
    tensors = module.state_dict() if replica == 0 else {}
    owners, extras = _claims(group, tensors, stage, extra=f"{path}.tmp-{os.getpid()}" if group.rank == 0 else None)
    tmp = extras[0]
    entries = [e for _, owned in owners for e in owned]
    plan = layout(entries)
    mine = next(owned for rank, owned in owners if rank == group.rank)

    def attempt(step: Callable[[], None]) -> None:
        error = None
        try:
            step()
        except Exception as exc:
            error = f"cannot write the model to {path}: {type(exc).__name__}: {exc}"
        try:
            _agree(group, error)
        except PipelineError:
            if group.rank == 0:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise

    def header() -> None:
        if group.rank == 0:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_header(fd, plan)
            finally:
                os.close(fd)

    def data() -> None:
        if mine:
            fd = os.open(tmp, os.O_WRONLY)
            try:
                for e in mine:
                    write_tensor(fd, tensors[e.key], plan.offsets[e.key])
                os.fsync(fd)
            finally:
                os.close(fd)

    def publish() -> None:
        if group.rank == 0:
            os.replace(tmp, path)

    attempt(header)
    attempt(data)
    attempt(publish)


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
    _agree(messenger.group, error)


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


def shard_names(count: int) -> list[str]:
    """The weight files of a Hugging Face directory of ``count`` shards."""
    return ["model.safetensors"] if count == 1 else \
        [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _shards(owners: list[tuple[int, list[Entry]]], max_shard_bytes: int) -> list[tuple[int, list[Entry]]]:
    """``owners``' entries cut into shards of at most ``max_shard_bytes`` (or one tensor), never across ranks."""
    out: list[tuple[int, list[Entry]]] = []
    for rank, owned in owners:
        size, current = 0, []
        for e in owned:
            if current and size + e.nbytes > max_shard_bytes:
                out.append((rank, current))
                size, current = 0, []
            current.append(e)
            size += e.nbytes
        if current:
            out.append((rank, current))
    return out


def save_pretrained(messenger: Messenger, module: nn.Module, *, replica: int, directory: str,
                    pretrained: Pretrained | None, max_shard_bytes: int = 5 * 10**9, stage: int = 0) -> None:
    """Every stage's replica 0 writes its own weights as shards of a Hugging Face directory; rank 0 writes the
    index and the config (module docstring). A collective; any failure raises :class:`PipelineError` on every
    rank."""
    if pretrained is None:
        raise PipelineError("save_pretrained needs a transformers model (with a config): this model has none; "
                            "use save_model(path, format='safetensors')")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    group = messenger.group
    tensors = module.state_dict() if replica == 0 else {}
    owners, _ = _claims(group, tensors, stage, skip=pretrained.tied_copies)
    shards = _shards(owners, max_shard_bytes)
    names = shard_names(len(shards))
    error = None
    try:
        os.makedirs(directory, exist_ok=True)
        for name, (rank, entries) in zip(names, shards):
            if rank == group.rank:
                part = {e.key: tensors[e.key] for e in entries}
                replace_atomically(os.path.join(directory, name),
                                   lambda tmp, part=part: write_file(tmp, part, metadata={"format": "pt"}))
        if group.rank == 0:
            index = os.path.join(directory, "model.safetensors.index.json")
            if len(shards) > 1:
                body = {"metadata": {"total_size": sum(e.nbytes for _, entries in shards for e in entries)},
                        "weight_map": {e.key: name for name, (_, entries) in zip(names, shards) for e in entries}}
                replace_atomically(index, lambda tmp: _write_json(tmp, body))
            elif os.path.exists(index):
                os.unlink(index)
            pretrained.config.save_pretrained(directory)
    except Exception as exc:
        error = f"cannot write the model to {directory}: {type(exc).__name__}: {exc}"
    _agree(group, error)


def _write_json(path: str, body: Any) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(body, indent=2, sort_keys=True))
