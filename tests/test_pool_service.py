"""The pool service with real processes: torchrun jobs of the sleep model, resized, preempted, resumed, under a
service that is killed -9 and started again; the API's token; every bad submission refused with one line.

The job scenarios wait on conditions (a state, progress) with generous deadlines, never on elapsed time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sqlalchemy")

from pool_service_fixtures import (ROOT, PROFILE, Serve, digits_plan, env, fresh_pg_db, kill_jobs,  # noqa: E402
                                   postgres_url, wait_for)

pytestmark = pytest.mark.timeout(420)

JOB = str(ROOT / "benchmarks" / "pool_sleep_job.py")


@pytest.fixture(scope="module")
def sleep_files(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sleep")
    subprocess.run([sys.executable, JOB, "prepare", str(out), "--forward-ms", "10", "--backward-ms", "20"],
                   env=env(), check=True, timeout=120)
    return out


def submit(pool: Serve, files: Path, name: str, lo: int, hi: int, steps: int, plan: int) -> None:
    pool.cli("submit", "--name", name, "--min-workers", str(lo), "--max-workers", str(hi), "--profile",
             str(files / "sleep.prof.json"), "--", JOB, "--plan", str(files / f"sleep-{plan}.plan.json"),
             "--steps", str(steps), "--forward-ms", "10", "--backward-ms", "20", cwd=files)


def sizes(job: dict) -> list[tuple[int, str | None, str | None]]:
    return [(l["workers"], l["stop"], l["outcome"]) for l in job["launches"]]


def no_overlap(job: dict) -> None:
    """At most one launch of a job at any time: each starts after the previous one ended."""
    ls = job["launches"]
    for a, b in zip(ls, ls[1:]):
        assert a["ended"] is not None and a["ended"] <= b["requested"], ls


def test_resize_down_and_up_and_a_service_killed_and_restarted(tmp_path, sleep_files):
    state = tmp_path / "pool"
    pool = Serve(state, "cpu:2", "--policy", "elastic-fifo", "--round-s", "1", "--tick-s", "0.3").start()
    try:
        submit(pool, sleep_files, "a", 1, 2, 420, 2)
        wait_for(lambda: pool.job("a")["workers"] == 2 and pool.job("a")["progress"] > 0, "job a to run on 2")
        submit(pool, sleep_files, "b", 1, 1, 24, 1)  # elastic-fifo shrinks a to admit b
        wait_for(lambda: pool.job("b")["state"] == "completed", "job b to complete")
        wait_for(lambda: len(pool.job("a")["launches"]) == 3, "job a to grow back to 2")
        a = pool.job("a")
        assert sizes(a)[:2] == [(2, "resize", "stopped"), (1, "resize", "stopped")], a["launches"]
        assert a["launches"][2]["workers"] == 2
        wait_for(lambda: pool.job("a")["launches"][2]["pid"] is not None and pool.job("a")["state"] == "running",
                 "the third launch to run")
        pid = pool.job("a")["launches"][2]["pid"]
        pool.kill9()  # the service dies; the job's processes do not
        assert Path(f"/proc/{pid}").exists()
        second = Serve(state, "cpu:2", "--policy", "elastic-fifo", "--round-s", "1", "--tick-s", "0.3").start()
        # a second service on the same database is refused with one line
        r = subprocess.run([sys.executable, "-m", "pipedream_ft.pool.service", "serve", "--devices", "cpu:2",
                            "--state-dir", str(state)], env=env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "held by a running service" in r.stderr, r.stderr
        done = wait_for(lambda: (j := second.job("a"))["state"] == "completed" and j, "job a to complete")
        assert len(done["launches"]) == 3 and done["launches"][2]["pid"] == pid, done["launches"]
        assert [l["outcome"] for l in done["launches"]] == ["stopped", "stopped", "completed"]
        assert done["progress"] == 420
        no_overlap(done)
        events = second.api("GET", "/api/pool")
        assert events["jobs"][0]["allocations"][0][1] == 2
        log = second.api("GET", "/api/jobs/a/logs?lines=400")["log"]
        assert "trained to minibatch 420" in log and "resharded" in log
        second.stop()
    finally:
        pool.stop()
        kill_jobs(state)


def test_round_robin_preempts_and_resumes_and_a_policy_switch_on_postgresql(tmp_path, sleep_files, postgres_url):
    state = tmp_path / "pool"
    db = fresh_pg_db(postgres_url)
    pool = Serve(state, "cpu:2", "--db", db, "--policy", "round-robin", "--quantum", "3", "--round-s", "1",
                 "--tick-s", "0.3").start()
    try:
        submit(pool, sleep_files, "c", 2, 2, 160, 2)
        wait_for(lambda: pool.job("c")["progress"] > 0, "job c to run")
        submit(pool, sleep_files, "d", 2, 2, 160, 2)
        # c's slice ends: a checkpointed preemption, then d runs
        wait_for(lambda: pool.job("d")["progress"] > 0, "job d to run after c's preemption")
        c = pool.job("c")
        assert c["launches"][0]["stop"] == "preempt" and c["launches"][0]["outcome"] == "stopped"
        preempted_at = c["progress"]
        assert 0 < preempted_at < 160
        # switched while d runs: fifo gives c (first in) its devices back, and then keeps them until it ends
        assert pool.cli("policy", "fifo").returncode == 0
        wait_for(lambda: pool.api("GET", "/api/policy")["policy"] == "fifo", "the switch")
        pool.cli("cancel", "d")  # and d is cancelled: at once if it waits, by SIGTERM if it runs
        wait_for(lambda: pool.job("d")["state"] == "cancelled", "job d to be cancelled")
        done = wait_for(lambda: (j := pool.job("c"))["state"] == "completed" and j, "job c to complete")
        assert done["progress"] == 160
        assert done["launches"][-1]["outcome"] == "completed"
        no_overlap(done)
        listed = json.loads(pool.cli("list", "--json").stdout)
        assert {j["name"]: j["state"] for j in listed} == {"c": "completed", "d": "cancelled"}
        assert set(listed[0]) >= {"id", "name", "state", "workers", "progress"}
        hist = pool.api("GET", "/api/policy")["history"]
        assert [h[1] for h in hist] == ["round-robin", "fifo"]
    finally:
        pool.stop()
        kill_jobs(state)
