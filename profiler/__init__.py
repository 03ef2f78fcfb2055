"""Layer-by-layer profiling of PyTorch models, and the profile format the partitioner plans from.

The profile format needs no torch; the torch-based parts (:func:`profile_model`, :func:`layer_graph`,
:func:`structure_profile`, :class:`LayerGraph`) are imported on first use.
"""

from __future__ import annotations

from typing import Any

from .graphtxt import dumps_graph_txt, parse_graph_txt
from .profile import (FORMAT, KINDS, VERSION, KeepTogether, Layer, ModelInput, Profile, ProfileError, TiedGroup,
                      load_profile)

__all__ = [
    "FORMAT",
    "VERSION",
    "KINDS",
    "Layer",
    "TiedGroup",
    "ModelInput",
    "KeepTogether",
    "Profile",
    "ProfileError",
    "load_profile",
    "parse_graph_txt",
    "dumps_graph_txt",
    "LayerGraph",
    "layer_graph",
    "structure_profile",
    "profile_model",
]

_LAZY = {
    "LayerGraph": "layers",
    "layer_graph": "layers",
    "structure_profile": "layers",
    "profile_model": "measure",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
