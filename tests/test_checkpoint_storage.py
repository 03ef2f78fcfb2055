"""Storage layer: local directories and memory://, atomic writes, retries, clear errors, redaction."""

from __future__ import annotations

import logging
import os
import uuid

import pytest

from pipedream_ft.checkpoint import CheckpointError, RetryConfig, Storage, StorageError

pytestmark = pytest.mark.timeout(60)

FAST_RETRY = RetryConfig(attempts=3, delay_s=0.01, max_delay_s=0.02)


@pytest.fixture(params=["local", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path) -> Storage:
    if request.param == "local":
        return Storage(str(tmp_path / "ckpt"), retry=FAST_RETRY)
    return Storage(f"memory://pdft-test-{uuid.uuid4().hex}", retry=FAST_RETRY)


def test_write_read_exists_list_delete(storage: Storage) -> None:
    assert storage.list("") == []
    assert not storage.exists("a/b.bin")
    storage.write_bytes("a/b.bin", b"hello")
    storage.write_bytes("a/c.bin", b"")
    storage.write_bytes("top.json", b"{}")
    assert storage.read_bytes("a/b.bin") == b"hello"
    assert storage.read_bytes("a/c.bin") == b""
    assert storage.exists("a/b.bin") and storage.exists("a")
    assert storage.list("") == ["a", "top.json"]
    assert storage.list("a") == ["b.bin", "c.bin"]
    assert storage.list("missing") == []
    storage.write_bytes("a/b.bin", b"replaced")
    assert storage.read_bytes("a/b.bin") == b"replaced"
    storage.delete("a/b.bin")
    storage.delete("a/b.bin")  # deleting a missing object is fine
    assert storage.list("a") == ["c.bin"]
    storage.delete("a", recursive=True)
    assert not storage.exists("a/c.bin")
    assert storage.list("") == ["top.json"]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("a/c.bin")


def test_check_writable_ok_leaves_nothing(storage: Storage) -> None:
    storage.check_writable()
    assert storage.list("") == []


def test_bad_paths_rejected(storage: Storage) -> None:
    with pytest.raises(ValueError, match=r"'\.\.'"):
        storage.write_bytes("../escape", b"x")
    with pytest.raises(ValueError, match="root"):
        storage.delete("", recursive=True)
    with pytest.raises(TypeError, match="data must be bytes"):
        storage.write_bytes("x", "text")  # type: ignore[arg-type]


def test_local_write_is_atomic_and_leaves_no_temp_files(tmp_path) -> None:
    st = Storage(f"file://{tmp_path}/root")
    st.write_bytes("d/x.bin", b"1" * 1000)
    st.write_bytes("d/x.bin", b"2" * 10)
    assert sorted(os.listdir(tmp_path / "root" / "d")) == ["x.bin"]
    assert (tmp_path / "root" / "d" / "x.bin").read_bytes() == b"2" * 10
    assert st.is_local


def test_local_failed_write_removes_temp_file(tmp_path, monkeypatch) -> None:
    st = Storage(str(tmp_path), retry=RetryConfig(attempts=1))

    def boom(src: str, dst: str) -> None:
        raise OSError(5, "injected I/O error")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(StorageError, match="injected I/O error"):
        st.write_bytes("x.bin", b"data")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_unwritable_directory_under_a_regular_file(tmp_path) -> None:
    # A path below a regular file cannot be created, even by root.
    (tmp_path / "file.txt").write_text("not a directory")
    url = str(tmp_path / "file.txt" / "sub")
    st = Storage(url, retry=FAST_RETRY)
    with pytest.raises(CheckpointError) as info:
        st.check_writable()
    msg = str(info.value)
    assert url in msg and "not writable" in msg and "\n" not in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_unwritable_directory_permissions(tmp_path, monkeypatch) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    if os.geteuid() == 0:  # root writes through directory permissions: refuse the write as the kernel would
        real_open = os.open

        def refusing_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(path).startswith(str(d)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing_open)
    try:
        with pytest.raises(CheckpointError, match="permission denied"):
            Storage(str(d), retry=FAST_RETRY).check_writable()
    finally:
        d.chmod(0o700)


def test_transient_errors_are_retried_with_warnings(tmp_path, caplog) -> None:
    st = Storage(str(tmp_path), retry=RetryConfig(attempts=4, delay_s=0.001, max_delay_s=0.002))
    real = st.files.write
    failures = [ConnectionError("endpoint flaked"), TimeoutError("slow")]

    def flaky(rel: str, data: bytes, durable: bool) -> None:
        if failures:
            raise failures.pop(0)
        real(rel, data, durable)

    st.files.write = flaky  # type: ignore[method-assign]
    with caplog.at_level(logging.DEBUG, logger="pipedream_ft.checkpoint.storage"):
        st.write_bytes("x.bin", b"ok")
    assert st.read_bytes("x.bin") == b"ok"
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 2
    # a run of failures is logged once at WARNING; the rest at DEBUG; the recovery at INFO
    assert [r.levelno for r in retries] == [logging.WARNING, logging.DEBUG]
    assert "retry 1/3" in retries[0].getMessage() and "ConnectionError" in retries[0].getMessage()
    assert "retry 2/3" in retries[1].getMessage() and "TimeoutError" in retries[1].getMessage()
    assert any("succeed again" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    caplog.clear()
    failures.append(ConnectionError("again"))
    with caplog.at_level(logging.WARNING, logger="pipedream_ft.checkpoint.storage"):
        st.write_bytes("y.bin", b"ok")  # a new run of failures after a success warns again
    assert len([r for r in caplog.records if "retry 1/3" in r.getMessage()]) == 1


def test_retries_exhausted_raise_storage_error(tmp_path) -> None:
    st = Storage(str(tmp_path), retry=RetryConfig(attempts=2, delay_s=0.001))
    calls = []

    def down(rel: str, data: bytes, durable: bool) -> None:
        calls.append(rel)
        raise ConnectionError("connection refused")

    st.files.write = down  # type: ignore[method-assign]
    with pytest.raises(StorageError, match="after 2 tries"):
        st.write_bytes("x.bin", b"")
    assert len(calls) == 2


def test_permanent_errors_are_not_retried(tmp_path) -> None:
    st = Storage(str(tmp_path), retry=RetryConfig(attempts=5, delay_s=0.001))
    calls = []

    def denied(rel: str, data: bytes, durable: bool) -> None:
        calls.append(rel)
        raise PermissionError(13, "Permission denied", rel)

    st.files.write = denied  # type: ignore[method-assign]
    with pytest.raises(StorageError, match="Permission denied"):
        st.write_bytes("x.bin", b"")
    assert len(calls) == 1


def test_retry_config_validation() -> None:
    with pytest.raises(ValueError, match="attempts must be an int >= 1, got 0"):
        RetryConfig(attempts=0)
    with pytest.raises(ValueError, match="delay_s must be >= 0, got -1"):
        RetryConfig(delay_s=-1)
    with pytest.raises(ValueError, match="url must be non-empty"):
        Storage("")


def test_redaction_of_options_env_and_url(monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-123456")
    st = Storage(
        "s3://AKIDUSER:url-secret-999@bucket/prefix",
        {"key": "AKIDEXAMPLE", "secret": "opt-secret-abcdef", "client_kwargs": {"endpoint_url": "http://h:1"}},
    )
    assert "url-secret-999" not in st.url and "AKIDUSER" not in st.url
    assert st.url == "s3://***@bucket/prefix"
    text = st.redact("a opt-secret-abcdef b env-secret-123456 c AKIDEXAMPLE d http://h:1")
    assert text == "a *** b *** c *** d http://h:1"
    assert "opt-secret" not in repr(st)


def test_unreachable_s3_endpoint_gives_one_clear_error(monkeypatch) -> None:
    pytest.importorskip("s3fs")
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = "unreachable-secret-XYZ"
    st = Storage(
        "s3://some-bucket/run",
        {
            "key": "AKIDTEST",
            "secret": secret,
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
            "skip_instance_cache": True,
        },
        retry=RetryConfig(attempts=2, delay_s=0.01),
    )
    with pytest.raises(CheckpointError) as info:
        st.check_writable()
    msg = str(info.value)
    assert "s3://some-bucket/run" in msg and "unreachable" in msg and secret not in msg


def test_a_file_size_limit_is_refused_for_good_without_retries(tmp_path) -> None:
    """EFBIG (here a real RLIMIT_FSIZE) is not transient: one try, and the error says storage refuses it."""
    import resource

    st = Storage(str(tmp_path / "ckpt"), retry=RetryConfig(attempts=4, delay_s=0.01, max_delay_s=0.02))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(StorageError) as err:
            st.write_bytes("big", b"x" * 10000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert err.value.refused and err.value.permanent and "tries" not in str(err.value)
    assert st.list("") == []  # no temporary file left


def test_per_process_file_systems_are_told() -> None:
    assert Storage(f"memory://pdft-{uuid.uuid4().hex}").per_process()
    assert not Storage("/tmp/somewhere").per_process()


def test_local_files_and_directories_are_never_world_writable(tmp_path) -> None:
    """The umask is honoured, but a permissive one (000) must not make checkpoint data writable by others."""
    old = os.umask(0)
    try:
        s = Storage(str(tmp_path / "ckpt"))
        s.write_bytes("step-00000008/part.bin", b"x" * 10)
        s.write_bytes("a/b/c.bin", b"y")
    finally:
        os.umask(old)
    for root, dirs, files in os.walk(tmp_path / "ckpt"):
        for name in dirs + files:
            mode = os.stat(os.path.join(root, name)).st_mode
            assert not mode & 0o002, f"{os.path.join(root, name)} is world-writable ({oct(mode & 0o777)})"


def test_each_url_gets_one_backend_class(tmp_path) -> None:
    from pipedream_ft.checkpoint.fsspec_files import FsspecFiles
    from pipedream_ft.checkpoint.local_files import LocalFiles

    for url in (str(tmp_path / "a"), f"file://{tmp_path}/b", "relative/dir"):
        st = Storage(url)
        assert isinstance(st.files, LocalFiles) and st.is_local and st.exact_create and st.protocol == "file"
        assert os.path.isabs(st.files.root)
    for url, protocol in (("s3://bucket/prefix", "s3"), (f"memory://pdft-{uuid.uuid4().hex}", "memory")):
        st = Storage(url)
        assert isinstance(st.files, FsspecFiles) and not st.is_local and not st.exact_create
        assert st.protocol == protocol and st.direct_io is False


def test_a_file_system_that_cannot_be_opened_is_said_once_and_not_retried(tmp_path) -> None:
    calls: list[int] = []
    st = Storage("nosuchprotocol-pdft://x/y", retry=RetryConfig(attempts=3, delay_s=0.001))

    def failing_open(exc: BaseException) -> Exception:
        calls.append(1)
        return StorageError(f"cannot open checkpoint storage {st.url}: {st.describe_error(exc)}")

    st.files._open_failed = failing_open  # type: ignore[union-attr]
    with pytest.raises(StorageError, match="cannot open checkpoint storage nosuchprotocol-pdft://x/y"):
        st.write_bytes("x.bin", b"1")
    assert calls == [1]
