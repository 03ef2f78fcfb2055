"""Checkpoints through a real S3 endpoint (SeaweedFS on 127.0.0.1), including an outage during training."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import torch

pytest.importorskip("s3fs")

from pipedream_ft.checkpoint import (  # noqa: E402
    CheckpointError,
    CheckpointWriter,
    RetryConfig,
    Storage,
    list_committed,
    load_latest,
    load_part,
)
from pipedream_ft.checkpoint import format as fmt  # noqa: E402

try:
    from tests.s3server import SECRET_KEY, SeaweedS3, seaweed_s3  # noqa: F401
except ImportError:  # tests/ not importable as a package: pytest put tests/ itself on sys.path
    from s3server import SECRET_KEY, SeaweedS3, seaweed_s3  # type: ignore[no-redef]  # noqa: F401

pytestmark = pytest.mark.timeout(120)

RETRY = RetryConfig(attempts=2, delay_s=0.05, max_delay_s=0.1)


def make_storage(server: SeaweedS3) -> Storage:
    return Storage(server.url(f"run-{uuid.uuid4().hex[:8]}"), server.storage_options, retry=RETRY)


def make_writers(storage: Storage, parts: list[str], **kw) -> list[CheckpointWriter]:
    kw.setdefault("poll_interval_s", 0.02)
    kw.setdefault("max_poll_interval_s", 0.2)
    return [
        CheckpointWriter(storage, name, expected_parts=parts, is_committer=(i == 0), **kw)
        for i, name in enumerate(parts)
    ]


def test_round_trip_through_s3(seaweed_s3: SeaweedS3, caplog) -> None:
    endpoint_url, options = seaweed_s3
    assert endpoint_url.startswith("http://127.0.0.1:") and options["secret"] == SECRET_KEY
    storage = make_storage(seaweed_s3)
    with caplog.at_level(logging.DEBUG):
        storage.check_writable()
        w0, w1 = make_writers(storage, ["stage0", "stage1"], keep=2, metadata={"plan_hash": "abc"})
        state = {"w": torch.randn(64, 32), "b": torch.arange(5), "meta": {"lr": 0.1, "ids": [1, 2, (3, None)]}}
        for step in (1, 2, 3):
            w0.save(step, {**state, "step": step})
            w1.save(step, {"other": torch.full((3,), float(step))})
            assert w1.flush(30) and w0.flush(30)
        assert list_committed(storage) == [2, 3]
        assert storage.list(fmt.step_dir(1)) == []  # step 1 collected (its empty "folder" may linger a while)
        step, got = load_latest(storage, "stage0", expected={"plan_hash": "abc"})  # type: ignore[misc]
        assert step == 3 and got["step"] == 3 and got["meta"] == state["meta"]
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
        assert torch.equal(load_part(storage, 3, "stage1")["other"], torch.full((3,), 3.0))
        w0.close(), w1.close()
    assert SECRET_KEY not in caplog.text


def test_missing_bucket_is_one_clear_error(seaweed_s3: SeaweedS3) -> None:
    storage = Storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run", seaweed_s3.storage_options, retry=RETRY)
    with pytest.raises(CheckpointError, match="bucket does not exist") as info:
        storage.check_writable()
    assert storage.url in str(info.value) and SECRET_KEY not in str(info.value)


def test_missing_credentials_is_one_clear_error(seaweed_s3: SeaweedS3, monkeypatch, tmp_path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {k: v for k, v in seaweed_s3.storage_options.items() if k not in ("key", "secret")}
    storage = Storage(seaweed_s3.url("nocreds"), options, retry=RETRY)
    with pytest.raises(CheckpointError, match="no credentials found"):
        storage.check_writable()


def test_s3_outage_during_training(seaweed_s3: SeaweedS3, caplog) -> None:
    storage = make_storage(seaweed_s3)
    # the deadline gives up step 2 while S3 is down; after the restart a loaded machine has taken 3.6 s to write
    # step 3's parts (reconnecting), so it must leave room for that
    w0, w1 = make_writers(storage, ["a", "b"], commit_timeout_s=10.0, keep=5)
    try:
        with caplog.at_level(logging.DEBUG):
            w0.save(1, {"x": torch.tensor(1)}), w1.save(1, {"x": torch.tensor(1)})
            assert w0.flush(30) and w1.flush(30)
            # Part a of step 2 is durable, then S3 goes down before part b is written.
            h0 = w0.save(2, {"x": torch.tensor(2)})
            h0_part_durable = time.monotonic() + 20
            while not storage.exists(fmt.part_meta_path(2, "a")) and time.monotonic() < h0_part_durable:
                time.sleep(0.02)
            seaweed_s3.stop()
            h1 = w1.save(2, {"x": torch.tensor(2)})
            assert h1.wait(30) and h0.wait(30)
            assert h1.error is not None and h0.committed is False
            # part b's writer says it failed: "retrying until the step's deadline" when its first try fails early
            # enough, else at once "giving up" (a loaded machine can spend the deadline on connection attempts)
            assert "step 2: write failed" in caplog.text
            seaweed_s3.start()
            assert not storage.exists(fmt.commit_path(2))  # half-written step never committed
            w0.save(3, {"x": torch.tensor(3)}), w1.save(3, {"x": torch.tensor(3)})
            assert w0.flush(30) and w1.flush(30)
            assert list_committed(storage) == [1, 3]
            step, got = load_latest(storage, "b")  # type: ignore[misc]
            assert step == 3 and int(got["x"]) == 3
    finally:
        seaweed_s3.start()  # leave the session server running for other tests
        w0.close(5), w1.close(5)
    assert SECRET_KEY not in caplog.text
    assert all(SECRET_KEY not in str(r.args) for r in caplog.records)
