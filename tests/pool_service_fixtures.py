"""Shared pieces of the pool service's tests: a real PostgreSQL server run as a non-root user in a temporary
directory, a `serve` process, the tiny digits job, and waiting on conditions with generous deadlines."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROFILE = Path(__file__).with_name("data") / "pool_digits.prof.json"
PG_BIN = Path("/usr/lib/postgresql/15/bin")
NOBODY = 65534


def env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return e


def wait_for(cond: Callable[[], Any], what: str, deadline_s: float = 180.0, every: float = 0.3) -> Any:
    """Poll ``cond`` until it returns something truthy; fail naming ``what`` after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")
        time.sleep(every)


def free_port() -> int:
    for _ in range(200):
        port = random.randint(20000, 55000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _as_nobody(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    pre = [] if os.geteuid() != 0 else ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return subprocess.run(pre + cmd, capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL 15 server on 127.0.0.1 for the module (skipped where its binaries are not installed)."""
    if not (PG_BIN / "initdb").exists():
        pytest.skip("PostgreSQL 15 server binaries are not installed (apt-get install postgresql-15)")
    pytest.importorskip("psycopg")
    d = Path(tempfile.mkdtemp(prefix="pool-pg-"))
    os.chmod(d, 0o700)
    if os.geteuid() == 0:
        os.chown(d, NOBODY, NOBODY)
    data = d / "data"
    r = _as_nobody([str(PG_BIN / "initdb"), "-D", str(data), "-U", "pool", "--auth=trust", "-E", "UTF8"],
                   cwd="/")
    assert r.returncode == 0, r.stderr
    port = free_port()
    r = _as_nobody([str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(d / "log"), "-w", "-t", "120", "-o",
                    f"-h 127.0.0.1 -p {port} -k {d} -c fsync=off -c full_page_writes=off", "start"], cwd="/")
    assert r.returncode == 0, r.stderr + (d / "log").read_text() if (d / "log").exists() else r.stderr
    try:
        yield f"postgresql+psycopg://pool@127.0.0.1:{port}/postgres"
    finally:
        _as_nobody([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], cwd="/")
        shutil.rmtree(d, ignore_errors=True)


def fresh_pg_db(url: str) -> str:
    """A new database on the server of ``url`` (each service its own)."""
    import sqlalchemy as sa

    name = f"pool_{random.randrange(1 << 30)}"
    eng = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {name}"))
    eng.dispose()
    return url.rsplit("/", 1)[0] + "/" + name


def digits_plan(workers: int, out: Path) -> Path:
    """A plan of the digits model on ``workers`` (from the committed profile; torch-free)."""
    from partitioner.optimizer import partition
    from profiler.profile import load_profile

    plan = partition(load_profile(PROFILE), workers, 1e9)
    out.write_text(json.dumps(plan.to_json()))
    return out


class Serve:
    """A ``serve`` process on a state directory."""

    def __init__(self, state: Path, devices: str, *extra: str) -> None:
        self.state = state
        self.args = ["--devices", devices, "--state-dir", str(state), *extra]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Serve":
        info = self.state / "service.json"
        if info.exists():
            info.unlink()
        self.log = open(self.state.parent / f"{self.state.name}-serve.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "pipedream_ft.pool.service", "serve", *self.args],
                                     env=env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: info.exists() or self.proc.poll() is not None, "the service to start", 120)
        assert self.proc.poll() is None, self.output()
        self.url = json.loads(info.read_text())["url"]
        self.token = (self.state / "token").read_text().strip()
        return self

    def output(self) -> str:
        return (self.state.parent / f"{self.state.name}-serve.log").read_text()

    def cli(self, *args: str, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "pipedream_ft.pool.service", *args, "--state-dir", str(self.state)]
                           if args[0] not in ("submit",) else
                           [sys.executable, "-m", "pipedream_ft.pool.service", args[0], "--state-dir", str(self.state),
                            *args[1:]],
                           env=env(), cwd=cwd, capture_output=True, text=True, timeout=120)
        if check:
            assert r.returncode == 0, r.stderr
        return r

    def api(self, method: str, path: str, body: Any = None) -> Any:
        import httpx

        r = httpx.request(method, self.url + path, json=body, headers={"Authorization": f"Bearer {self.token}"},
                          timeout=60)
        r.raise_for_status()
        return r.json()

    def job(self, name: str) -> dict[str, Any]:
        return self.api("GET", f"/api/jobs/{name}")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def kill_jobs(state: Path) -> None:
    """End every launch the pool's files name (a test's cleanup)."""
    from pipedream_ft.pool.service.runner import LaunchHandle, Runner

    for pid_file in state.glob("jobs/*/launch-*/pid"):
        d = json.loads(pid_file.read_text())
        h = LaunchHandle(d["pid"], d["start"])
        if h.alive():
            Runner.kill(h)
