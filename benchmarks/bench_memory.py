"""Memory per process of a large model's pipeline: built on the meta device each process holds its stage only.

Run: ``python benchmarks/bench_memory.py [--hidden 2048] [--intermediate 5504] [--layers 20] [--vocab 32000]
[--world 4] [--steps 4] [--old auto|yes|no] [--force]``; ``--quick`` for a small model (a check of the script).

The model is a Llama-style decoder (``transformers.LlamaForCausalLM`` through :func:`profiler.hf.for_pipeline`,
untied head, float32), about 1.0 B parameters (4.1 GB) by default, cut into ``--world`` stages balanced by
parameter bytes (the final norm and the head together), each on its own spawned CPU process (gloo on loopback),
trained ``--steps`` minibatches in flush mode (one SGD step, no momentum; 1 sequence of 32 tokens each). Runs:

- ``empty``: the same job with a tiny model (hidden 8, 2 layers, vocabulary 16): the runtime's baseline (the
  interpreter, torch, transformers, the process groups), per process;
- ``meta``: built under ``torch.device("meta")``, each process materialising and initialising only its stage
  (seeded per module, the default);
- ``file``: built on meta, initialised from a safetensors file of the whole model written beforehand (tensor by
  tensor, module by module, never holding the whole model) and dropped from the page cache, so the bytes each
  process reads from disk (``/proc/self/io`` ``read_bytes`` while the trainer is built) show what it read;
- ``old``: built on the CPU with real weights in every process, as before (skipped with ``--old auto`` when the
  machine's available memory cannot hold ``world`` whole models).

Per process: peak resident memory (``VmHWM``) above the process's resident memory before building, against the
runtime's own account of the stage (:meth:`PipelineTrainer.memory_report`: weights, gradients, optimizer state,
weight versions, in-flight activations), against ``1.3 x`` that prediction ``+`` the empty stage's peak, and
against ``0.5 x`` the whole model's bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))

__all__ = ["main", "write_checkpoint"]

_TINY = dict(hidden=8, intermediate=16, layers=2, vocab=16, heads=2, kv_heads=1)


def _config(size: dict[str, int]) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"],
                                    intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
                                    num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                                    max_position_embeddings=64, tie_word_embeddings=False)


def build(size: dict[str, int], meta: bool) -> Any:
    import torch
    import transformers

    from profiler.hf import for_pipeline

    if meta:
        with torch.device("meta"):
            return for_pipeline(transformers.LlamaForCausalLM(_config(size)))
    return for_pipeline(transformers.LlamaForCausalLM(_config(size)))


def plan_json(size: dict[str, int], world: int) -> dict[str, Any]:
    """``world`` stages balanced by parameter bytes; everything after the last decoder layer on the last stage."""
    from partitioner.plan import Plan
    from profiler.layers import structure_profile

    prof = structure_profile(build(size, meta=True))
    sizes = [layer.parameter_bytes for layer in prof.layers]
    tail = len(sizes) - 2  # the final norm and the head stay together
    total = sum(sizes)
    cuts, acc = [0], 0.0
    for i, b in enumerate(sizes[:tail]):
        acc += b
        if len(cuts) < world and acc >= total * len(cuts) / world and i + 1 < tail:
            cuts.append(i + 1)
    while len(cuts) < world:  # a tiny model: cut the decoder evenly
        cuts.append(cuts[-1] + 1)
    cuts.append(len(sizes))
    stages = [list(range(cuts[s], cuts[s + 1])) for s in range(world)]
    return Plan.from_stages(stages, [1] * world, profile_hash=prof.structure_hash(),
                            layer_names=[layer.name for layer in prof.layers]).to_json()


def write_checkpoint(size: dict[str, int], path: str, seed: int) -> int:
    """Write the whole model, initialised as a meta-built job seeded with ``seed`` would be, as one safetensors
    file at ``path``, module by module (only one module's tensors in memory at a time); its size in bytes."""
    from pipedream_ft import materialize
    from pipedream_ft.checkpoint.safetensors_layout import entry_of, layout, write_header, write_tensor

    model = build(size, meta=True)
    state = model.state_dict(keep_vars=True)
    plan = layout([entry_of(k, t) for k, t in state.items()])
    keys_of: dict[int, list[str]] = {}
    for k, t in state.items():
        keys_of.setdefault(id(t), []).append(k)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_header(fd, plan)
        for name, module in model.named_modules():
            slots = [(store, n, keys_of[id(t)]) for store in (module._parameters, module._buffers)
                     for n, t in store.items() if t is not None and id(t) in keys_of]
            if not slots:
                continue
            materialize(model, [name], seed=seed)
            for store, n, keys in slots:
                for k in keys:
                    write_tensor(fd, store[n], plan.offsets[k])
            module.to("meta")  # let go of its storage
            _trim()
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: the readers go to disk
    finally:
        os.close(fd)
    return plan.size


def _trim() -> None:
    """Give freed heap memory back to the system (glibc keeps freed blocks under 32 MB in its heap)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def rank_job(size: dict[str, int], meta: bool, plan: dict[str, Any], steps: int, path: str | None) -> dict[str, Any]:
    import torch

    from partitioner.plan import Plan
    from pipedream_ft import FromFile, PipelineConfig, PipelineTrainer
    from profiler.hf import causal_lm_loss

    torch.set_num_threads(1)
    import transformers  # noqa: F401  (imported before the baseline is read)

    from pipedream_ft.checkpoint import weights_file

    asked = [0]
    read = weights_file.WeightsFile.read

    def counted(self: Any, key: str) -> Any:
        t = read(self, key)
        asked[0] += t.numel() * t.element_size()
        return t

    weights_file.WeightsFile.read = counted  # type: ignore[method-assign]
    before = _status_kib("VmRSS") * 1024
    io0 = _io()
    t0 = time.perf_counter()
    trainer = PipelineTrainer(build(size, meta), Plan.from_json(plan), loss_fn=causal_lm_loss,
                              optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                              init=FromFile(path) if path else None,
                              config=PipelineConfig(mode="flush", flush_every=steps, timeout_s=1800, summary=False,
                                                    check_model_hash=False))
    built_s = time.perf_counter() - t0
    io1 = _io()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, size["vocab"], (1, 32), generator=g) for _ in range(steps)]
    t0 = time.perf_counter()
    trainer.train(lambda b: (batches[b], batches[b]), steps)
    train_s = time.perf_counter() - t0
    report = trainer.memory_report().as_dict()
    trainer.close()
    return {"before": before, "peak": _status_kib("VmHWM") * 1024, "report": report, "built_s": built_s,
            "train_s": train_s, "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "rchar": io1["rchar"] - io0["rchar"], "asked": asked[0]}


def _run(name: str, size: dict[str, int], meta: bool, world: int, steps: int, path: str | None = None) -> list[dict]:
    from spawned import run_world

    t0 = time.perf_counter()
    rows = run_world(rank_job, (size, meta, plan_json(size, world), steps, path), world, 7200, f"run {name}")
    print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
    return rows


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5504)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--old", choices=("auto", "yes", "no"), default="auto")
    ap.add_argument("--force", action="store_true", help="run even if the model seems not to fit in memory")
    ap.add_argument("--quick", action="store_true", help="a small model (hidden 256, 4 layers, vocabulary 4000)")
    args = ap.parse_args(argv)
    size = dict(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, vocab=args.vocab,
                heads=args.heads, kv_heads=args.kv_heads)
    if args.quick:
        size = dict(hidden=256, intermediate=688, layers=4, vocab=4000, heads=4, kv_heads=2)
    model = build(size, meta=True)
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(p.numel() for p in model.parameters())
    del model
    need = 3.3 * whole  # the stages' weights, gradients and current versions, with room
    available = _available()
    print(f"model: Llama-style, {params / 1e9:.3f} B parameters, {whole / 2**30:.2f} GiB float32; "
          f"{args.world} processes, flush mode, {args.steps} minibatches; {available / 2**30:.1f} GiB available")
    if need > available and not args.force:
        print(f"pipedream-ft bench_memory: the job needs about {need / 2**30:.1f} GiB, only "
              f"{available / 2**30:.1f} GiB are available; choose a smaller size or pass --force", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {"empty": _run("empty", _TINY, True, args.world, args.steps),
                                   "meta": _run("meta", size, True, args.world, args.steps)}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        path = os.path.join(tmp, "model.safetensors")
        t0 = time.perf_counter()
        file_bytes = write_checkpoint(size, path, seed=0)
        print(f"[checkpoint written module by module: {file_bytes / 2**30:.2f} GiB, "
              f"{time.perf_counter() - t0:.0f} s; writer's peak resident {_status_kib('VmHWM') / 2**20:.2f} GiB]")
        runs["file"] = _run("file", size, True, args.world, args.steps, path)
    old = args.old == "yes" or (args.old == "auto" and args.world * (whole + 1.2 * whole / args.world) * 1.2
                                < _available())
    if old:
        runs["old"] = _run("old", size, False, args.world, args.steps)
    else:
        print("old: skipped (the machine cannot hold one whole model per process now; --old yes forces it)")
    print(_table(runs, whole))
    return 0


def _table(runs: dict[str, list[dict]], whole: int) -> str:
    mib = 2**20
    head = ["run", "rank", "stage", "weights", "grads", "optim", "versions", "activ", "accounted", "peak",
            "grown", "empty", "1.3xacc+empty", "0.5xmodel", "asked MiB", "disk MiB", "built s", "train s"]
    lines = [head]
    empty = {r["report"]["stage"]: r["peak"] for r in runs["empty"]}
    for name, rows in runs.items():
        for rank, r in enumerate(rows):
            m = r["report"]
            grown = r["peak"] - r["before"]
            bound = 1.3 * m["accounted"] + empty.get(m["stage"], 0)
            lines.append([name, str(rank), str(m["stage"]), *(f"{m[k] / mib:.0f}" for k in
                          ("parameters", "gradients", "optimizer", "stash", "activations", "accounted")),
                          f"{r['peak'] / mib:.0f}", f"{grown / mib:.0f}", f"{empty.get(m['stage'], 0) / mib:.0f}",
                          f"{bound / mib:.0f}{' ok' if r['peak'] <= bound else ' OVER'}",
                          f"{0.5 * whole / mib:.0f}{' ok' if r['peak'] < 0.5 * whole else ' OVER'}",
                          f"{r['asked'] / mib:.0f}", f"{r['read_bytes'] / mib:.0f}",
                          f"{r['built_s']:.1f}", f"{r['train_s']:.1f}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)
    return text + (f"\n(MiB; whole model {whole / mib:.0f} MiB; peak = VmHWM; grown = peak - resident before building; "
                   "asked = bytes of the tensors read from the file; disk = /proc/self/io read_bytes while building)")


if __name__ == "__main__":
    sys.exit(main())
