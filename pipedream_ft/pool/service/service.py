"""The pool service's round loop: runs the policy on the jobs' records and makes the processes match.

Every tick (``tick_s``) it collects launches that ended, reads progress, and reconciles: a job whose launch
holds another size than the policy's latest decision (``target``) is stopped (a row first, then SIGTERM; killed
past ``stop_deadline_s``); a job with a target and no launch is started once enough slots are free (a row first,
then the process). Every ``round_s`` (and at once after a submission, an end or a policy switch) the policy
decides new targets. A service that starts reads its open launches and re-attaches to those still running.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from ..errors import PoolError
from ..job import JobView
from ..policy import Policy, check_allocation, make_policy, order_key
from ..throughput import ThroughputModel
from .progress import read_progress
from .runner import Devices, LaunchHandle, Runner
from .store import Store

__all__ = ["PoolService", "PROFILE_FILE", "job_dir"]

PROFILE_FILE = "profile.json"
"""Where a job's profile is placed under a local checkpoint location, for the runtime's elastic re-planning."""


def job_dir(state_dir: Path, name: str) -> Path:
    return Path(state_dir) / "jobs" / name


def failure_line(log: Path) -> str:
    """The line of a job's log that says why it failed (the last error line, else the last line)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 16384))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if "Error" in ln or "error:" in ln:
            return ln[:400]
    return lines[-1][:400] if lines else "the job exited with no output"


class PoolService:
    """One pool: ``devices``, the ``store`` (lease held by :meth:`start`), jobs' files under ``state_dir``."""

    def __init__(self, store: Store, devices: Devices, state_dir: Path, *, policy: str = "elastic-fifo",
                 round_s: float = 60.0, tick_s: float = 0.5, stop_deadline_s: float = 60.0,
                 policy_options: Mapping[str, Any] | None = None, runner: Runner | None = None) -> None:
        self.store = store
        self.devices = devices
        self.state_dir = Path(state_dir)
        self.round_s = float(round_s)
        self.tick_s = float(tick_s)
        self.stop_deadline_s = float(stop_deadline_s)
        self.policy_options = dict(policy_options or {})
        self.runner = runner or Runner(devices)
        self.throughput = ThroughputModel({}, cache_dir=self.state_dir / "throughput")
        self.handles: dict[int, LaunchHandle] = {}
        self.dirty = threading.Event()
        self._stop = threading.Event()
        self._last_round = 0.0
        self.initial_policy = policy
        self.policy_name = policy
        self.policy: Policy = make_policy(policy, **self.policy_options)

    # -- start and stop -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Take the lease, record the pool, and re-attach to the launches the records say are open."""
        self.store.acquire_lease()
        saved = self.store.get_setting("devices")
        if saved is not None and saved != self.devices.spec():
            self.store.release_lease()
            raise PoolError(f"this pool's database was made for --devices {saved}, not {self.devices.spec()}")
        self.store.set_setting("devices", self.devices.spec())
        current = self.store.get_setting("policy")
        if current is None:
            self.store.set_setting("policy", self.policy_name)
            self.store.log_event("policy", self.policy_name)
        else:
            self.policy_name, self.policy = current, make_policy(current, **self.policy_options)
        self.store.set_setting("policy_options", json.dumps(self.policy_options))
        self.store.log_event("service-start", f"pid {__import__('os').getpid()}")
        for launch in self.store.launches(open_only=True):
            h = self.runner.attach(Path(launch["dir"]), launch["pid"], launch["proc_start"])
            if h is not None:
                self.handles[launch["id"]] = h
                self.store.log_event("re-attached", f"launch {launch['id']} pid {h.pid}", launch["job_id"])
        self.dirty.set()

    def run(self) -> None:
        """Tick until :meth:`stop`."""
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.tick_s)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Let go of the lease; the jobs keep running (a service that starts again re-attaches)."""
        self.store.release_lease()

    # -- one tick -----------------------------------------------------------------------------------------

    def tick(self) -> None:
        now = time.time()
        self.store.renew_lease()
        self._collect(now)
        self._read_progress(now)
        if self.dirty.is_set() or now - self._last_round >= self.round_s:
            self.dirty.clear()
            self._last_round = now
            self._round(now)
        self._reconcile(time.time())

    def _open(self) -> dict[int, dict[str, Any]]:
        """Open launches by job id."""
        return {l["job_id"]: l for l in self.store.launches(open_only=True)}

    def _collect(self, now: float) -> None:
        for launch in self.store.launches(open_only=True):
            h = self.handles.get(launch["id"])
            if h is None:  # started by an earlier service: found by its recorded pid, else its pid file
                h = self.runner.attach(Path(launch["dir"]), launch["pid"], launch["proc_start"])
                if h is not None:
                    self.handles[launch["id"]] = h
            if h is not None and h.alive():
                continue
            if (h is None and launch["pid"] is None and self.runner.read_pid(Path(launch["dir"])) is None
                    and now - launch["requested"] < 30):
                continue  # its launcher has not written its pid file yet
            self.handles.pop(launch["id"], None)
            self._ended(launch, self.runner.exit_status(Path(launch["dir"])), now)

    def _ended(self, launch: dict[str, Any], rc: int | None, now: float) -> None:
        job = self.store.job(launch["job_id"])
        d = job_dir(self.state_dir, job["name"])
        prog = read_progress(d / "metrics").minibatches
        held = launch["workers"] * max(0.0, now - job["since"])
        common = dict(progress=max(prog, job["progress"]), since=now, attained=job["attained"] + held)
        if launch["stop"] == "cancel" or job["cancel"]:
            outcome, values = "stopped", dict(state="cancelled", finished=now, target=0)
        elif rc == 0 and (launch["stop"] is None or prog >= job["steps"]):
            outcome, values = "completed", dict(state="completed", finished=now, target=0)
        elif launch["stop"] == "resize" and job["target"] > 0:
            outcome, values = "stopped", dict(state="resizing")  # relaunched on the new size once it is free
        elif launch["stop"] in ("resize", "preempt"):
            outcome, values = "stopped", dict(state="queued")
        elif rc is None:
            outcome, values = "lost", dict(state="queued")  # died with no record (with the machine): resume
        else:
            failures = job["failures"] + 1
            if failures > job["max_retries"]:
                reason = f"exit status {rc} after {failures} attempts: {failure_line(d / 'log')}"
                outcome, values = "failed", dict(state="failed", finished=now, failures=failures, reason=reason,
                                                 target=0)
            else:
                outcome, values = "failed", dict(state="queued", failures=failures)
        with self.store.begin() as c:
            self.store.update_launch(launch["id"], conn=c, ended=now, exit_status=rc, outcome=outcome)
            self.store.update_job(job["id"], conn=c, **common, **values)
            self.store.record_allocation(job["id"], 0, now, c)
            self.store.log_event("ended", f"launch {launch['id']} exit {rc} ({outcome}); job {values['state']}",
                                 job["id"], conn=c, at=now)
        self.dirty.set()

    def _read_progress(self, now: float) -> None:
        for job_id, launch in self._open().items():
            job = self.store.job(job_id)
            p = read_progress(job_dir(self.state_dir, job["name"]) / "metrics", since=launch["started"])
            values: dict[str, Any] = {}
            if p.minibatches > job["progress"]:
                values["progress"] = p.minibatches
            if p.rate is not None:
                values["throughput"] = p.rate
            if values:
                self.store.update_job(job_id, **values)
            if (launch["first_update"] is None and p.time is not None and launch["started"] is not None
                    and p.time > launch["started"] and p.minibatches > (launch["start_progress"] or 0)):
                self.store.update_launch(launch["id"], first_update=p.time)

    # -- the policy -----------------------------------------------------------------------------------------

    def views(self, now: float) -> list[JobView]:
        open_ = self._open()
        out = []
        for job in self.store.jobs(active_only=True):
            if job["cancel"]:
                continue
            name = job["name"]
            if name not in self.throughput.profiles:
                self.throughput.profiles[name] = Path(job["profile"])
            sizes = range(job["min_workers"], min(job["max_workers"], self.devices.count) + 1)
            curve = self.throughput.curve(name, sizes)
            launch = open_.get(job["id"])
            # a job moving to a new size (stopping for a resize, or stopped and waiting to be relaunched) holds
            # the size it is moving to: the policy sees its own last decision, not a job that left the pool
            if launch is not None and launch["stop"] is None:
                alloc = launch["workers"]
            elif launch is not None:
                alloc = job["target"] if launch["stop"] == "resize" else 0
            else:
                alloc = job["target"]
            since = job["since"]
            if launch is not None and launch["stop"] is None:  # a slice counts from the first update, not start-up
                since = launch["first_update"] or now
            elif alloc:
                since = now
            out.append(JobView(name, job["submitted"], job["workers"], job["min_workers"], job["max_workers"],
                               job["priority"], alloc, since, job["attained"] + alloc * max(0.0, now - since),
                               float(max(job["steps"] - job["progress"], 1)), float(job["steps"]),
                               job["started"] is not None, curve))
        return out

    def _round(self, now: float) -> None:
        pending = self.store.get_setting("policy_pending")
        if pending and pending != self.policy_name:
            self.policy = make_policy(pending, **self.policy_options)
            self.policy_name = pending
            with self.store.begin() as c:
                self.store.set_setting("policy", pending, conn=c)
                self.store.set_setting("policy_pending", "", conn=c)
                self.store.log_event("policy", pending, conn=c, at=now)
        elif pending:
            self.store.set_setting("policy_pending", "")
        views = self.views(now)
        if not views:
            return
        want = check_allocation(self.policy_name, self.policy.allocate(now, views, self.devices.count), views,
                                self.devices.count)
        by_name = {j["name"]: j for j in self.store.jobs(active_only=True)}
        with self.store.begin() as c:
            for v in views:
                n = want.get(v.name, 0)
                if by_name[v.name]["target"] != n:
                    self.store.update_job(by_name[v.name]["id"], conn=c, target=n)
                    self.store.log_event("decision", f"{self.policy_name}: {v.allocation} -> {n} workers",
                                         by_name[v.name]["id"], conn=c, at=now)

    # -- making the processes match ---------------------------------------------------------------------------

    def _reconcile(self, now: float) -> None:
        open_ = self._open()
        jobs = self.store.jobs(active_only=True)
        for job in jobs:
            launch = open_.get(job["id"])
            if launch is None:
                if job["cancel"]:
                    with self.store.begin() as c:
                        self.store.update_job(job["id"], conn=c, state="cancelled", finished=now, target=0)
                        self.store.log_event("cancelled", "before it ran" if not job["started"] else "while queued",
                                             job["id"], conn=c, at=now)
                continue
            h = self.handles.get(launch["id"])
            if launch["stop"] is not None:
                if h is not None and now - launch["stop_requested"] > self.stop_deadline_s:
                    self.store.log_event("killed", f"launch {launch['id']}: no exit {self.stop_deadline_s:.0f} s "
                                         "after SIGTERM", job["id"])
                    self.runner.kill(h)
                continue
            why = "cancel" if job["cancel"] else ("preempt" if job["target"] == 0 else
                                                    "resize" if job["target"] != launch["workers"] else None)
            if why is None or h is None:
                continue
            with self.store.begin() as c:  # the row first, then the signal
                self.store.update_launch(launch["id"], conn=c, stop=why, stop_requested=now)
                self.store.update_job(job["id"], conn=c, state="resizing")
                self.store.log_event("stop", f"{why}: launch {launch['id']} ({launch['workers']} -> "
                                     f"{0 if why != 'resize' else job['target']} workers)", job["id"], conn=c, at=now)
            self.runner.terminate(h)
        used = {s for l in self._open().values() for s in l["slots"]}
        free = [s for s in range(self.devices.count) if s not in used]
        waiting = [j for j in jobs if j["id"] not in open_ and j["target"] > 0 and not j["cancel"]]
        waiting.sort(key=lambda j: (-j["priority"], j["submitted"], j["name"]))
        for job in waiting:
            if job["target"] > len(free):
                continue
            slots, free = free[:job["target"]], free[job["target"]:]
            self._launch(job, slots, time.time())

    def _launch(self, job: dict[str, Any], slots: list[int], now: float) -> None:
        d = job_dir(self.state_dir, job["name"])
        self._place_profile(job)
        n = len(slots)
        with self.store.begin() as c:  # the row first, then the process
            count = len(self.store.launches(job["id"])) + 1
            launch_dir = d / f"launch-{count}"
            launch_id = self.store.add_launch(c, job_id=job["id"], workers=n, slots=slots, dir=str(launch_dir),
                                              requested=now, start_progress=job["progress"])
            self.store.update_job(job["id"], conn=c, state="running", since=now,
                                  started=job["started"] if job["started"] is not None else now)
            self.store.record_allocation(job["id"], n, now, c)
            self.store.log_event("launch", f"launch {launch_id} on {n} workers, slots {slots}", job["id"], conn=c,
                                 at=now)
        with open(d / "log", "ab") as f:
            f.write(f"--- pool: launch {launch_id} on {n} workers (slots {slots}) ---\n".encode())
        env = {**job["env"], "PIPEDREAM_FT_METRICS_DIR": str(d / "metrics"), "PIPEDREAM_FT_LOG_DIR": str(d / "ft-logs"),
               "PIPEDREAM_FT_PROFILE": job["profile"]}  # a launch on another count than the plan's re-plans from it
        try:
            h = self.runner.start(launch_dir, n, slots, job["argv"], job["cwd"], env, d / "log")
        except PoolError as exc:
            with self.store.begin() as c:
                self.store.update_launch(launch_id, conn=c, ended=time.time(), outcome="failed")
                self.store.update_job(job["id"], conn=c, state="failed", reason=str(exc), finished=time.time())
            return
        from .shim import proc_start

        self.handles[launch_id] = h
        self.store.update_launch(launch_id, pid=h.pid, proc_start=proc_start(h.pid), started=time.time())

    def _place_profile(self, job: dict[str, Any]) -> None:
        """Put the job's profile beside its (local) checkpoints, where the runtime re-plans from on a resize."""
        url = job["ckpt_url"]
        if "://" in url and not url.startswith("file://"):
            return
        target = Path(url.removeprefix("file://")) / PROFILE_FILE
        if target.exists():
            return
        from profiler.profile import load_profile

        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(load_profile(job["profile"]).to_json()))
        tmp.replace(target)
