"""The HTTP JSON API and the dashboard page, behind a bearer token.

Every request needs ``Authorization: Bearer TOKEN`` (or the dashboard's cookie, set by opening
``/?token=TOKEN`` once); without it the answer is 401. Routes: ``GET /api/jobs``, ``POST /api/jobs`` (a
submission; 400 with one line if it is bad), ``GET /api/jobs/{job}``, ``POST /api/jobs/{job}/cancel``,
``GET /api/jobs/{job}/logs?lines=N``, ``GET|POST /api/policy``, ``GET /api/pool`` (devices, policy, jobs and
the launches for the Gantt chart), and ``/`` (the dashboard).
"""

from __future__ import annotations

import hmac
import os
import secrets
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from ..errors import PoolError
from ..policy import POLICIES, make_policy
from .service import PoolService, job_dir
from .submission import Submission, checked

__all__ = ["make_app", "load_or_create_token", "job_json", "tail"]

COOKIE = "pipedream_pool_token"
DASHBOARD = Path(__file__).with_name("dashboard") / "index.html"


def load_or_create_token(path: Path) -> str:
    """The service's token, written 0600 on first start."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 200 * max(lines, 1) - 4096))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def job_json(svc: PoolService, job: dict[str, Any], launches: list[dict[str, Any]] | None = None,
             now: float | None = None) -> dict[str, Any]:
    """A job as the API and ``list --json`` give it."""
    now = time.time() if now is None else now
    launches = svc.store.launches(job["id"]) if launches is None else launches
    open_ = [l for l in launches if l["ended"] is None]
    workers = open_[0]["workers"] if open_ else 0
    rate = job["throughput"]
    remaining = max(job["steps"] - job["progress"], 0)
    predicted = None
    if job["state"] in ("running", "resizing", "queued") and workers and rate:
        predicted = now + remaining / rate
    return {"id": job["id"], "name": job["name"], "state": job["state"], "workers": workers,
            "target": job["target"], "min_workers": job["min_workers"], "max_workers": job["max_workers"],
            "priority": job["priority"], "progress": job["progress"], "steps": job["steps"],
            "throughput": rate, "predicted_finish": predicted, "submitted": job["submitted"],
            "started": job["started"], "finished": job["finished"], "failures": job["failures"],
            "reason": job["reason"], "ckpt_url": job["ckpt_url"], "argv": job["argv"],
            "launches": [{k: l[k] for k in ("id", "workers", "slots", "pid", "requested", "started", "first_update",
                                             "start_progress", "stop", "stop_requested", "ended", "exit_status",
                                             "outcome")}
                         for l in launches],
            "allocations": [[a["time"], a["workers"]] for a in svc.store.allocations(job["id"])]}


def make_app(svc: PoolService, token: str) -> FastAPI:
    app = FastAPI(title="pipedream-pool", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Any:
        given = request.headers.get("authorization", "")
        supplied = given[7:] if given.lower().startswith("bearer ") else request.cookies.get(COOKIE, "")
        if request.url.path == "/" and request.query_params.get("token"):
            supplied = request.query_params["token"]
            if hmac.compare_digest(supplied.encode(), token.encode()):
                resp = RedirectResponse("/", status_code=303)
                resp.set_cookie(COOKIE, token, httponly=True, samesite="strict")
                return resp
        if not supplied or not hmac.compare_digest(supplied.encode(), token.encode()):
            return JSONResponse({"detail": "a bearer token is needed (the service's token file)"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    def find(key: str) -> dict[str, Any]:
        try:
            return svc.store.job(key)
        except PoolError as exc:
            raise HTTPException(404, str(exc)) from None

    @app.get("/", response_class=HTMLResponse)
    def dashboard() -> str:
        return DASHBOARD.read_text()

    @app.get("/api/jobs")
    def list_jobs() -> list[dict[str, Any]]:
        return [job_json(svc, j) for j in svc.store.jobs()]

    @app.post("/api/jobs", status_code=201)
    async def submit(request: Request) -> dict[str, Any]:
        try:
            sub = Submission.from_json(await request.json())
            values = checked(sub, svc.devices.count, svc.state_dir)
            job_id = svc.store.add_job(**values)
        except PoolError as exc:
            raise HTTPException(400, str(exc)) from None
        except ValueError as exc:
            raise HTTPException(400, f"submission: not JSON: {exc}") from None
        job_dir(svc.state_dir, sub.name).mkdir(parents=True, exist_ok=True)
        svc.dirty.set()
        return job_json(svc, svc.store.job(job_id))

    @app.get("/api/jobs/{key}")
    def status(key: str) -> dict[str, Any]:
        return job_json(svc, find(key))

    @app.post("/api/jobs/{key}/cancel")
    def cancel(key: str) -> dict[str, Any]:
        job = find(key)
        if job["state"] in ("completed", "failed", "cancelled"):
            raise HTTPException(409, f"job {job['name']} has ended already ({job['state']})")
        svc.store.update_job(job["id"], cancel=True)
        svc.store.log_event("cancel-requested", "", job["id"])
        svc.dirty.set()
        return job_json(svc, svc.store.job(job["id"]))

    @app.get("/api/jobs/{key}/logs")
    def logs(key: str, lines: int = 50) -> dict[str, Any]:
        job = find(key)
        return {"id": job["id"], "name": job["name"], "log": tail(job_dir(svc.state_dir, job["name"]) / "log", lines)}

    @app.get("/api/policy")
    def get_policy() -> dict[str, Any]:
        return {"policy": svc.store.get_setting("policy"), "pending": svc.store.get_setting("policy_pending") or None,
                "known": list(POLICIES),
                "history": [[e["time"], e["detail"]] for e in svc.store.events("policy")]}

    @app.post("/api/policy")
    async def set_policy(request: Request) -> dict[str, Any]:
        try:
            name = str((await request.json())["policy"])
            make_policy(name, **svc.policy_options)
        except PoolError as exc:
            raise HTTPException(400, str(exc)) from None
        except (ValueError, KeyError, TypeError):
            raise HTTPException(400, 'expected {"policy": NAME}') from None
        svc.store.set_setting("policy_pending", name)
        svc.store.log_event("policy-requested", name)
        svc.dirty.set()
        return get_policy()

    @app.get("/api/pool")
    def pool() -> dict[str, Any]:
        now = time.time()
        jobs = svc.store.jobs()
        launches = svc.store.launches()
        by_job: dict[int, list[dict[str, Any]]] = {}
        for l in launches:
            by_job.setdefault(l["job_id"], []).append(l)
        out = []
        for j in jobs:
            d = job_json(svc, j, by_job.get(j["id"], []), now)
            d["log_tail"] = tail(job_dir(svc.state_dir, j["name"]) / "log", 8)
            out.append(d)
        return {"now": now, "devices": svc.devices.spec(), "slots": svc.devices.count, "policy": get_policy(),
                "jobs": out}

    return app
