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
