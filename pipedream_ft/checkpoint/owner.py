"""Who owns a checkpoint location: one job at a time, so that two jobs never write over each other's steps and a
job never resumes from weights another job wrote.

The owner record ``OWNER.json`` at the root of the location names the job (its identity: see
:class:`~pipedream_ft.ft.checkpointer.CheckpointConfig` ``job_id``), the model and plan hashes, where the
owning process runs (host, pid) and a lease: the owner renews its heartbeat every ``lease_s / 4`` seconds, and a
record whose heartbeat is older than ``lease_s`` (or whose process is known dead: same host, pid gone), or that
its job released when it ended, has *expired*. Rules, checked before a job's first write (:meth:`Owner.claim`):

* no record: create it (create-exclusive on local disk; a put then a read-back after ``settle_s`` on object stores);
* the record is this job's (same identity: a torchrun restart, an in-place replacement, a rerun under the same
  ``--rdzv-id``): renew it;
* another model's record: refuse;
* this job owned the location before and another job took it over since: refuse (its checkpoints are the other
  job's; loading them would train on foreign weights);
* another live job's record: refuse;
* an expired record of the same model: take it over (the normal resume of a rerun command whose torchrun made a
  new random run id); logged, the previous owner kept in the record's ``previous`` list.

Before each commit (:meth:`Owner.check`) and at each heartbeat the record must still be this claim's (its random
``token``); otherwise the job stops writing there. A refusal is :class:`OwnershipError` (a set-up error: one line
naming the location and the owner, exit status 2).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from .format import CheckpointError
from .storage import Storage

__all__ = ["OWNER_FILE", "OwnerRecord", "Owner", "OwnershipError"]

log = logging.getLogger(__name__)

OWNER_FILE = "OWNER.json"
_KEEP_PREVIOUS = 32


class OwnershipError(CheckpointError):
    """The checkpoint location belongs to another job (or this job lost it)."""


@dataclass(frozen=True, slots=True)
class OwnerRecord:
    """The content of ``OWNER.json``."""

    job: str
    """The owning job's identity."""
    model_hash: str
    """The model's hash (the profile's structure hash)."""
    plan_hash: str
    """The plan and training semantics' hash."""
    token: str
    """Random, new at every claim: tells this claim from any other, of this job or not."""
    host: str
    pid: int
    heartbeat: float
    """Wall-clock time of the last renewal."""
    lease_s: float
    since: float = 0.0
    """Wall-clock time of the claim."""
    released: bool = False
    """The job ended and gave the location up."""
    previous: tuple[str, ...] = field(default_factory=tuple)
    """Earlier owners, oldest first."""

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc["previous"] = list(self.previous)
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> OwnerRecord:
        try:
            doc = json.loads(data)
            return cls(job=str(doc["job"]), model_hash=str(doc["model_hash"]), plan_hash=str(doc["plan_hash"]),
                       token=str(doc["token"]), host=str(doc["host"]), pid=int(doc["pid"]),
                       heartbeat=float(doc["heartbeat"]), lease_s=float(doc["lease_s"]),
                       since=float(doc.get("since", 0.0)), released=bool(doc.get("released", False)),
                       previous=tuple(str(p) for p in doc.get("previous", ())))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"owner record is malformed: {type(exc).__name__}: {exc}") from None

    def expired(self, now: float) -> bool:
        """Whether the owner is gone: released, its lease ran out, or its process is known dead."""
        if self.released or now > self.heartbeat + self.lease_s:
            return True
        return self.host == socket.gethostname() and not _pid_alive(self.pid)

    def describe(self, now: float) -> str:
        state = "released" if self.released else f"heartbeat {max(0.0, now - self.heartbeat):.0f}s ago"
        return f"job {self.job} (host {self.host}, pid {self.pid}, {state}, lease {self.lease_s:g}s)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


class Owner:
    """This job's claim on a checkpoint location (held by the committing rank)."""

    def __init__(self, storage: Storage, *, job: str, model_hash: str, plan_hash: str, lease_s: float = 60.0,
                 settle_s: float = 0.5, clock: Callable[[], float] = time.time) -> None:
        if not job:
            raise ValueError("job must be a non-empty identity, got ''")
        if not lease_s > 0 or settle_s < 0:
            raise ValueError(f"lease_s must be > 0 and settle_s >= 0, got {lease_s!r}, {settle_s!r}")
        self.storage = storage
        self.job = job
        self.model_hash = model_hash
        self.plan_hash = plan_hash
        self.lease_s = float(lease_s)
        self.settle_s = float(settle_s)
        self.clock = clock
        self.token: str | None = None
        """This claim's token once claimed."""
        self.lost: OwnershipError | None = None
        """Set when a heartbeat found the record taken over."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading and writing the record ----------------------------------------------------------------------

    def read(self) -> OwnerRecord | None:
        try:
            data = self.storage.read_bytes(OWNER_FILE)
        except FileNotFoundError:
            return None
        try:
            return OwnerRecord.from_json(data)
        except CheckpointError as exc:
            raise OwnershipError(f"checkpoint location {self.storage.url}: {exc}; if no job uses this location, "
                                 f"remove {OWNER_FILE}") from None

    def _mine(self, previous: tuple[str, ...] = ()) -> OwnerRecord:
        now = self.clock()
        return OwnerRecord(job=self.job, model_hash=self.model_hash, plan_hash=self.plan_hash,
                           token=uuid.uuid4().hex, host=socket.gethostname(), pid=os.getpid(), heartbeat=now,
                           lease_s=self.lease_s, since=now, previous=previous[-_KEEP_PREVIOUS:])

    def _refuse(self, why: str) -> OwnershipError:
        return OwnershipError(f"checkpoint location {self.storage.url} {why}")

    # -- the rules -------------------------------------------------------------------------------------------

    def claim(self) -> str:
        """Take the location for this job (the rules in the module docstring); returns what was done, for the
        log. Raises :class:`OwnershipError`."""
        for _ in range(3):
            record = self.read()
            now = self.clock()
            if record is None:
                mine = self._mine()
                if not self.storage.create_exclusive(OWNER_FILE, mine.to_json()):
                    continue  # another job created it first: judge its record
                if not self.storage.exact_create:
                    self._confirm(mine)
                self.token = mine.token
                return "claimed"
            if record.model_hash != self.model_hash:
                raise self._refuse(f"holds checkpoints written for another model ({record.describe(now)}, model hash "
                                   f"{record.model_hash[:12]}, this model's {self.model_hash[:12]}): use another "
                                   "location")
            if record.job == self.job:
                mine = replace(self._mine(record.previous), since=record.since or now)
                self.storage.write_bytes(OWNER_FILE, mine.to_json())
                self.token = mine.token
                return "this job's own location: renewed"
            if self.job in record.previous:
                raise self._refuse(f"was taken over by {record.describe(now)} after this job ({self.job}) last "
                                   "wrote to it: its checkpoints are not this job's; use another location (or "
                                   "start under a new job id to continue from them)")
            if not record.expired(now):
                raise self._refuse(f"is in use by {record.describe(now)}; use another location, or wait until "
                                   "that job ends")
            mine = self._mine(record.previous + (record.job,))
            self.storage.write_bytes(OWNER_FILE, mine.to_json())
            self._confirm(mine)
            self.token = mine.token
            how = "released by it" if record.released else "its lease expired"
            return (f"taken over from {record.describe(now)}: {how}; same model"
                    + ("" if record.plan_hash == self.plan_hash else ", another plan"))
        raise self._refuse("changes owner faster than it can be claimed; use another location")

    def _confirm(self, mine: OwnerRecord) -> None:
        """After a write that was not exclusive: wait ``settle_s`` and check that it is still ours."""
        if self.settle_s:
            time.sleep(self.settle_s)
        record = self.read()
        if record is None or record.token != mine.token:
            now = self.clock()
            other = record.describe(now) if record is not None else "another job (its record vanished)"
            raise self._refuse(f"is in use by {other}, which claimed it at the same time; use another location")

    def adopt(self) -> None:
        """A process of this job that did not claim (an in-place replacement): take over this job's claim."""
        record = self.read()
        if record is None or record.job != self.job:
            now = self.clock()
            raise self._refuse(f"is no longer this job's ({record.describe(now) if record else 'no owner record'})")
        mine = replace(self._mine(record.previous), since=record.since)
        self.storage.write_bytes(OWNER_FILE, mine.to_json())
        self.token = mine.token

    def check(self, step: int | None = None) -> None:
        """Raise :class:`OwnershipError` unless the record is still this claim's (before every commit)."""
        if self.lost is not None:
            raise self.lost
        record = self.read()
        if record is None or record.token != self.token:
            now = self.clock()
            what = f"checkpoint {step} not committed: " if step is not None else ""
            self.lost = self._refuse(f"was taken over by {record.describe(now) if record else 'nobody'}; "
                                     f"{what}this job ({self.job}) stops writing to it")
            raise self.lost

    def renew(self) -> None:
        self.check()
        assert self.token is not None
        record = self.read()
        assert record is not None
        self.storage.write_bytes(OWNER_FILE, replace(record, heartbeat=self.clock(), pid=os.getpid(),
                                                     host=socket.gethostname()).to_json())

    def start_heartbeat(self) -> None:
        """Renew the lease every ``lease_s / 4`` seconds in a daemon thread until :meth:`release`."""
        if self._thread is not None:
            return

        def beat() -> None:
            while not self._stop.wait(self.lease_s / 4):
                try:
                    self.renew()
                except OwnershipError as exc:
                    log.error("%s", exc)
                    return
                except Exception as exc:  # storage trouble: the next beat tries again
                    log.debug("owner heartbeat failed: %s", self.storage.describe_error(exc))

        self._thread = threading.Thread(target=beat, name="checkpoint-owner-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """The job ended: stop the heartbeat and mark the record released (if it is still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.token is None or self.lost is not None:
            return
        try:
            record = self.read()
            if record is not None and record.token == self.token:
                self.storage.write_bytes(OWNER_FILE, replace(record, released=True, heartbeat=self.clock())
                                         .to_json())
        except Exception as exc:  # the lease runs out by itself
            log.warning("cannot release checkpoint location %s: %s", self.storage.url, exc)

