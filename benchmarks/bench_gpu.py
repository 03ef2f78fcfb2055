"""The checks and figures that need one CUDA GPU, in one run (about four minutes on an H100).

1. **Profiler on CUDA**: the GPT example and a Llama decoder from a config (transformers, bf16 off: float32),
   each profiled layer by layer on the GPU; the profile's forward + backward sum is compared with the measured
   time of a plain training step of the same model on the same GPU (*prediction / measured*), with and
   without the timer's own cost per call taken off (``profiler.measure.call_overhead_ms``).
2. **A 1-rank NCCL pipeline**: the profile planned for one worker, ``torchrun --nproc-per-node 1 -m
   pipedream_ft_examples.train_gpt`` under NCCL (300 minibatches, checkpoints every 50); tokens/s and held-out loss.
3. **Recovery on the GPU**: the same run killed at minibatch 150, once recovered in place and once restarted by
   torchrun from the last durable checkpoint; each run's final weights against the uninterrupted run's
   (largest absolute difference: CUDA's embedding backward adds with atomics, so bitwise is not promised).
4. **Checkpoint writes from GPU memory**: saved tensors changed in place on the GPU the moment ``save``
   returns must read back as they were at the call; then ``bench_checkpoint_write.py --device cuda`` (ours against
   ``torch.distributed.checkpoint.async_save``, blocking time and background CPU).

Usage: ``python benchmarks/bench_gpu.py [--out DIR]``. Each step's log is kept in ``DIR``; a step that fails
is reported with its exit status and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

__all__ = ["main"]


def _run(name: str, cmd: list[str], out: Path, timeout: float, env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` in ``out`` with its output in ``out/name.log``; returns its exit status (124: timed out)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "PYTHONUNBUFFERED": "1", **(env or {})}
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=out, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"[{name}] exit {rc} in {time.perf_counter() - t0:.1f} s: {' '.join(cmd[:6])} ...", flush=True)
    if rc:
        print("".join((out / f"{name}.log").read_text().splitlines(True)[-15:]), flush=True)
    return rc


def _step_ms(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], repeats: int = 20) -> float:
    """Median milliseconds of one plain forward + backward (sum of the output) on the GPU."""
    times = []
    for i in range(repeats + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(*inputs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().sum().backward()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(1000 * (time.perf_counter() - t0))
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _profile_check(name: str, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    from profiler.measure import profile_model

    prof = profile_model(model, inputs, device="cuda", warmup=3, repeats=10)
    f = sum(layer.forward_ms for layer in prof.layers)
    b = sum(layer.backward_ms for layer in prof.layers)
    w = sum(layer.weight_backward_ms or 0.0 for layer in prof.layers)
    of, ob = prof.meta["call_overhead_ms"]
    raw = f + b + len(prof.layers) * (of + ob)  # what the layers' timers read, the timer's own cost included
    dev_inputs = tuple(t.cuda() for t in inputs)
    measured = _step_ms(model.cuda(), dev_inputs)
    row = {"model": name, "layers": len(prof.layers), "forward_ms": f, "backward_ms": b, "weight_backward_ms": w,
           "call_overhead_ms": [of, ob], "measured_step_ms": measured, "prediction_over_measured": (f + b) / measured,
           "uncorrected_over_measured": raw / measured}
    print(f"[profile {name}] {len(prof.layers)} layers: F {f:.2f} ms + B {b:.2f} ms (W {w:.2f}) = {f + b:.2f} ms "
          f"predicted; a plain step measures {measured:.2f} ms: prediction/measured {(f + b) / measured:.2f} "
          f"(timer cost {of:.3f}/{ob:.3f} ms per call taken off; without that {raw / measured:.2f})", flush=True)
    return row


def _max_diff(a: Path, b: Path) -> float | None:
    if not (a.exists() and b.exists()):
        return None
    sa, sb = torch.load(a, map_location="cpu"), torch.load(b, map_location="cpu")
    if set(sa) != set(sb):
        return float("inf")
    return max(float((sa[k].double() - sb[k].double()).abs().max()) if sa[k].numel() else 0.0 for k in sa)


def _snapshot_check(directory: Path) -> dict[str, Any]:
    """Save GPU tensors (copied, and marked immutable), change the copied ones in place on the GPU as soon as
    ``save`` returns, and read the checkpoint back: it must hold the values at the call, bit for bit. Every other
    save takes one snapshot for durable storage and the memory tier (as the runtime saves a cut to both), whose
    part is read back too."""
    import os

    from pipedream_ft.checkpoint import CheckpointWriter, MemoryTier, Storage, TierWriter, immutable, load_newest
    from pipedream_ft.checkpoint.reader import load_part

    torch.manual_seed(0)
    live = {f"w{i}": torch.randn(2048, 2048, device="cuda") for i in range(8)}
    frozen: dict[str, torch.Tensor] = {}  # weight versions: a new one per save, the oldest dropped, as the runtime does
    storage = Storage(str(directory))
    writer = CheckpointWriter(storage, "stage0", is_committer=True, keep=2)
    tier = MemoryTier(f"bench-gpu-{os.getpid()}", key=os.urandom(32),
                      root="/dev/shm" if os.path.isdir("/dev/shm") else str(directory))
    fast = TierWriter([tier], "stage0", keep=2)
    worst = 0.0
    try:
        for step in range(1, 5):
            frozen = {**{k: v for k, v in frozen.items() if int(k[1:]) > step - 3},
                      f"v{step}": torch.randn(1024, 1024, device="cuda") * step}
            expected = {k: v.cpu().clone() for k, v in live.items()}  # .cpu() alone is no copy on a CPU
            state = {"model": live, "versions": immutable(frozen)}
            memory = None
            if step % 2 == 0:
                snap = writer.snapshot(state)
                handle, memory = writer.save(step, snap), fast.save(step, snap)
                snap.release()
            else:
                handle = writer.save(step, state)
            for v in live.values():  # the next update, queued on the GPU right away
                v.mul_(1.5).add_(1.0)
            assert handle.wait(120) and handle.ok, handle.error
            parts = [load_part(storage, step, "stage0")]
            if memory is not None:
                assert memory.wait(120) and not memory.errors, memory.errors
                parts.append(load_newest([tier], "stage0", [step])[2])  # type: ignore[index]
            for got in parts:
                worst = max([worst] + [float((got["model"][k] - expected[k]).abs().max()) for k in live]
                            + [float((got["versions"][k] - frozen[k].cpu()).abs().max()) for k in frozen])
    finally:
        writer.close(30)
        fast.close(30)
        tier.destroy()
    print(f"[snapshot] 4 saves of {len(live)} live GPU tensors, each changed in place as save returned, and 1-3 "
          f"immutable ones (a new one per save), 2 of them also to the memory tier from the same snapshot: largest "
          f"difference read back {worst}", flush=True)
    return {"max_abs_diff": worst}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-check", help="directory for profiles, plans, logs and figures")
    ap.add_argument("--steps", type=int, default=300, help="minibatches of the GPT runs (default 300)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    # 1. the profiler on CUDA
    torch.manual_seed(0)
    from pipedream_ft_examples.gpt import gpt

    ids = torch.randint(0, 256, (16, 64))
    results["profile"] = [_profile_check("gpt-example", gpt(), (ids,))]
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig

        from profiler.hf import for_pipeline

        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024)
        llama = for_pipeline(AutoModelForCausalLM.from_config(cfg))
        lids = torch.randint(0, 32000, (8, 512))
        results["profile"].append(_profile_check("llama-8x1024", llama, (lids,)))
        del llama
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - report and go on: the other checks do not depend on it
        print(f"[profile llama] failed: {type(e).__name__}: {e}", flush=True)

    # 2. a 1-rank NCCL pipeline: profile, plan, train
    rc = _run("profile-cli", [py, "-m", "profiler.cli", "pipedream_ft_examples.gpt:gpt", "--int-input", "256", "--input-shape",
                              "64", "--batch-size", "16", "--device", "cuda", "-o", "gpt.prof.json"], out, 300)
    rc = rc or _run("partition", [py, "-m", "partitioner.cli", "gpt.prof.json", "--workers", "1", "--bandwidth",
                                  "1e11", "-o", "gpt.plan.json"], out, 120)
    torchrun = [py, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    train = ["-m", "pipedream_ft_examples.train_gpt", "--plan", "gpt.plan.json", "--steps", str(args.steps), "--sample", "0",
             "--ckpt-every", "50"]
    runs: dict[str, dict[str, Any]] = {}
    if rc == 0:
        for name, extra, env in (
                ("nccl-1rank", [], {}),
                ("killed-in-place", ["--max-restarts", "1"], {"PIPEDREAM_FT_FAULTS": "kill@rank=0,step=150"}),
                ("killed-restart", ["--max-restarts", "1"], {"PIPEDREAM_FT_FAULTS": "kill@rank=0,step=150",
                                                             "PIPEDREAM_FT_RECOVERY": "restart"})):
            cmd = torchrun[:3] + extra + torchrun[3:] + train + ["--ckpt", f"ckpt-{name}", "--save", f"{name}.pt",
                                                                 "--json", f"{name}.json"]
            t0 = time.perf_counter()
            code = _run(name, cmd, out, 300, env)
            row: dict[str, Any] = {"exit": code, "wall_s": time.perf_counter() - t0}
            if code == 0 and (out / f"{name}.json").exists():
                fig = json.loads((out / f"{name}.json").read_text())
                row.update({k: fig.get(k) for k in ("tokens_per_s", "held_out_loss", "final_loss", "seconds")})
            if name != "nccl-1rank":
                row["max_abs_diff_vs_uninterrupted"] = _max_diff(out / "nccl-1rank.pt", out / f"{name}.pt")
            runs[name] = row
            print(f"[{name}] {json.dumps(row)}", flush=True)
        plan = json.loads((out / "gpt.plan.json").read_text())
        predicted = plan.get("time_per_minibatch_s")
        base = runs.get("nccl-1rank", {})
        if predicted and base.get("tokens_per_s"):
            measured = 16 * 64 / base["tokens_per_s"]
            print(f"[plan] predicted {1000 * predicted:.2f} ms per minibatch, measured {1000 * measured:.2f} ms "
                  f"(training loop included): measured/predicted {measured / predicted:.2f}", flush=True)
            results["plan"] = {"predicted_s": predicted, "measured_s": measured}
    results["runs"] = runs

    # 3. checkpoint writes from GPU memory: correct, then fast
    try:
        results["snapshot"] = _snapshot_check(out / "snapshot")
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"[snapshot] failed: {type(e).__name__}: {e}", flush=True)
    results["checkpoint_write_exit"] = _run(
        "bench_checkpoint_write", [py, str(ROOT / "benchmarks" / "bench_checkpoint_write.py"), "--device", "cuda",
                                   "--saves", "12"], out, 300)
    print((out / "bench_checkpoint_write.log").read_text(), flush=True)
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
