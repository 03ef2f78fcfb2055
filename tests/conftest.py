"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

# Crashed training processes write their tracebacks to ./pipedream-ft-logs by default: keep the suite's out of the
# checkout (a test that checks the location sets its own PIPEDREAM_FT_LOG_DIR).
os.environ.setdefault("PIPEDREAM_FT_LOG_DIR", tempfile.mkdtemp(prefix="pipedream-ft-test-logs-"))

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `pytest` alone (no install) finds the project's packages too
    sys.path.insert(0, str(_ROOT))

__all__ = ["shared_profiles"]


@pytest.fixture
def shared_profiles() -> Path:
    """Folder of the PipeDream reference profiles (``../shared/profiles`` next to the repository)."""
    return Path(__file__).resolve().parents[2] / "shared" / "profiles"
