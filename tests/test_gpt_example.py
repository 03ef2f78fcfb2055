"""``examples/train_gpt.py``: its pieces in-process, and the script under real torchrun (4 CPU ranks).

Under torchrun: the loss of a small byte-level GPT falls on a 4-stage plan from the partitioner; and a run whose
rank 2 is killed (SIGKILL, ``PIPEDREAM_FT_FAULTS``) and recovered in place ends with weights bitwise equal to
those of an uninterrupted run.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port
from pipedream_ft_examples.gpt import gpt
from pipedream_ft_examples.text_data import TextData, corpus_bytes, decode
from pipedream_ft_examples.train_gpt import default_lr, generate, held_out_loss, lr_factor, parse_args, weight_delay
from partitioner import partition
from partitioner.plan import Plan
from profiler.measure import profile_model

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
RUN_TIMEOUT_S = 120
SMALL = ["--batch-size", "8", "--block-size", "32", "--sample", "40", "--timeout", "20"]
"""Fast settings: 256 tokens per minibatch."""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEDREAM_FT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _torchrun(args: list[str], cwd: Path, env: dict[str, str], restarts: int = 0,
              nproc: int = 4) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.5",
           str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


def _figure(stdout: str, name: str) -> float:
    m = re.search(rf"^{name} ([\d.]+)", stdout, re.MULTILINE)
    assert m, f"no {name!r} line in:\n{stdout}"
    return float(m.group(1))


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The partitioner's straight 4-stage plan for ``pipedream_ft_examples.gpt:gpt`` (as ``pipedream-profile`` profiles it)."""
    torch.manual_seed(0)
    profile = profile_model(gpt(), torch.randint(0, 256, (8, 32)), warmup=0, repeats=1)
    plan = partition(profile, 4, 1e9, straight=True)
    path = tmp_path_factory.mktemp("gpt") / "gpt.plan.json"
    plan.save(path)
    return path


# -- in-process ---------------------------------------------------------------------------------------------


def test_text_is_split_and_minibatches_are_deterministic() -> None:
    a, b = TextData(block_size=32, batch_size=8, seed=0), TextData(block_size=32, batch_size=8, seed=0)
    assert len(a.train) + len(a.held) == len(corpus_bytes()) > 400_000
    assert 0.08 < len(a.held) / (len(a.train) + len(a.held)) < 0.12
    x, y = a(7)
    assert x.shape == y.shape == (8, 32) and x.dtype == torch.int64 and int(x.max()) < 256
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one byte
    for i in (0, 7, 1000, 3):  # any order, as the ranks ask
        assert all(torch.equal(u, v) for u, v in zip(a(i), b(i)))
    assert not torch.equal(a(0)[0], a(1)[0])
    assert not torch.equal(TextData(32, 8, seed=1).held, a.held)  # the seed picks the held-out chunks
    held = a.held_out_batches(64)
    assert sum(len(h[0]) for h in held) == 64
    assert "Python" in decode(a.train[:20000])


def test_lr_schedule_and_the_default_lr_follow_the_weight_delay() -> None:
    assert lr_factor(0, warmup=10, total=100, cosine=False) == pytest.approx(0.1)
    assert lr_factor(9, warmup=10, total=100, cosine=True) == 1.0
    assert lr_factor(55, warmup=10, total=100, cosine=True) == pytest.approx(0.55)
    assert lr_factor(100, warmup=10, total=100, cosine=True) == pytest.approx(0.1)
    straight = Plan.from_stages([[0], [1], [2], [3]], [1, 1, 1, 1], profile_hash="x", layer_names=list("abcd"))
    assert weight_delay(straight, "stash") == weight_delay(straight, "vertical") == 3
    assert weight_delay(straight, "flush") == 0
    assert weight_delay(straight, "2bw") == 1
    assert weight_delay(Plan.from_stages([[0, 1], [2, 3]], [3, 1], profile_hash="x", layer_names=list("abcd")),
                        "stash") == 1
    assert default_lr("adamw", 3) == pytest.approx(2.5e-4) and default_lr("adamw", 0) == 1e-3


def test_the_lr_schedule_counts_each_mode_s_minibatches_per_update() -> None:
    """The LR schedule steps once per update: 2bw updates once per --update-every minibatches (default: one per
    stage), flush once per --flush-every, the asynchronous modes once per round of a stage's replicas."""
    from pipedream_ft_examples.train_gpt import _update_unit

    straight = Plan.from_stages([[0], [1], [2], [3]], [1, 1, 1, 1], profile_hash="x", layer_names=list("abcd"))
    unit = {extra: _update_unit(parse_args(["--plan", "p.json", *extra.split()]), straight, 1)
            for extra in ("--mode stash", "--mode 2bw", "--mode 2bw --update-every 8", "--mode flush --flush-every 6",
                          "--mode flush --schedule zb_h1")}
    assert unit == {"--mode stash": 1, "--mode 2bw": 4, "--mode 2bw --update-every 8": 8,
                    "--mode flush --flush-every 6": 6, "--mode flush --schedule zb_h1": 4}


def test_held_out_loss_and_sampling_of_a_fresh_model() -> None:
    data = TextData(block_size=32, batch_size=8)
    torch.manual_seed(0)
    model = gpt()
    assert abs(held_out_loss(model, data, 32) - math.log(256)) < 0.3  # untrained: about uniform over bytes
    text = generate(model, "The ", 10, temperature=0.0)
    assert text.startswith("The ") and text == generate(model, "The ", 10, temperature=0.0)
    assert generate(model, "x", 5, 0.8, seed=1) == generate(model, "x", 5, 0.8, seed=1)


def test_arguments_are_checked() -> None:
    with pytest.raises(SystemExit):
        parse_args([])
    with pytest.raises(SystemExit):
        parse_args(["--plan", "p.json", "--block-size", "200"])
    args = parse_args(["--single-process", "--steps", "5"])
    assert args.lr is None and args.optimizer == "adamw" and args.mode == "stash"


# -- under torchrun -----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_loss_falls_on_four_ranks(plan_path: Path, tmp_path: Path) -> None:
    out = _ok(_torchrun(["--plan", str(plan_path), "--steps", "80", "--save", "w.pt", *SMALL], tmp_path, _env()))
    assert "4 stages, replicas [1, 1, 1, 1]" in out and "weight delay 3" in out
    first, final, held = _figure(out, "first loss"), _figure(out, "final loss"), _figure(out, "held-out loss")
    assert first > 4.5 and final < first - 1.2, out
    assert held < math.log(256) - 1.5, out
    assert re.search(r"^time .* (\d+) tokens/s$", out, re.MULTILINE), out
    assert "sample (temperature 0.8):\nThe " in out
    state = torch.load(tmp_path / "w.pt", weights_only=True)
    plain = gpt()
    plain.load_state_dict(state, strict=True)  # the gathered weights are the plain model's
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])  # the tied copies agree


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_worker_is_survived_bitwise(plan_path: Path, tmp_path: Path) -> None:
    common = ["--plan", str(plan_path), "--steps", "48", "--ckpt-every", "16", "--warmup", "10", "--cosine", *SMALL]
    straight = _ok(_torchrun([*common, "--ckpt", str(tmp_path / "ck0"), "--save", "straight.pt"], tmp_path, _env()))
    assert "resumed" not in straight
    killed = _torchrun([*common, "--ckpt", str(tmp_path / "ck1"), "--save", "killed.pt"], tmp_path,
                       _env(PIPEDREAM_FT_FAULTS="kill@rank=2,step=37"), restarts=2)
    out = _ok(killed)
    # in place (pipedream_ft.launch under torchrun): rank 2's process is replaced, the others keep theirs, and
    # all go on from the newest memory-tier cut (every 8 minibatches) at or before minibatch 37
    m = re.search(r"recovered in place in [\d.]+s \(epoch 1; processes replaced so far: ranks \[2\]\); "
                  r"continuing from checkpoint (\d+)", out)
    assert m and 16 <= int(m.group(1)) <= 37, out + killed.stderr[-3000:]
    assert "resumed from checkpoint" not in out  # torchrun restarted nobody
    a = torch.load(tmp_path / "straight.pt", weights_only=True)
    b = torch.load(tmp_path / "killed.pt", weights_only=True)
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_partitioners_interleaved_plan_trains_on_two_processes_as_one_plain_process(tmp_path: Path) -> None:
    """``pipedream-partition --schedule interleaved_1f1b`` writes a plan of 2 x 2 stages; ``train_gpt.py --mode flush
    --schedule plan`` on 2 processes runs it (2 stages each, tied embeddings on processes 0 and 1) and ends at the
    single plain process's minibatch-SGD weights."""
    from partitioner.cli import main as partition_main

    torch.manual_seed(0)
    profile = profile_model(gpt(), torch.randint(0, 256, (8, 32)), warmup=0, repeats=1)
    profile.save(tmp_path / "gpt.prof.json")
    assert partition_main([str(tmp_path / "gpt.prof.json"), "--workers", "2", "--bandwidth", "1e9", "--straight",
                           "--schedule", "interleaved_1f1b", "--microbatches", "4", "-o",
                           str(tmp_path / "v.plan.json")]) == 0
    flush = ["--steps", "16", "--mode", "flush", "--flush-every", "4", *SMALL]
    out = _ok(_torchrun(["--plan", "v.plan.json", "--schedule", "plan", "--save", "v.pt", *flush], tmp_path, _env(),
                        nproc=2))
    assert "4 stages, replicas [1, 1, 1, 1]" in out
    _ok(subprocess.run([sys.executable, str(SCRIPT), "--single-process", "--save", "one.pt", *flush], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S))
    got, want = (torch.load(tmp_path / f, weights_only=True) for f in ("v.pt", "one.pt"))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5, msg=k)
