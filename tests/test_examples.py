"""``examples/train_digits.py`` under real torchrun (4 CPU ranks on loopback), and its pieces in-process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipedream_ft_examples.models import digits_cnn
from pipedream_ft_examples.train_digits import DigitsData, round_steps
from partitioner.plan import Plan
from pipedream_ft.errors import PipelineSetupError
from profiler.layers import structure_profile

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_digits.py"
RUN_TIMEOUT_S = 150


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _plan(stage_layers: list[list[int]], replicas: list[int]) -> Plan:
    prof = structure_profile(digits_cnn())
    return Plan.from_stages(stage_layers, replicas, profile_hash=prof.structure_hash(),
                            layer_names=[l.name for l in prof.layers])


def _run(args: list[str], cwd: Path, nproc: int = 4) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(SCRIPT),
           *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _figures(proc: subprocess.CompletedProcess[str]) -> dict[str, float]:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    out: dict[str, float] = {}
    for key, pattern in [("first", r"^first loss ([\d.]+)"), ("final", r"^final loss ([\d.]+)"),
                         ("accuracy", r"^held-out accuracy ([\d.]+)")]:
        m = re.search(pattern, proc.stdout, re.MULTILINE)
        assert m, f"no {key!r} line in:\n{proc.stdout}"
        out[key] = float(m.group(1))
    return out


def _assert_learned(fig: dict[str, float]) -> None:
    assert fig["final"] < 0.5 * fig["first"], fig
    assert fig["accuracy"] > 0.7, fig


# -- in-process ---------------------------------------------------------------------------------------------


def test_data_stream_is_deterministic_and_reshuffled_per_epoch():
    a, b = DigitsData(32, seed=0), DigitsData(32, seed=0)
    x0, y0 = a(0)
    assert x0.shape == (32, 1, 8, 8) and x0.dtype == torch.float32 and y0.dtype == torch.int64
    assert float(x0.min()) >= 0.0 and float(x0.max()) <= 1.0
    for i in (0, 5, a.per_epoch, 3 * a.per_epoch + 7, 1):  # out of order, as ranks ask
        assert torch.equal(a(i)[0], b(i)[0]) and torch.equal(a(i)[1], b(i)[1])
    assert not torch.equal(a(0)[1], a(a.per_epoch)[1])  # a new epoch, a new order
    epoch = torch.cat([a(i)[1] for i in range(a.per_epoch)])
    assert len(epoch) == a.per_epoch * 32 and a.per_epoch == len(a.train_y) // 32
    assert len(a.train_y) + len(a.test_y) == 1797


def test_steps_round_to_the_plan():
    plan = _plan([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [3, 1])
    assert round_steps(200, plan, "stash", 4) == 198
    assert round_steps(200, plan, "flush", 6) == 198
    with pytest.raises(PipelineSetupError, match="multiple of 3"):
        round_steps(200, plan, "flush", 4)
    with pytest.raises(PipelineSetupError, match="less than 3"):
        round_steps(2, plan, "stash", 4)
    with pytest.raises(PipelineSetupError, match="same replica count"):
        round_steps(200, plan, "vertical", 4)


def test_bad_plan_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    proc = subprocess.run([sys.executable, str(SCRIPT), "--plan", str(bad)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(
        f"pipedream-ft: error: {bad}: not a pipedream-ft plan (field 'format' must be 'pipedream-ft-plan') "
        "(tracebacks in ")


# -- under torchrun -----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_four_stage_plan_trains(tmp_path):
    _plan([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]], [1, 1, 1, 1]).save(tmp_path / "plan.json")
    proc = _run(["--plan", "plan.json", "--steps", "200", "--save", "w.pt"], tmp_path)
    fig = _figures(proc)
    _assert_learned(fig)
    assert "4 stages, replicas [1, 1, 1, 1]" in proc.stdout
    assert len(re.findall(r"^minibatch +\d+ +loss", proc.stdout, re.MULTILINE)) == 10
    state = torch.load(tmp_path / "w.pt", weights_only=True)
    assert sorted(state) == sorted(digits_cnn().state_dict())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_replicated_stage_plan_trains(tmp_path):
    _plan([[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10]], [2, 1, 1]).save(tmp_path / "plan.json")
    proc = _run(["--plan", "plan.json", "--steps", "151"], tmp_path)
    fig = _figures(proc)
    _assert_learned(fig)
    assert "150 minibatches of 32 (rounded down from 151)" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_profile_partition_train_chain(tmp_path):
    """The README's tutorial as written, in a directory outside the repository and with nothing on PYTHONPATH (the
    install makes the examples importable): profile, partition for 4 workers, train whatever plan comes out."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    bin_dir = Path(sys.executable).parent
    for cmd in (
        [str(bin_dir / "pipedream-profile"), "pipedream_ft_examples.models:digits_cnn", "--input-shape", "1,8,8",
         "--batch-size", "32", "-o", "digits.prof.json"],
        [str(bin_dir / "pipedream-partition"), "digits.prof.json", "--workers", "4", "--bandwidth", "1e9",
         "-o", "digits.plan.json"],
        [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "4", "-m", "pipedream_ft_examples.train_digits",
         "--plan", "digits.plan.json", "--steps", "200"],
    ):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, f"{cmd[0]} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    _assert_learned(_figures(proc))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_summary_after_the_last_stage_is_replaced_is_the_uninterrupted_one(tmp_path):
    """Rank 3 (the last stage, which computes the losses) is killed at minibatch 50 and replaced in place: the
    summary rank 0 prints — the loss of every 20 minibatches, the first and final loss — is the uninterrupted
    run's, line for line (the replacement used to report only the losses after its cut, so the cut's loss was
    printed as minibatch 0's)."""
    _plan([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]], [1, 1, 1, 1]).save(tmp_path / "plan.json")
    args = ["--plan", "plan.json", "--steps", "100", "--save", "w.pt"]

    def summary(proc: subprocess.CompletedProcess[str]) -> list[str]:
        _figures(proc)  # ran to the end
        return [l for l in proc.stdout.splitlines() if re.match(r"(minibatch +\d+ +loss|first loss|final loss)", l)]

    clean = summary(_run(args, tmp_path))
    env = dict(_env(), PIPEDREAM_FT_FAULTS="kill@rank=3,step=50")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert "starting replacement 1" in log and "recovered in place" in log, log[-4000:]
    assert summary(proc) == clean, log[-4000:]
    assert clean[-2].startswith("first loss") and clean[-2].endswith("(minibatches 0-19)"), clean
