"""The pool service's store on SQLite and on a real PostgreSQL server: the lease, jobs, launches, ownership."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

pytest.importorskip("sqlalchemy")

from pipedream_ft.pool.errors import PoolError  # noqa: E402
from pipedream_ft.pool.service.store import LeaseHeld, Store, sqlite_url  # noqa: E402
from pool_service_fixtures import fresh_pg_db, postgres_url  # noqa: E402,F401

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "pool.db")
    return fresh_pg_db(request.getfixturevalue("postgres_url"))


def _job(name: str, ckpt: str) -> dict:
    return dict(name=name, workers=2, min_workers=1, max_workers=2, priority=0, steps=10, profile="/p.json",
                argv=["-m", "x"], cwd="/", env={}, ckpt_url=ckpt, max_retries=1)


def test_a_second_service_is_refused_and_a_dead_one_s_lease_is_taken(db_url):
    first = Store(db_url)
    first.acquire_lease()
    second = Store(db_url)
    with pytest.raises(LeaseHeld, match="held by a running service"):
        second.acquire_lease()
    first.renew_lease()
    # a holder whose process is gone (same host) is dead at once: a restarted service takes over
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with first.begin() as c:
        from pipedream_ft.pool.service.store import lease

        c.execute(lease.update().values(pid=int(dead.stdout)))
    second.acquire_lease()
    with pytest.raises(LeaseHeld, match="lost its lease"):
        first.renew_lease()
    second.release_lease()
    Store(db_url).acquire_lease()
    for s in (first, second):
        s.close()


def test_jobs_launches_and_checkpoint_ownership(db_url):
    s = Store(db_url)
    a = s.add_job(**_job("a", "/ck/a"))
    with pytest.raises(PoolError, match="belongs to job 'a'"):
        s.add_job(**_job("b", "/ck/a"))
    with pytest.raises(PoolError, match="exists already"):
        s.add_job(**_job("a", "/ck/other"))
    assert s.job("a")["id"] == a and s.job(a)["argv"] == ["-m", "x"] and s.job("a")["state"] == "queued"
    with pytest.raises(PoolError, match="no job 'zz'"):
        s.job("zz")
    with s.begin() as c:
        lid = s.add_launch(c, job_id=a, workers=2, slots=[0, 1], dir="/d", requested=1.0, start_progress=0)
        s.record_allocation(a, 2, 1.0, c)
    assert s.launches(open_only=True)[0]["slots"] == [0, 1]
    s.update_launch(lid, ended=2.0, exit_status=0, outcome="completed")
    assert s.launches(open_only=True) == [] and s.allocations(a)[0]["workers"] == 2
    s.set_setting("policy", "fifo")
    s.set_setting("policy", "goodput")
    assert s.get_setting("policy") == "goodput" and s.get_setting("nothing", "d") == "d"
    s.close()


def test_sqlite_file_is_private_and_in_wal_mode(tmp_path):
    os.umask(0o022)
    s = Store(sqlite_url(tmp_path / "pool.db"))
    assert stat.S_IMODE(os.stat(tmp_path / "pool.db").st_mode) == 0o600
    with s.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    s.close()
