"""``pipedream-pool serve | submit | list | status | logs | cancel | policy | render-k8s``.

:func:`add_subcommands` adds them to ``pipedream-pool``'s subparsers (:mod:`pipedream_ft.pool.cli`, which also
runs as ``python -m pipedream_ft.pool.service``). Errors are one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from ..errors import PoolError

__all__ = ["add_subcommands", "default_state_dir"]


def default_state_dir() -> Path:
    return Path(os.environ.get("PIPEDREAM_POOL_HOME") or Path.home() / ".pipedream-pool")


def _common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    p.add_argument("--state-dir", type=Path, default=None, help="the pool's directory (default ~/.pipedream-pool)")
    p.add_argument("--url", help="the service's URL (default: found in the state directory)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print JSON")


def add_subcommands(sub: Any) -> None:
    """Add the service's subcommands to ``sub`` (an ``add_subparsers()`` result); each sets ``func``."""
    p = sub.add_parser("serve", help="run the pool service")
    p.add_argument("--devices", required=True, help="cpu:N or cuda:0,1,2,3")
    p.add_argument("--state-dir", type=Path, default=None)
    p.add_argument("--db", help="database URL (default: sqlite in the state directory)")
    p.add_argument("--policy", default="elastic-fifo")
    p.add_argument("--round-s", type=float, default=60.0)
    p.add_argument("--tick-s", type=float, default=0.5)
    p.add_argument("--stop-deadline-s", type=float, default=60.0, help="SIGTERM to SIGKILL (default 60 s)")
    p.add_argument("--quantum", type=float, default=None, help="round-robin's time slice, s")
    p.add_argument("--resize-cost", type=float, default=None, help="goodput's resize cost, s")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="default: a free port (written to STATE_DIR/service.json)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("submit", help="submit a job: ... -- -m module args")
    _common(p)
    p.add_argument("--name", required=True)
    p.add_argument("--min-workers", type=int, required=True)
    p.add_argument("--max-workers", type=int, required=True)
    p.add_argument("--workers", type=int, default=None, help="requested size (default --max-workers)")
    p.add_argument("--profile", required=True)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="the job's minibatches (default: its own --steps)")
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then what torchrun runs")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("list", help="the pool's jobs")
    _common(p)
    p.set_defaults(func=cmd_list)
    for name, func, helptext in (("status", cmd_status, "one job's record"), ("logs", cmd_logs, "a job's log"),
                                 ("cancel", cmd_cancel, "cancel a job")):
        p = sub.add_parser(name, help=helptext)
        _common(p)
        p.add_argument("job", help="id or name")
        if name == "logs":
            p.add_argument("--lines", type=int, default=50)
        p.set_defaults(func=func)
    p = sub.add_parser("policy", help="show the policy, or switch it at the next round")
    _common(p)
    p.add_argument("name", nargs="?")
    p.set_defaults(func=cmd_policy)

    p = sub.add_parser("render-k8s", help="Kueue manifests for the pool's jobs")
    p.add_argument("--jobs", type=Path, required=True, help="JSON list of jobs (name, image, min/max workers, ...)")
    p.add_argument("--queue", default="pipedream-pool")
    p.add_argument("--namespace", default="default")
    p.add_argument("--kind", choices=("jobset", "job"), default="job")
    p.add_argument("-o", "--output", type=Path)
    p.set_defaults(func=cmd_render_k8s)


def _state(args: argparse.Namespace) -> Path:
    return args.state_dir if args.state_dir is not None else default_state_dir()


def _client(args: argparse.Namespace) -> Any:
    from .client import Client

    return Client(_state(args), args.url)


def _print(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def cmd_serve(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from .api import load_or_create_token, make_app
    from .client import SERVICE_FILE, TOKEN_FILE
    from .runner import Devices
    from .service import PoolService
    from .store import Store, sqlite_url

    state = _state(args).resolve()
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    devices = Devices.parse(args.devices)
    options = {k: v for k, v in (("quantum", args.quantum), ("resize_cost", args.resize_cost)) if v is not None}
    store = Store(args.db or sqlite_url(state / "pool.db"))
    svc = PoolService(store, devices, state, policy=args.policy, round_s=args.round_s, tick_s=args.tick_s,
                      stop_deadline_s=args.stop_deadline_s, policy_options=options)
    svc.start()
    token = load_or_create_token(state / TOKEN_FILE)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        raise PoolError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    sock.listen(128)  # connections wait in the backlog until uvicorn serves them
    port = sock.getsockname()[1]
    url = f"http://{args.host}:{port}"
    info = state / SERVICE_FILE
    tmp = info.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "pid": os.getpid()}, f)
    os.replace(tmp, info)
    loop = threading.Thread(target=_loop, args=(svc,), name="pool-rounds", daemon=True)
    loop.start()
    print(f"pipedream-pool: {devices.spec()}, policy {svc.policy_name}, database {store.safe_url}; API and "
          f"dashboard on {url} (token in {state / TOKEN_FILE})", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(make_app(svc, token), log_level="warning", access_log=False))
    try:
        server.run(sockets=[sock])
    finally:
        svc.stop()
        loop.join(timeout=30)
        svc.close()
    return 0


def _loop(svc: Any) -> None:
    try:
        svc.run()
    except Exception as exc:  # noqa: BLE001 - the service ends with one line, its jobs keep running
        print(f"pipedream-pool: the round loop stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(3)


def cmd_submit(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise PoolError("submit: give the job's command after --, e.g. -- -m pipedream_ft_examples.train_digits --plan P.json")
    body = {"name": args.name, "min_workers": args.min_workers, "max_workers": args.max_workers,
            "workers": args.workers, "profile": str(Path(args.profile).resolve()), "priority": args.priority,
            "steps": args.steps, "max_retries": args.max_retries, "argv": argv, "cwd": os.getcwd()}
    job = _client(args).request("POST", "/api/jobs", body)
    if args.json:
        _print(job)
    else:
        print(f"job {job['id']} {job['name']}: queued")
    return 0


def _fmt_row(j: dict[str, Any]) -> str:
    return (f"{j['id']:>4} {j['name'][:24]:<24} {j['state']:<10} {j['workers']:>3}/{j['max_workers']:<3} "
            f"{j['progress']:>7}/{j['steps']:<7}")


def cmd_list(args: argparse.Namespace) -> int:
    jobs = _client(args).request("GET", "/api/jobs")
    if args.json:
        _print(jobs)
    else:
        print(f"{'id':>4} {'name':<24} {'state':<10} workers progress")
        for j in jobs:
            print(_fmt_row(j))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    j = _client(args).request("GET", f"/api/jobs/{args.job}")
    if args.json:
        _print(j)
    else:
        print(_fmt_row(j))
        for l in j["launches"]:
            print(f"  launch {l['id']}: {l['workers']} workers, exit {l['exit_status']} {l['outcome'] or 'running'}"
                  + (f" (stopped: {l['stop']})" if l["stop"] else ""))
        if j["reason"]:
            print(f"  {j['reason']}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    d = _client(args).request("GET", f"/api/jobs/{args.job}/logs?lines={args.lines}")
    if args.json:
        _print(d)
    else:
        print(d["log"])
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    j = _client(args).request("POST", f"/api/jobs/{args.job}/cancel")
    if args.json:
        _print(j)
    else:
        print(f"job {j['id']} {j['name']}: cancel requested")
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    c = _client(args)
    d = c.request("POST", "/api/policy", {"policy": args.name}) if args.name else c.request("GET", "/api/policy")
    if args.json:
        _print(d)
    else:
        print(d["policy"] + (f" (switching to {d['pending']} at the next round)" if d["pending"] else ""))
    return 0


def cmd_render_k8s(args: argparse.Namespace) -> int:
    from .k8s import load_jobs, render

    text = render(load_jobs(args.jobs), queue=args.queue, namespace=args.namespace, kind=args.kind)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0
