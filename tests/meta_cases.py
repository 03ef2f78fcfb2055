"""Models built on the meta device, their data, and the per-rank bodies of tests/test_meta_init.py.

Every model here is built by :func:`build` under ``torch.device("meta")`` (nothing allocated): an
``nn.Sequential`` with a BatchNorm (buffers), the GPT example (fx-traced, tied head) and tiny Hugging Face
Llama, Qwen2 and Gemma 2 (tied head, rotary ``inv_freq`` and ``embed_scale`` buffers) through
:func:`profiler.hf.for_pipeline`. :func:`reference` trains the same model in one process the way flush mode does,
materialised whole by :func:`pipedream_ft.materialize` (each module seeded by its name, as every stage does).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["KINDS", "SEED", "build", "data_for", "loss_for", "plan_json", "reference", "train_case", "load_case"]

SEED = 5
KINDS = ("sequential", "gpt", "llama", "qwen2", "gemma2")
VOCAB = 128


def _make(kind: str) -> nn.Module:
    if kind == "sequential":
        return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(),
                             nn.Linear(16, 5))
    if kind == "gpt":
        from pipedream_ft_examples.gpt import gpt

        return gpt(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=16)
    from hf_models import _CLASSES, _config
    from profiler.hf import for_pipeline

    return for_pipeline(_CLASSES[kind](_config(kind, kind == "gemma2")))


def build(kind: str) -> nn.Module:
    """The ``kind`` model on the meta device."""
    import transformers

    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        return _make(kind)


def data_for(kind: str) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + b)
        if kind == "sequential":
            return torch.randn(6, 12, generator=g), torch.randint(0, 5, (6,), generator=g)
        ids = torch.randint(0, VOCAB, (2, 10), generator=g)
        return ids, ids
    return data


def loss_for(kind: str) -> Callable[[Any, Any], torch.Tensor]:
    if kind == "sequential":
        return nn.functional.cross_entropy
    from profiler.hf import causal_lm_loss

    return causal_lm_loss


def plan_json(kind: str, stages: int = 2) -> dict[str, Any]:
    """The layers cut in ``stages`` near-equal runs."""
    from partitioner.plan import Plan
    from profiler.layers import structure_profile

    prof = structure_profile(build(kind))
    n = len(prof.layers)
    cuts = [round(n * s / stages) for s in range(stages + 1)]
    return Plan.from_stages([list(range(cuts[s], cuts[s + 1])) for s in range(stages)], [1] * stages,
                            profile_hash=prof.structure_hash(),
                            layer_names=[layer.name for layer in prof.layers]).to_json()


def _optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    # SGD, not Adam: Adam scales a gradient that is rounding noise (GPT's key bias) up to the learning rate
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(kind: str, steps: int, window: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The whole model materialised seeded by name, trained like flush mode in one process."""
    from pipedream_ft import materialize

    model = materialize(build(kind), seed=SEED)
    model.train()
    opt = _optimizer(list(model.parameters()))
    data, loss_fn, losses = data_for(kind), loss_for(kind), []
    for b in range(steps):
        x, y = data(b)
        loss = loss_fn(model(x), y)
        losses.append(float(loss.detach()))
        (loss / window).backward()
        if (b + 1) % window == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def train_case(kind: str, plan: dict[str, Any], steps: int, window: int) -> dict[str, Any]:
    """One rank: a meta-built ``kind`` trained ``steps`` minibatches in flush mode."""
    from partitioner.plan import Plan
    from pipedream_ft import PipelineConfig, PipelineTrainer

    model = build(kind)
    trainer = PipelineTrainer(model, Plan.from_json(plan), loss_fn=loss_for(kind), optimizer_factory=_optimizer,
                              config=PipelineConfig(mode="flush", flush_every=window, seed=SEED, timeout_s=120,
                                                    summary=False))
    result = trainer.train(data_for(kind), steps)
    state = trainer.full_state_dict()
    metas = [n for n, t in trainer.module.state_dict().items() if t.is_meta]
    trainer.close()
    return {"losses": result.losses, "state": state, "meta_left": metas}


def train_cases(runs: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """One rank: :func:`train_case` for each argument tuple in turn (one spawn for all)."""
    return [train_case(*args) for args in runs]


def load_case(kind: str, plan: dict[str, Any], paths: list[str], bad: str) -> dict[str, Any]:
    """One rank: for each weights file in ``paths``, a trainer initialised from it (the keys read counted, the
    stage's state returned); then the one-line error a file with a stray key gives."""
    from partitioner.plan import Plan
    from pipedream_ft import FromFile, PipelineConfig, PipelineSetupError, PipelineTrainer
    from pipedream_ft.checkpoint import weights_file

    read: list[str] = []
    original = weights_file.WeightsFile.read

    def counting(self: Any, key: str) -> torch.Tensor:
        read.append(key)
        return original(self, key)

    weights_file.WeightsFile.read = counting  # type: ignore[method-assign]
    out: dict[str, Any] = {"loaded": []}
    config = PipelineConfig(mode="flush", flush_every=2, timeout_s=120, summary=False)
    for path in paths:
        read.clear()
        trainer = PipelineTrainer(build(kind), Plan.from_json(plan), loss_fn=loss_for(kind),
                                  optimizer_factory=_optimizer, config=config, init=FromFile(path))
        state = {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
        out["loaded"].append({"read": list(read), "state": state, "stage": trainer.stage_index})
        trainer.train(data_for(kind), 2)  # it trains
        trainer.close()
    try:
        PipelineTrainer(build(kind), Plan.from_json(plan), loss_fn=loss_for(kind), optimizer_factory=_optimizer,
                        config=config, init=FromFile(bad))
        out["error"] = None
    except PipelineSetupError as exc:
        out["error"] = str(exc)
    return out


def big_llama(layers: int = 12) -> nn.Module:
    """A Llama of about 285 MB in float32 (vocabulary 32000, hidden 512), on the meta device, wrapped by
    ``for_pipeline``: large enough that a process holding it whole shows in its peak resident memory."""
    import transformers

    from profiler.hf import for_pipeline

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    with torch.device("meta"):
        return for_pipeline(transformers.LlamaForCausalLM(config))


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def save_case(plan: dict[str, Any], directory: str, file: str) -> dict[str, Any]:
    """One rank: the big Llama built on meta, seeded, written by every stage with ``save_pretrained`` and
    ``save_model(..., "safetensors")``; this process's resident memory before and its peak after."""
    from partitioner.plan import Plan
    from pipedream_ft import PipelineConfig, PipelineTrainer
    from profiler.hf import causal_lm_loss

    model = big_llama()  # imports done: what grows from here is the model's
    before = status_kib("VmRSS")
    marks = {}
    trainer = PipelineTrainer(model, Plan.from_json(plan), loss_fn=causal_lm_loss,
                              optimizer_factory=_optimizer,
                              config=PipelineConfig(mode="flush", seed=SEED, timeout_s=300, summary=False,
                                                    check_model_hash=False))
    del model
    stage_bytes = sum(t.numel() * t.element_size() for t in trainer.module.state_dict().values())
    marks["built"] = (status_kib("VmRSS"), status_kib("VmHWM"))
    trainer.save_pretrained(directory, max_shard_bytes=40 * 2**20)
    marks["pretrained"] = (status_kib("VmRSS"), status_kib("VmHWM"))
    trainer.save_model(file, format="safetensors")
    marks["model"] = (status_kib("VmRSS"), status_kib("VmHWM"))
    trainer.close()
    return {"before_kib": before, "peak_kib": status_kib("VmHWM"), "stage_bytes": stage_bytes, "marks": marks}


def memory_case(mode: str) -> list[dict[str, Any]]:
    """One rank: the runtime tests' MLP (built on meta) trained 8 minibatches with Adam; every rank's stats."""
    from partitioner.plan import Plan  # noqa: F401
    from pipedream_ft import PipelineConfig, PipelineTrainer
    from runtime_cases import adam, data, mlp, plan_for, timed_profile

    with torch.device("meta"):
        model = mlp()
    plan = plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]])
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=adam,
                              profile=timed_profile(model),
                              config=PipelineConfig(mode=mode, flush_every=4, timeout_s=120, summary=False))
    trainer.train(data, 8)
    rows = trainer.gather_stats()
    trainer.close()
    return rows


def checkpoint_case(url: str) -> dict[str, torch.Tensor]:
    """One rank: the runtime tests' MLP (built on meta) trained 8 minibatches, checkpointed at 8; the whole model's
    weights."""
    from pipedream_ft import CheckpointConfig, EveryNSteps, PipelineConfig, PipelineTrainer
    from runtime_cases import data, mlp, plan_for, sgd

    with torch.device("meta"):
        model = mlp()
    trainer = PipelineTrainer(model, plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]]),
                              loss_fn=nn.functional.cross_entropy, optimizer_factory=sgd,
                              checkpoint=CheckpointConfig(url=url, policy=EveryNSteps(8)),
                              config=PipelineConfig(mode="flush", flush_every=4, timeout_s=120, summary=False))
    trainer.fit(data, 8)
    state = trainer.full_state_dict()
    trainer.close()
    return state


def resize_case(url: str, total: int) -> dict[str, Any]:
    """One rank: the runtime tests' MLP built on meta (seeded per module, seed 0), from a 4-stage straight plan,
    flush mode with Adam, checkpointing every 8 minibatches, resuming (and re-planning for this world size)
    from ``url``; trained to ``total``."""
    from pipedream_ft import CheckpointConfig, EveryNSteps, PipelineConfig, PipelineTrainer
    from runtime_cases import adam, data, mlp, plan_for, timed_profile

    with torch.device("meta"):
        model = mlp()
    plan = plan_for(model, [[0, 1], [2, 3], [4, 5], [6, 7, 8]], None,
                    {"workers": [4], "bandwidth": [1e9], "straight": True})
    trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy, optimizer_factory=adam,
                              profile=timed_profile(model),
                              checkpoint=CheckpointConfig(url=url, policy=EveryNSteps(8), defer_when_behind=False),
                              config=PipelineConfig(mode="flush", flush_every=4, timeout_s=120, summary=False))
    resumed = trainer.resumed_from
    result = trainer.fit(data, total)
    state = trainer.full_state_dict()
    stages = len(trainer.plan.stages)
    trainer.close()
    return {"state": state, "losses": result.losses, "resumed": resumed, "stages": stages}
