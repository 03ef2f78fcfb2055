"""Reading a model's weights from a file one tensor at a time, so a process reads only the tensors it needs.

:func:`open_weights` opens what ``path`` names:

* a safetensors file (``*.safetensors``): ``safe_open``, each tensor read alone;
* a Hugging Face directory: ``model.safetensors``, or the shards listed by ``model.safetensors.index.json``
  (each shard opened on first use, tensor by tensor; never a whole shard into memory);
* a ``torch.save`` state dict (any other file): ``torch.load(mmap=True, weights_only=True)``, so a tensor's
  bytes are read from disk only when it is copied out;
* a pipedream-ft checkpoint directory or URL (holding committed ``step-*`` checkpoints): its newest committed step's
  model parts, one part in memory at a time (each is looked into once to learn its keys: a checkpoint is
  read whole once, but never held whole).

Every reader answers :meth:`WeightsFile.keys` (what the file holds) and :meth:`WeightsFile.read` (one tensor, on
the CPU); :attr:`WeightsFile.reads` counts the tensors read.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from typing import Any

import torch

from ..errors import PipelineSetupError

__all__ = ["INDEX", "WeightsFile", "open_weights"]

INDEX = "model.safetensors.index.json"
"""The index of a sharded Hugging Face directory: ``{"weight_map": {key: shard file}}``."""


class WeightsFile(ABC):
    """The tensors of one weights file (or directory), read one at a time (module docstring)."""

    path: str
    reads: int
    """Tensors read so far."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reads = 0

    @abstractmethod
    def keys(self) -> list[str]:
        """Every tensor name the file holds."""

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` (a CPU tensor owning its memory)."""
        self.reads += 1
        return self._read(key)

    @abstractmethod
    def _read(self, key: str) -> torch.Tensor:
        """Read ``key`` from the file (:meth:`read` counts it)."""

    def close(self) -> None:
        """Let go of open files."""


class _Safetensors(WeightsFile):
    """One or several safetensors files; ``files[key]`` is the file holding ``key``."""

    def __init__(self, path: str, files: dict[str, str]) -> None:
        super().__init__(path)
        self.files = files
        self._open: dict[str, Any] = {}

    def keys(self) -> list[str]:
        return list(self.files)

    def _read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        name = self.files[key]
        handle = self._open.get(name)
        if handle is None:
            handle = self._open[name] = safe_open(name, framework="pt", device="cpu")
        return handle.get_tensor(key)

    def close(self) -> None:
        self._open.clear()


class _TorchFile(WeightsFile):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise PipelineSetupError(f"{path} is not a state dict of tensors (torch.save of model.state_dict())")
        self.state: dict[str, torch.Tensor] | None = state

    def keys(self) -> list[str]:
        assert self.state is not None
        return list(self.state)

    def _read(self, key: str) -> torch.Tensor:
        assert self.state is not None
        return self.state[key].clone()  # copies the bytes out of the mapping: only this tensor's are read

    def close(self) -> None:
        self.state = None


class _Checkpoint(WeightsFile):
    """The model parts of a pipedream-ft checkpoint's newest committed step."""

    def __init__(self, path: str) -> None:
        from .reader import latest_committed, load_part
        from .storage import Storage

        super().__init__(path)
        self.storage = Storage(path)
        record = latest_committed(self.storage)
        if record is None:
            raise PipelineSetupError(f"{path} holds no committed pipedream-ft checkpoint")
        self.record = record
        self._load_part = load_part
        self.where: dict[str, str] = {}
        self._part: tuple[str, dict[str, torch.Tensor]] | None = None
        for name in sorted(record.parts):  # which part holds which key: each part looked into once
            for key in self._model_of(name):
                self.where.setdefault(key, name)
        self._part = None

    def _model_of(self, name: str) -> dict[str, torch.Tensor]:
        if self._part is None or self._part[0] != name:
            self._part = None  # one part in memory at a time
            part = self._load_part(self.storage, self.record.step, name, record=self.record)
            model = part.get("model") if isinstance(part, dict) else None
            self._part = (name, dict(model) if isinstance(model, dict) else {})
        return self._part[1]

    def keys(self) -> list[str]:
        return list(self.where)

    def _read(self, key: str) -> torch.Tensor:
        return self._model_of(self.where[key])[key].clone()

    def close(self) -> None:
        self._part = None


def open_weights(path: str) -> WeightsFile:
    """A reader of the weights at ``path`` (module docstring). Raises :class:`PipelineSetupError` naming the
    path when it is none of those."""
    if "://" in path and not path.startswith("file://"):  # remote storage (s3://, memory://): a checkpoint
        return _Checkpoint(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise PipelineSetupError(f"{index} has no weight_map")
            return _Safetensors(path, {k: os.path.join(path, v) for k, v in weight_map.items()})
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(single):
            return _safetensors_file(single)
        if any(name.startswith("step-") for name in os.listdir(path)):
            return _Checkpoint(path)
        raise PipelineSetupError(f"{path} holds no {INDEX}, no model.safetensors and no pipedream-ft checkpoint")
    if not os.path.exists(path):
        raise PipelineSetupError(f"no weights file at {path}")
    if path.endswith(".safetensors"):
        return _safetensors_file(path)
    return _TorchFile(path)


def _safetensors_file(path: str) -> WeightsFile:
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        keys = list(f.keys())
    return _Safetensors(path, dict.fromkeys(keys, path))
