"""The pool's dashboard in a real browser (Debian's chromium driven by Playwright): the page loads, a submitted
job appears and advances, the policy is switched from the page; a screenshot is saved for the docs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
sync_api = pytest.importorskip("playwright.sync_api")

from pool_service_fixtures import ROOT, Serve, env, kill_jobs, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CHROMIUM = os.environ.get("PIPEDREAM_POOL_CHROMIUM", "/usr/bin/chromium")
JOB = str(ROOT / "benchmarks" / "pool_sleep_job.py")
SHOT = ROOT / "docs" / "figures" / "pool-dashboard.png"


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def test_the_dashboard_shows_jobs_advancing_and_switches_the_policy(tmp_path, browser):
    files = tmp_path / "sleep"
    subprocess.run([sys.executable, JOB, "prepare", str(files), "--forward-ms", "10", "--backward-ms", "20"],
                   env=env(), check=True, timeout=120)
    state = tmp_path / "pool"
    state.mkdir()
    pool = Serve(state, "cpu:4", "--policy", "fifo", "--round-s", "1", "--tick-s", "0.3").start()
    try:
        page = browser.new_page(viewport={"width": 1100, "height": 760})
        page.goto(f"{pool.url}/?token={pool.token}")
        page.wait_for_selector("#policy-select option", state="attached", timeout=60_000)
        assert page.inner_text("#policy") == "fifo"
        for name, lo, hi, steps in (("alpha", 1, 2, 900), ("beta", 1, 2, 700)):
            pool.api("POST", "/api/jobs", {"name": name, "min_workers": lo, "max_workers": hi, "steps": steps,
                                           "profile": str(files / "sleep.prof.json"), "cwd": str(files),
                                           "argv": [JOB, "--plan", str(files / "sleep-2.plan.json"), "--steps",
                                                    str(steps), "--forward-ms", "10", "--backward-ms", "20"]})
        row = 'tr[data-job="alpha"]'
        page.wait_for_selector(row, timeout=60_000)  # the submitted job appears

        def progress() -> int:
            return int(page.inner_text(f"{row} .progress") or 0)

        first = wait_for(lambda: progress() > 0 and progress(), "the page to show progress")
        wait_for(lambda: progress() > first, "the page to show the job advancing")
        assert page.inner_text(f"{row} .state") == "running"
        page.select_option("#policy-select", "elastic-fifo")
        page.click("#policy-switch")
        wait_for(lambda: page.inner_text("#policy") == "elastic-fifo", "the page to show the switched policy")
        assert pool.api("GET", "/api/policy")["policy"] == "elastic-fifo"
        wait_for(lambda: page.locator(".gantt-bar").count() >= 2, "the Gantt chart to draw the launches")
        SHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOT), full_page=True)
        assert SHOT.stat().st_size > 10_000
        page.close()
    finally:
        pool.stop()
        kill_jobs(state)
