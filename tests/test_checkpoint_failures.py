"""Bad storage while training: a full disk, a part deleted between its write and the commit, a read-only bucket,
credentials that expire mid-run. Training goes on (save returns at once), the log says once what failed and how
long since the last commit, nothing uncommitted is ever loaded, and checkpoints commit again once it works."""

from __future__ import annotations

import errno
import logging
import time
import uuid

import pytest
import torch

from pipedream_ft.checkpoint import CheckpointError, CheckpointWriter, RetryConfig, Storage, list_committed, load_latest
from pipedream_ft.checkpoint import format as fmt

try:
    from tests.s3server import SeaweedS3
except ImportError:  # tests/ not importable as a package: pytest put tests/ itself on sys.path
    from s3server import SeaweedS3  # type: ignore[no-redef]

pytestmark = pytest.mark.timeout(180)

FAST = RetryConfig(attempts=2, delay_s=0.01, max_delay_s=0.02)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("pipedream_ft.checkpoint")]


def writer(storage: Storage, name: str = "a", parts: list[str] | None = None, **kw) -> CheckpointWriter:
    kw.setdefault("poll_interval_s", 0.005)
    kw.setdefault("max_poll_interval_s", 0.02)
    kw.setdefault("keep", 10)
    return CheckpointWriter(storage, name, expected_parts=parts or [name], is_committer=(name == "a"), **kw)


def test_full_disk(tmp_path, caplog) -> None:
    st = Storage(str(tmp_path / "ckpt"), retry=FAST)
    real = st.files.write
    full = [False]

    def write(rel: str, data, durable: bool = True) -> None:
        if full[0] and rel.endswith(fmt.PART_DATA_SUFFIX):
            raise OSError(errno.ENOSPC, "No space left on device", rel)
        real(rel, data, durable)

    st.files.write = write  # type: ignore[method-assign]
    w = writer(st, commit_timeout_s=0.3)
    w.save(1, {"x": torch.ones(1000)})
    assert w.flush(10) and w.last_committed == 1
    full[0] = True
    with caplog.at_level(logging.DEBUG, logger="pipedream_ft.checkpoint"):
        handles = []
        for step in (2, 3, 4):
            t0 = time.perf_counter()
            handles.append(w.save(step, {"x": torch.full((1000,), float(step))}))
            assert time.perf_counter() - t0 < 1.0  # training does not wait for the failing storage
            handles[-1].wait(10)
        assert all(isinstance(h.error, CheckpointError) and h.committed is False for h in handles)
        once = warnings_of(caplog)
        assert len(once) == 1, once
        assert "No space left on device" in once[0] and "last commit step 1" in once[0] and "ago" in once[0]
        assert "training goes on" in once[0]
        full[0] = False
        h = w.save(5, {"x": torch.full((1000,), 5.0)})
        assert h.wait(10) and h.committed
    assert any("writes succeed again" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert list_committed(st) == [1, 5]
    step, state = load_latest(st, "a")  # type: ignore[misc]
    assert step == 5 and torch.equal(state["x"], torch.full((1000,), 5.0))
    w.close()


def test_part_deleted_between_write_and_commit(tmp_path, caplog) -> None:
    st = Storage(str(tmp_path / "ckpt"), retry=FAST)
    wa, wb = writer(st, "a", ["a", "b"], commit_timeout_s=0.5), writer(st, "b", ["a", "b"], commit_timeout_s=0.5)
    with caplog.at_level(logging.DEBUG, logger="pipedream_ft.checkpoint"):
        for step in (1, 2):
            hb = wb.save(step, {"x": torch.ones(10)})
            assert hb.wait(10) and hb.ok  # b's part is durable, its meta written ...
            st.delete(fmt.part_data_path(step, "b"))  # ... and then its data vanishes before the commit
            ha = wa.save(step, {"x": torch.ones(10)})
            assert ha.wait(10) and ha.committed is False
            assert "b" in str(ha.error)
        once = warnings_of(caplog)
        assert len(once) == 1, once
        assert "not committed" in once[0] and "missing or incomplete: b" in once[0] and "no commit yet" in once[0]
        assert list_committed(st) == [] and load_latest(st, "a") is None and load_latest(st, "b") is None
        wa.save(3, {"x": torch.ones(10)}), wb.save(3, {"x": torch.ones(10)})
        assert wa.flush(10) and wb.flush(10)
    assert list_committed(st) == [3]
    assert any("step 3 committed after" in r.getMessage() for r in caplog.records)
    wa.close(), wb.close()


# -------------------------------------------------------------------------------------------- S3 cases

RO_KEY, RO_SECRET = "pdft-readonly-key", "pdft-readonly-secret-Yq3"
USER_KEY, USER_SECRET = "pdft-user-key", "pdft-user-secret-Kw8"


@pytest.fixture(scope="module")
def s3_with_identities(tmp_path_factory):
    pytest.importorskip("s3fs")
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed-ids"), identities={
        RO_KEY: (RO_SECRET, ["Read", "List"]),
        USER_KEY: (USER_SECRET, ["Admin", "Read", "List", "Write", "Tagging"]),
    })
    with server:
        yield server


def test_read_only_bucket(s3_with_identities: SeaweedS3, caplog) -> None:
    server = s3_with_identities
    st = Storage(server.url(f"ro-{uuid.uuid4().hex[:8]}"), server.options_for(RO_KEY, RO_SECRET), retry=FAST)
    with pytest.raises(CheckpointError, match="permission denied"):
        st.check_writable()  # what the runtime sees at start: one clear line
    w = writer(st, commit_timeout_s=0.5)
    with caplog.at_level(logging.DEBUG, logger="pipedream_ft.checkpoint"):
        for step in (1, 2, 3):
            t0 = time.perf_counter()
            h = w.save(step, {"x": torch.ones(100)})
            assert time.perf_counter() - t0 < 1.0
            assert h.wait(30) and h.committed is False
    once = warnings_of(caplog)
    assert len(once) == 1, once
    assert "AccessDenied" in once[0] or "Permission" in once[0] or "denied" in once[0].lower()
    assert "no commit yet" in once[0] and RO_SECRET not in caplog.text
    admin = Storage(st.url, server.storage_options)
    assert list_committed(admin) == [] and load_latest(admin, "a") is None
    w.close()


def test_credentials_expire_mid_run(s3_with_identities: SeaweedS3, caplog) -> None:
    server = s3_with_identities
    url = server.url(f"creds-{uuid.uuid4().hex[:8]}")
    st = Storage(url, server.options_for(USER_KEY, USER_SECRET), retry=FAST)
    w = writer(st, commit_timeout_s=1.0)
    try:
        w.save(1, {"x": torch.ones(100)})
        assert w.flush(30) and w.last_committed == 1
        saved = dict(server.identities or {})
        server.identities = {k: v for k, v in saved.items() if k != USER_KEY}  # the key is revoked
        server.restart()
        with caplog.at_level(logging.DEBUG, logger="pipedream_ft.checkpoint"):
            for step in (2, 3):
                h = w.save(step, {"x": torch.full((100,), float(step))})
                assert h.wait(30) and h.committed is False
            once = warnings_of(caplog)
            assert len(once) == 1, once
            assert "last commit step 1" in once[0] and USER_SECRET not in caplog.text
            server.identities = saved  # new credentials arrive (here: the same key is valid again)
            server.restart()
            h = w.save(4, {"x": torch.full((100,), 4.0)})
            assert h.wait(30) and h.committed
        assert list_committed(st) == [1, 4]
        step, state = load_latest(st, "a")  # type: ignore[misc]
        assert step == 4 and torch.equal(state["x"], torch.full((100,), 4.0))
    finally:
        w.close(5)


def test_storage_that_refuses_for_good_is_not_retried_and_leaves_no_half_written_step(tmp_path, caplog) -> None:
    st = Storage(str(tmp_path / "ckpt"), retry=RetryConfig(attempts=4, delay_s=0.01, max_delay_s=0.02))
    real = st.files.write
    calls: list[str] = []

    def write(rel: str, data, durable: bool = True) -> None:
        if rel.endswith(fmt.PART_DATA_SUFFIX) and "part-b" in rel:
            calls.append(rel)
            raise OSError(errno.EFBIG, "File too large", rel)
        real(rel, data, durable)

    st.files.write = write  # type: ignore[method-assign]
    wa, wb = writer(st, "a", ["a", "b"], commit_timeout_s=30), writer(st, "b", ["a", "b"], commit_timeout_s=30)
    with caplog.at_level(logging.DEBUG, logger="pipedream_ft.checkpoint"):
        hb = wb.save(1, {"x": torch.ones(10)})
        assert hb.wait(10) and isinstance(hb.error, CheckpointError)
        assert calls == [fmt.part_data_path(1, "b")]  # one try: no retry of a write storage refuses for good
        assert "storage refuses it" in str(hb.error) and "File too large" in str(hb.error)
        assert wb.refused is not None
        ha = wa.save(1, {"x": torch.ones(10)})
        deadline = time.monotonic() + 30  # the committer's own part written: the step now waits for b's part
        while not (wa.last_durable == 1 and wa.pending_steps == [1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert wa.last_durable == 1 and wa.pending_steps == [1]
        assert not ha.wait(0.2)  # the committer still waits for b's part ...
        assert wa.give_up("b's storage refused it") == [1]  # ... until it learns it never comes
        assert ha.wait(10) and ha.committed is False
    assert list_committed(st) == [] and not st.exists(fmt.step_dir(1))  # nothing half-written left
    messages = [r.getMessage() for r in caplog.records]
    assert not any("retry 1/" in m or "retrying until" in m for m in messages), messages
    wa.close(), wb.close()
