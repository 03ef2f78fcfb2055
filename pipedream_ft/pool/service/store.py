"""The pool's database: every fact about jobs, launches, allocations and the policy, and the service lease.

SQLAlchemy Core over SQLite (the default: a file created 0600, WAL mode) or PostgreSQL (by URL). The record is
the source of truth: the service writes a row *before* the action it describes (a launch row before the
process starts, a stop request before the SIGTERM), so a service that restarts re-attaches by reading them.
One service at a time holds the database's lease; a second one is refused with one line.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from ..errors import PoolError

__all__ = ["Store", "TERMINAL", "STATES", "LeaseHeld", "sqlite_url"]

STATES = ("queued", "running", "resizing", "completed", "failed", "cancelled")
TERMINAL = ("completed", "failed", "cancelled")

meta = sa.MetaData()

jobs = sa.Table(
    "jobs", meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("workers", sa.Integer, nullable=False),
    sa.Column("min_workers", sa.Integer, nullable=False),
    sa.Column("max_workers", sa.Integer, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False, default=0),
    sa.Column("steps", sa.Integer, nullable=False),
    sa.Column("profile", sa.Text, nullable=False),
    sa.Column("argv", sa.Text, nullable=False),           # JSON list: what follows `torchrun --nproc-per-node n`
    sa.Column("cwd", sa.Text, nullable=False),
    sa.Column("env", sa.Text, nullable=False, default="{}"),  # JSON: extra environment for the job
    sa.Column("ckpt_url", sa.Text, nullable=False, unique=True),
    sa.Column("submitted", sa.Float, nullable=False),
    sa.Column("started", sa.Float),
    sa.Column("finished", sa.Float),
    sa.Column("target", sa.Integer, nullable=False, default=0),   # the policy's latest decision
    sa.Column("since", sa.Float, nullable=False),                 # when its current allocation state began
    sa.Column("attained", sa.Float, nullable=False, default=0.0),  # device-seconds held before `since`
    sa.Column("progress", sa.Integer, nullable=False, default=0),  # minibatches done (from its metrics)
    sa.Column("throughput", sa.Float),                             # measured minibatches/s (latest launch)
    sa.Column("failures", sa.Integer, nullable=False, default=0),
    sa.Column("max_retries", sa.Integer, nullable=False, default=2),
    sa.Column("cancel", sa.Boolean, nullable=False, default=False),
    sa.Column("reason", sa.Text),
)

launches = sa.Table(
    "launches", meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), nullable=False, index=True),
    sa.Column("workers", sa.Integer, nullable=False),
    sa.Column("slots", sa.Text, nullable=False),           # JSON list of the pool's slot indices
    sa.Column("dir", sa.Text, nullable=False),             # the launch's directory (pid file, exit file)
    sa.Column("pid", sa.Integer),                          # the shim: leader of the launch's process group
    sa.Column("proc_start", sa.String(40)),                # its start time in /proc (pid reuse guard)
    sa.Column("requested", sa.Float, nullable=False),      # row written (before the process starts)
    sa.Column("started", sa.Float),
    sa.Column("first_update", sa.Float),
    sa.Column("start_progress", sa.Integer),
    sa.Column("stop", sa.String(20)),                      # resize / preempt / cancel: why it was stopped
    sa.Column("stop_requested", sa.Float),
    sa.Column("ended", sa.Float),
    sa.Column("exit_status", sa.Integer),
    sa.Column("outcome", sa.String(20)),                   # completed / stopped / failed / lost
)

allocations = sa.Table(
    "allocations", meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), nullable=False, index=True),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("workers", sa.Integer, nullable=False),
)

events = sa.Table(
    "events", meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("kind", sa.String(40), nullable=False),
    sa.Column("job_id", sa.Integer),
    sa.Column("detail", sa.Text, nullable=False, default=""),
)

settings = sa.Table(
    "settings", meta,
    sa.Column("key", sa.String(60), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

lease = sa.Table(
    "lease", meta,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("owner", sa.String(40), nullable=False),
    sa.Column("host", sa.String(200), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("heartbeat", sa.Float, nullable=False),
)


class LeaseHeld(PoolError):
    """Another live service holds the database."""


def sqlite_url(path: str | os.PathLike[str]) -> str:
    return f"sqlite:///{Path(path).resolve()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Store:
    """The pool's tables on one database URL (``sqlite:///path`` or ``postgresql+psycopg://...``)."""

    def __init__(self, url: str, lease_s: float = 30.0) -> None:
        self.url = url
        self.lease_s = float(lease_s)
        self.owner = uuid.uuid4().hex
        if url.startswith("sqlite"):
            path = url.split("///", 1)[1] if "///" in url else ""
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)  # created 0600 before SQLite opens it
                os.close(fd)
            self.engine: Engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

            @event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn: Any, _rec: Any) -> None:
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()
        else:
            try:
                self.engine = sa.create_engine(url, pool_pre_ping=True)
            except Exception as exc:  # noqa: BLE001 - a bad URL is the user's
                raise PoolError(f"database {url!r}: {exc}") from None
        try:
            meta.create_all(self.engine)
        except sa.exc.SQLAlchemyError as exc:
            raise PoolError(f"database {self.safe_url}: {str(exc).splitlines()[0]}") from None

    @property
    def safe_url(self) -> str:
        return sa.engine.make_url(self.url).render_as_string(hide_password=True)

    def close(self) -> None:
        self.engine.dispose()

    def begin(self) -> Any:
        return self.engine.begin()

    # -- the lease ----------------------------------------------------------------------------------------

    def acquire_lease(self) -> None:
        """Take the lease, or raise :class:`LeaseHeld` naming the live holder. A holder is dead when its
        heartbeat is older than ``lease_s``, or (same host) its process is gone."""
        now = time.time()
        host = socket.gethostname()
        mine = {"owner": self.owner, "host": host, "pid": os.getpid(), "heartbeat": now}
        with self.begin() as c:
            row = c.execute(sa.select(lease).where(lease.c.id == 1)).mappings().first()
            if row is None:
                try:
                    c.execute(lease.insert().values(id=1, **mine))
                    return
                except IntegrityError:
                    pass  # raced: read it again below
        with self.begin() as c:
            row = c.execute(sa.select(lease).where(lease.c.id == 1)).mappings().first()
            assert row is not None
            dead = now - row["heartbeat"] > self.lease_s or (row["host"] == host and not _pid_alive(row["pid"]))
            if row["owner"] != self.owner and not dead:
                raise LeaseHeld(f"the pool database {self.safe_url} is held by a running service (pid {row['pid']} "
                                f"on {row['host']}, heartbeat {now - row['heartbeat']:.0f} s ago)")
            got = c.execute(lease.update().where(lease.c.id == 1, lease.c.owner == row["owner"],
                                                 lease.c.heartbeat == row["heartbeat"]).values(**mine)).rowcount
            if got != 1:
                raise LeaseHeld(f"the pool database {self.safe_url} was taken by another service just now")

    def renew_lease(self) -> None:
        with self.begin() as c:
            got = c.execute(lease.update().where(lease.c.id == 1, lease.c.owner == self.owner)
                            .values(heartbeat=time.time())).rowcount
        if got != 1:
            raise LeaseHeld(f"the pool database {self.safe_url}: this service lost its lease")

    def release_lease(self) -> None:
        with self.begin() as c:
            c.execute(lease.delete().where(lease.c.id == 1, lease.c.owner == self.owner))

    # -- settings and events ------------------------------------------------------------------------------

    def get_setting(self, key: str, default: str | None = None) -> str | None:
        with self.engine.connect() as c:
            v = c.execute(sa.select(settings.c.value).where(settings.c.key == key)).scalar()
        return default if v is None else v

    def set_setting(self, key: str, value: str, conn: Any = None) -> None:
        def run(c: Any) -> None:
            if c.execute(settings.update().where(settings.c.key == key).values(value=value)).rowcount == 0:
                c.execute(settings.insert().values(key=key, value=value))
        if conn is not None:
            run(conn)
        else:
            with self.begin() as c:
                run(c)

    def log_event(self, kind: str, detail: str = "", job_id: int | None = None, conn: Any = None,
                  at: float | None = None) -> None:
        values = dict(time=time.time() if at is None else at, kind=kind, job_id=job_id, detail=detail)
        if conn is not None:
            conn.execute(events.insert().values(**values))
        else:
            with self.begin() as c:
                c.execute(events.insert().values(**values))

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        q = sa.select(events).order_by(events.c.id)
        if kind:
            q = q.where(events.c.kind == kind)
        with self.engine.connect() as c:
            return [dict(r) for r in c.execute(q).mappings()]

    # -- jobs ---------------------------------------------------------------------------------------------

    def add_job(self, **values: Any) -> int:
        now = time.time()
        values = {"submitted": now, "since": now, "state": "queued", "target": 0, "attained": 0.0, "progress": 0,
                  "failures": 0, "cancel": False, **values}
        values["argv"] = json.dumps(values["argv"])
        values["env"] = json.dumps(values.get("env") or {})
        try:
            with self.begin() as c:
                if c.execute(sa.select(jobs.c.id).where(jobs.c.name == values["name"])).first():
                    raise PoolError(f"a job named {values['name']!r} exists already")
                if c.execute(sa.select(jobs.c.name).where(jobs.c.ckpt_url == values["ckpt_url"])).first():
                    owner = c.execute(sa.select(jobs.c.name).where(jobs.c.ckpt_url == values["ckpt_url"])).scalar()
                    raise PoolError(f"checkpoint location {values['ckpt_url']} belongs to job {owner!r}")
                job_id = int(c.execute(jobs.insert().values(**values)).inserted_primary_key[0])
                self.log_event("submitted", values["name"], job_id, conn=c, at=now)
        except IntegrityError as exc:
            raise PoolError(f"job {values['name']!r}: {str(exc.orig).splitlines()[0]}") from None
        return job_id

    def job(self, key: int | str) -> dict[str, Any]:
        """A job by id or name; :class:`PoolError` if there is none."""
        with self.engine.connect() as c:
            if isinstance(key, int) or str(key).isdigit():
                row = c.execute(sa.select(jobs).where(jobs.c.id == int(key))).mappings().first()
            else:
                row = c.execute(sa.select(jobs).where(jobs.c.name == str(key))).mappings().first()
        if row is None:
            raise PoolError(f"no job {key!r} in the pool")
        return _job_dict(row)

    def jobs(self, active_only: bool = False) -> list[dict[str, Any]]:
        q = sa.select(jobs).order_by(jobs.c.id)
        if active_only:
            q = q.where(jobs.c.state.not_in(TERMINAL))
        with self.engine.connect() as c:
            return [_job_dict(r) for r in c.execute(q).mappings()]

    def update_job(self, job_id: int, conn: Any = None, **values: Any) -> None:
        if conn is not None:
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(**values))
        else:
            with self.begin() as c:
                c.execute(jobs.update().where(jobs.c.id == job_id).values(**values))

    def record_allocation(self, job_id: int, workers: int, at: float, conn: Any) -> None:
        conn.execute(allocations.insert().values(job_id=job_id, time=at, workers=workers))

    def allocations(self, job_id: int | None = None) -> list[dict[str, Any]]:
        q = sa.select(allocations).order_by(allocations.c.id)
        if job_id is not None:
            q = q.where(allocations.c.job_id == job_id)
        with self.engine.connect() as c:
            return [dict(r) for r in c.execute(q).mappings()]

    # -- launches -----------------------------------------------------------------------------------------

    def add_launch(self, conn: Any, **values: Any) -> int:
        values["slots"] = json.dumps(values["slots"])
        return int(conn.execute(launches.insert().values(**values)).inserted_primary_key[0])

    def update_launch(self, launch_id: int, conn: Any = None, **values: Any) -> None:
        if conn is not None:
            conn.execute(launches.update().where(launches.c.id == launch_id).values(**values))
        else:
            with self.begin() as c:
                c.execute(launches.update().where(launches.c.id == launch_id).values(**values))

    def launches(self, job_id: int | None = None, open_only: bool = False) -> list[dict[str, Any]]:
        q = sa.select(launches).order_by(launches.c.id)
        if job_id is not None:
            q = q.where(launches.c.job_id == job_id)
        if open_only:
            q = q.where(launches.c.ended.is_(None))
        with self.engine.connect() as c:
            return [_launch_dict(r) for r in c.execute(q).mappings()]

    def iter_tables(self) -> Iterator[str]:
        yield from meta.tables


def _job_dict(row: Any) -> dict[str, Any]:
    d = dict(row)
    d["argv"] = json.loads(d["argv"])
    d["env"] = json.loads(d["env"] or "{}")
    d["cancel"] = bool(d["cancel"])
    return d


def _launch_dict(row: Any) -> dict[str, Any]:
    d = dict(row)
    d["slots"] = json.loads(d["slots"])
    return d
