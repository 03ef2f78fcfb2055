"""Shared pytest fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # the examples package is not installed; `pytest` alone must find it too
    sys.path.insert(0, str(_ROOT))

__all__ = ["shared_profiles"]


@pytest.fixture
def shared_profiles() -> Path:
    """Folder of the PipeDream reference profiles (``../shared/profiles`` next to the repository)."""
    return Path(__file__).resolve().parents[2] / "shared" / "profiles"
