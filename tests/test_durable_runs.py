"""The durable tier through real runs (4 gloo processes): a fallback does not stop checkpointing, storage that
refuses for good ends the job with one line, per-process file systems are refused at start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dist_helpers import run_world
from durable_cases import durable_case
from ft_cases import start_case
from pipedream_ft.checkpoint import Storage, list_committed
from pipedream_ft.checkpoint.format import part_data_path

pytestmark = [pytest.mark.slow]

EVERY = 8


def committed(url: Path) -> list[int]:
    return list_committed(Storage(str(url)))


@pytest.mark.timeout(420)
def test_checkpointing_goes_on_after_a_fallback_past_the_old_newest_step(tmp_path):
    url = tmp_path / "ckpt"
    first = run_world(durable_case, 4, str(url), 48, EVERY, timeout=180)[0][1]
    assert first["resumed"] is None
    newest = committed(url)[-1]
    # the newest committed step's part of one stage is damaged: the next run falls back to an older one
    damaged = url / part_data_path(newest, "stage2-replica0")
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    second = run_world(durable_case, 4, str(url), 96, EVERY, timeout=180)[0][1]
    assert second["resumed"] is not None and second["resumed"] < newest, (second["resumed"], newest)
    after = committed(url)
    # the run went past the old newest step and its later cuts committed (none was deferred for good)
    assert after and after[-1] > newest + EVERY, (newest, after)
    third = run_world(durable_case, 4, str(url), 112, EVERY, timeout=180)[0][1]
    assert third["resumed"] == after[-1], (third["resumed"], after)
    straight = run_world(durable_case, 4, str(tmp_path / "straight"), 112, EVERY, timeout=180)[0][1]
    for k, v in straight["state"].items():
        assert torch.equal(third["state"][k], v), f"{k} differs from the uninterrupted run"


@pytest.mark.timeout(300)
def test_storage_that_refuses_a_part_for_good_ends_the_job_with_one_line_after_saving_results(tmp_path):
    url, out = tmp_path / "ckpt", tmp_path / "final.pt"
    # rank 1 may write no file over 4 KiB: every part of it fails with EFBIG
    outcomes = run_world(durable_case, 4, str(url), 24, EVERY, str(out), 1, timeout=240, expect_failure=True)
    messages = {payload[1] for ok, payload in outcomes.values() if not ok}
    assert all(not ok for ok, _ in outcomes.values()) and len(messages) == 1, outcomes
    line = messages.pop()
    # the cut named is the newest one the job took: 24, or an earlier one when a loaded machine deferred the later
    # cuts while it was still being written
    assert re.search(r"checkpoint (8|16|24) .*could not be committed", line) and "rank 1" in line, line
    assert "File too large" in line and "tries" not in line, line  # not retried
    assert "\n" not in line
    assert out.exists()  # the training results were saved before the job ended non-zero
    assert committed(url) == []
    assert not list(url.glob("step-*")), sorted(p.name for p in url.iterdir())  # no half-written step left


@pytest.mark.timeout(120)
def test_a_per_process_file_system_is_refused_at_start():
    outcomes = run_world(start_case, 2, "memory://pdft-ckpt", "mlp", expect_failure=True)
    messages = {payload[1] for ok, payload in outcomes.values() if not ok}
    assert all(not ok for ok, _ in outcomes.values()) and len(messages) == 1, outcomes
    line = messages.pop()
    assert "memory://" in line and "inside each process" in line, line
