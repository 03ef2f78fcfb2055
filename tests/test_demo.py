"""The README's main command, ``python examples/demo.py``, end to end: with ``OMP_NUM_THREADS=1`` (which makes
the profile, and so the plan, differ) and without it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("threads", ["1", None], ids=["OMP_NUM_THREADS=1", "default threads"])
def test_demo_trains_recovers_in_place_and_draws_the_timeline(tmp_path, threads):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEDREAM_FT_") and k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "examples/demo.py", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    m = re.search(r"loss: first 20 minibatches ([\d.]+) → last 20 ([\d.]+)", text)
    assert m and float(m.group(2)) < 0.5 * float(m.group(1)), text
    assert "recovery: recovered in place" in text, text
    assert "restarts of the whole group: 0" in text, text
    assert (out / "timeline.png").stat().st_size > 0 and (out / "checkpoints").is_dir()
