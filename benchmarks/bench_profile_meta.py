"""Benchmark: the profile of a model built on meta (one layer materialised at a time) against the whole model's.

Run: ``python benchmarks/bench_profile_meta.py [--rounds 3] [--warmup 2] [--repeats 5] [--json OUT]``.

Two models that fit: the GPT example (``pipedream_ft_examples.gpt``, GPTConfig defaults: 4 blocks, 128 wide,
vocabulary 256; a minibatch of 8 sequences of 128 tokens) and a small Llama wrapped by
:func:`profiler.hf.for_pipeline` (hidden 256, MLP 688, 4 decoder layers, 8 heads, 4 key/value heads,
vocabulary 2048; 4 sequences of 128 tokens). Each is profiled ``--rounds`` times whole (built on the CPU) and
on meta (built under ``torch.device("meta")``; identical decoder layers measured once), the two alternating so
that a change of load hits both. Per layer that matters (at least 1 % of the model's forward plus backward
time in the whole profile), the ratio of its meta time to its whole time (forward plus backward, the median over
the rounds of each); printed: the median ratio, the share of layers within 10 %, the worst, the overall ratio
(sums), the same from the fastest round of each layer (a shared machine only ever slows a layer down, so the
fastest round is the best estimate of its idle time), each profile's median spread (:mod:`profiler.noise`),
and the load average before and after (the figures are only as good as the machine is quiet). ``--threads``
(default 1) sets torch's threads: on an oversubscribed machine a multi-threaded kernel waits for its slowest
thread, which makes single layers tens of times slower at random.

Measured (``--rounds 3``, 1 thread) on the 2-core machine with nothing else running (load average 0.9):
GPT, meta/whole per layer median 1.016, all 24 layers that matter within 10 % (the worst 1.05), overall 1.022;
Llama, per layer median 0.982, all 5 within 10 %, overall 0.988. On the same machine shared with other work
(load average 16-18, i.e. far from idle):
GPT, meta/whole per layer median 0.955 (59 % of 17 layers within 10 %), overall 0.949; Llama, per layer median
1.065 (all 5 layers within 10 %), overall 1.054. On that machine with 2 threads the same run gave ratios from
0.1 to 14: the noise, not the method (a layer of the whole model against itself varied 5-fold between rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from profiler.measure import profile_model  # noqa: E402
from profiler.profile import Profile  # noqa: E402

__all__ = ["MODELS", "compare", "main"]

SHARE = 0.01
"""A layer counts in the ratios when its whole-model time is at least this share of the total."""


def _gpt() -> nn.Module:
    from pipedream_ft_examples.gpt import gpt

    return gpt()


def _llama() -> nn.Module:
    import transformers

    from profiler.hf import for_pipeline

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    return for_pipeline(transformers.LlamaForCausalLM(config))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "gpt": (_gpt, lambda: torch.randint(0, 256, (8, 128))),
    "llama": (_llama, lambda: torch.randint(0, 2048, (4, 128))),
}


def _total(layer: Any) -> float:
    return float(layer.forward_ms + layer.backward_ms)


def compare(whole: list[Profile], meta: list[Profile], pick: Callable[[list[float]], float] = statistics.median
            ) -> dict[str, Any]:
    """Per-layer and overall ratios of meta to whole times (``pick`` over the rounds: median or min)."""
    names = [l.name for l in whole[0].layers]
    w = {n: pick([_total(p.layers[i]) for p in whole]) for i, n in enumerate(names)}
    m = {n: pick([_total(p.layers[i]) for p in meta]) for i, n in enumerate(names)}
    total = sum(w.values())
    counted = [n for n in names if total > 0 and w[n] >= SHARE * total and w[n] > 0]
    ratios = {n: m[n] / w[n] for n in counted}
    reused = {l.name: l.reused_from for l in meta[0].layers if l.reused_from}
    return {
        "layers": len(names),
        "counted": len(counted),
        "median_ratio": statistics.median(ratios.values()) if ratios else float("nan"),
        "within_10pct": sum(abs(r - 1) <= 0.10 for r in ratios.values()) / max(len(ratios), 1),
        "worst": sorted(ratios.items(), key=lambda kv: abs(kv[1] - 1), reverse=True)[:5],
        "overall_ratio": sum(m.values()) / total if total else float("nan"),
        "whole_ms": total,
        "meta_ms": sum(m.values()),
        "whole_spread": [p.meta["timing_spread"]["median_spread"] for p in whole],
        "meta_spread": [p.meta["timing_spread"]["median_spread"] for p in meta],
        "reused": len(reused),
        "per_layer": {n: [round(w[n], 4), round(m[n], 4)] for n in counted},
    }


def run(name: str, rounds: int, warmup: int, repeats: int) -> dict[str, Any]:
    build, example = MODELS[name]
    x = example()
    whole: list[Profile] = []
    meta: list[Profile] = []
    walls: dict[str, list[float]] = {"whole": [], "meta": []}
    for r in range(rounds):
        for kind in (("whole", "meta") if r % 2 == 0 else ("meta", "whole")):
            torch.manual_seed(0)
            if kind == "whole":
                model = build()
            else:
                with torch.device("meta"):
                    model = build()
            t0 = time.perf_counter()
            p = profile_model(model, x, warmup=warmup, repeats=repeats, warn=False)
            walls[kind].append(time.perf_counter() - t0)
            (whole if kind == "whole" else meta).append(p)
            del model
    out = compare(whole, meta)
    out["by_min"] = {k: v for k, v in compare(whole, meta, min).items()
                     if k in ("median_ratio", "within_10pct", "worst", "overall_ratio", "whole_ms", "meta_ms")}
    out["wall_s"] = {k: round(statistics.median(v), 2) for k, v in walls.items()}
    params = [l.parameter_bytes for l in meta[0].layers]
    out["largest_layer_params_mib"] = round(max(params) / 2**20, 2)
    out["model_params_mib"] = round(sum(params) / 2**20, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="profiles of each kind per model (default 3)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma separated, of {', '.join(MODELS)}")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the least sensitive to a shared machine; the ratio is the point)")
    ap.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    print(f"cpus {os.cpu_count()}, torch threads {torch.get_num_threads()}, torch {torch.__version__}, "
          f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    results: dict[str, Any] = {"load_before": load0}
    for name in args.models.split(","):
        r = run(name, args.rounds, args.warmup, args.repeats)
        results[name] = r
        worst = ", ".join(f"{n} {v:.2f}" for n, v in r["worst"])
        print(f"{name}: {r['layers']} layers ({r['counted']} at >= 1 % of the time, {r['reused']} reused on meta); "
              f"whole {r['whole_ms']:.2f} ms, meta {r['meta_ms']:.2f} ms per minibatch (fwd+bwd)")
        print(f"  meta/whole per layer: median {r['median_ratio']:.3f}, within 10 %: {100 * r['within_10pct']:.0f} %;"
              f" worst: {worst}")
        b = r["by_min"]
        worst_min = ", ".join(f"{n} {v:.2f}" for n, v in b["worst"])
        print(f"  by the fastest round of each: per layer median {b['median_ratio']:.3f}, within 10 %: "
              f"{100 * b['within_10pct']:.0f} %, overall {b['overall_ratio']:.3f}; worst: {worst_min}")
        print(f"  overall meta/whole {r['overall_ratio']:.3f}; median spread whole {r['whole_spread']}, "
              f"meta {r['meta_spread']}; wall s {r['wall_s']}; largest layer {r['largest_layer_params_mib']} MiB "
              f"of {r['model_params_mib']} MiB parameters")
    load1 = os.getloadavg()
    results["load_after"] = load1
    print(f"load average after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
