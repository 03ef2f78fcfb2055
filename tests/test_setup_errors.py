"""A set-up error's line reaches the terminal in every run, above torchrun's block, and says how to fix it.

A 4-process plan run by 3 processes used to print only torchrun's ``ChildFailedError`` block in some runs: only
rank 0 printed the line, and torchrun's SIGTERM (sent as soon as another rank exited) could end it first. Now every
rank prints the same line before anything that can block; the example scripts re-plan from the profile beside the
plan when there is one, and otherwise name the command that makes a plan for the process count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port
from partitioner import partition
from pipedream_ft_examples.gpt import gpt
from profiler.measure import profile_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
SMALL = ["--batch-size", "8", "--block-size", "32", "--sample", "0", "--timeout", "30"]


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    return profile_model(gpt(), torch.randint(0, 256, (8, 32)), warmup=0, repeats=1)


def _torchrun(cwd: Path, args: list[str], nproc: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEDREAM_FT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts", "0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.1",
           str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def test_a_plan_for_another_process_count_says_how_to_fix_it_in_every_run(tmp_path, profile):
    partition(profile, 4, 1e9, straight=True).save(tmp_path / "gpt.plan.json")  # no profile beside it
    line = ("pipedream-ft: error: gpt.plan.json is a plan for 4 processes, but 3 run it: re-plan for 3 with "
            "`pipedream-partition gpt.prof.json --workers 3 --bandwidth 1e+09 --straight -o gpt.plan.json` "
            "(or run torchrun --nproc-per-node 4)")
    for run in range(3):  # the line used to be lost in some runs: every one must have it
        proc = _torchrun(tmp_path, ["--plan", "gpt.plan.json", "--steps", "8", *SMALL], nproc=3)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-4000:]
        said = [l for l in out.splitlines() if l.startswith("pipedream-ft: error: ")]
        assert said, f"run {run}: no error line\n{out[-4000:]}"
        assert all(l.startswith(line + " (tracebacks in ") for l in said), said
        ours = proc.stderr.split("Traceback (most recent call last)")[0]  # above torchrun's own block
        assert line in ours and "Traceback" not in ours.replace("tracebacks in", ""), \
            f"run {run}: the line is not above torchrun's block\n{out[-4000:]}"


def test_the_example_re_plans_from_the_profile_beside_the_plan(tmp_path, profile):
    partition(profile, 4, 1e9, straight=True).save(tmp_path / "gpt.plan.json")
    profile.save(tmp_path / "gpt.prof.json")
    proc = _torchrun(tmp_path, ["--plan", "gpt.plan.json", "--steps", "6", *SMALL], nproc=3)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert proc.stdout.count("gpt.plan.json is a plan for 4 processes and 3 run it: re-planned from gpt.prof.json "
                             "for 3 (3 stages: ") == 1, proc.stdout
    assert "final loss" in proc.stdout


def test_a_plan_for_another_count_is_re_planned_from_the_profile_a_pool_names(tmp_path, monkeypatch, capsys):
    """A pool launches a job on fewer workers than its plan's, with no profile beside the plan: the example re-plans
    from the job's profile, which the pool hands over as ``PIPEDREAM_FT_PROFILE``; without it, the one line."""
    from pipedream_ft.errors import PipelineSetupError
    from pipedream_ft_examples.train_digits import plan_for_world
    from pool_service_fixtures import PROFILE, digits_plan

    plan_path = digits_plan(2, tmp_path / "digits-2.plan.json")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("PIPEDREAM_FT_PROFILE", raising=False)
    with pytest.raises(PipelineSetupError, match=r"digits-2.plan.json is a plan for 2 processes, but 1 run it: "
                                                 r"re-plan for 1 with `pipedream-partition .*digits-2.prof.json"):
        plan_for_world(str(plan_path))
    monkeypatch.setenv("PIPEDREAM_FT_PROFILE", str(PROFILE))
    plan = plan_for_world(str(plan_path))
    assert plan.world_size == 1 and plan.num_stages == 1
    assert f"re-planned from {PROFILE} for 1" in capsys.readouterr().out


def test_the_pool_hands_each_launch_its_jobs_profile(tmp_path) -> None:
    """A real pool runs a script that writes what it was handed: the job's profile, as submitted."""
    from pool_service_fixtures import PROFILE, Serve, kill_jobs, wait_for

    script = tmp_path / "show_profile.py"
    script.write_text("import os, sys\n"
                      "open(sys.argv[1], 'w').write(os.environ.get('PIPEDREAM_FT_PROFILE', 'unset'))\n")
    seen = tmp_path / "seen.txt"
    state = tmp_path / "pool"
    pool = Serve(state, "cpu:1", "--policy", "fifo", "--round-s", "1", "--tick-s", "0.3").start()
    try:
        pool.cli("submit", "--name", "show", "--min-workers", "1", "--max-workers", "1", "--profile", str(PROFILE),
                 "--steps", "1", "--", str(script), str(seen), cwd=tmp_path)
        job = wait_for(lambda: (j := pool.job("show"))["state"] in ("completed", "failed") and j, "the job to end")
        assert seen.read_text() == str(PROFILE.resolve()), job
    finally:
        pool.stop()
        kill_jobs(state)
