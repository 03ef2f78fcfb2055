"""Checkpointing through the runtime: what a run refuses at start, with one clear message on every rank."""

from __future__ import annotations

import pytest

from dist_helpers import free_port, run_world
from ft_cases import start_case

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def messages(out: dict) -> set[str]:
    assert all(not ok for ok, _ in out.values()), out
    return {payload[1] for _, payload in out.values()}


def test_checkpoint_of_another_model_is_refused_and_left_alone(tmp_path):
    url = tmp_path / "ckpt"
    run_world(start_case, 2, str(url), "mlp")
    before = {p: p.read_bytes() for p in url.rglob("*") if p.is_file()}
    msgs = messages(run_world(start_case, 2, str(url), "skip", expect_failure=True))
    assert len(msgs) == 1 and "written for another model" in msgs.pop()
    assert {p: p.read_bytes() for p in url.rglob("*") if p.is_file()} == before


def test_unreachable_checkpoint_url_stops_at_start():
    options = {"key": "k", "secret": "s3cr3t-value", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
               "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    msgs = messages(run_world(start_case, 2, "s3://bucket/run", "mlp", options, expect_failure=True, timeout=90))
    text = " ".join(msgs)
    assert "unreachable" in text and "s3cr3t-value" not in text


def test_unwritable_checkpoint_directory_stops_at_start(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    msgs = messages(run_world(start_case, 2, str(blocker / "ckpt"), "mlp", expect_failure=True))
    assert any("not writable" in m or "cannot" in m for m in msgs), msgs
