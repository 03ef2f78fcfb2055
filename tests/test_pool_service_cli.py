"""The pool service's boundary: every bad submission refused with one line and exit status 2, the token (401
without it), the CLI's one-line errors. One service (SQLite, cpu:2) for the module."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from pool_service_fixtures import PROFILE, Serve, env, kill_jobs, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    state = tmp_path_factory.mktemp("cli") / "pool"
    state.mkdir()
    serve = Serve(state, "cpu:2", "--policy", "fifo", "--round-s", "1", "--tick-s", "0.3").start()
    yield serve
    serve.stop()
    kill_jobs(state)


def _submit(pool, *args, cwd=None):
    return pool.cli("submit", *args, cwd=cwd, check=False)


def test_every_request_needs_the_token(pool):
    for path in ("/", "/api/jobs", "/api/pool", "/api/policy"):
        assert httpx.get(pool.url + path, timeout=30).status_code == 401
        assert httpx.get(pool.url + path, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert httpx.post(pool.url + "/api/policy", json={"policy": "fifo"}, timeout=30).status_code == 401
    assert stat.S_IMODE(os.stat(pool.state / "token").st_mode) == 0o600
    r = subprocess.run([sys.executable, "-m", "pipedream_ft.pool.service", "list", "--state-dir", str(pool.state)],
                       env={**env(), "PIPEDREAM_POOL_TOKEN": "wrong"}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "401" in r.stderr, r.stderr
    # the dashboard's login: the token once in the URL, then a cookie
    with httpx.Client(base_url=pool.url, timeout=30, follow_redirects=True) as c:
        assert c.get(f"/?token={pool.token}").status_code == 200
        assert c.get("/api/jobs").status_code == 200


def test_bad_submissions_are_refused_with_one_line(pool, tmp_path):
    bad_profile = tmp_path / "bad.json"
    bad_profile.write_text("{not a profile")
    owner = _submit(pool, "--name", "owner", "--min-workers", "1", "--max-workers", "1", "--profile", str(PROFILE),
                    "--", "-m", "this", "--steps", "5", "--ckpt", str(tmp_path / "ck"), cwd=tmp_path)
    assert owner.returncode == 0, owner.stderr

    def body(**kw):
        return {"name": "j", "min_workers": 1, "max_workers": 1, "profile": str(PROFILE),
                "argv": ["-m", "this", "--steps", "5"], "cwd": str(tmp_path), **kw}

    cases = {
        "does not load": body(profile=str(bad_profile)),
        "> --max-workers": body(min_workers=2, max_workers=1),
        "more workers than the pool has": body(max_workers=3),
        "does not exist": body(argv=["-m", "no_such_module_for_the_pool", "--steps", "5"]),
        "belongs to job 'owner'": body(argv=["-m", "this", "--steps", "5", "--ckpt", "ck"]),
        "exists already": body(name="owner", argv=["-m", "this", "--steps", "5", "--ckpt", "other"]),
        "--steps must be >= 1": body(argv=["-m", "this"]),
    }
    for want, b in cases.items():
        r = httpx.post(pool.url + "/api/jobs", json=b, headers={"Authorization": f"Bearer {pool.token}"}, timeout=60)
        assert r.status_code == 400 and want in r.json()["detail"] and "\n" not in r.json()["detail"], (want, r.text)
    # the command line says it in one line, exit status 2
    for want, args in (("> --max-workers", ["--min-workers", "2", "--max-workers", "1", "--profile", str(PROFILE)]),
                       ("does not load", ["--min-workers", "1", "--max-workers", "1", "--profile", str(bad_profile)])):
        r = _submit(pool, "--name", "c", *args, "--", "-m", "this", "--steps", "5", cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and want in r.stderr, (want, r.stderr)
    listed = json.loads(pool.cli("list", "--json").stdout)
    assert [j["name"] for j in listed] == ["owner"]
    # `-m this` ends at once with status 0: the job completes
    wait_for(lambda: pool.job("owner")["state"] == "completed", "the job to complete")


def test_cli_errors_are_one_line(pool):
    for args in (["status", "nosuch"], ["policy", "no-such-policy"]):
        r = pool.cli(*args, check=False)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (args, r.stderr)
    r = subprocess.run([sys.executable, "-m", "pipedream_ft.pool.service", "list", "--state-dir", "/nonexistent"],
                       env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no pool service found" in r.stderr
    assert json.loads(pool.cli("policy", "--json").stdout)["policy"] == "fifo"
