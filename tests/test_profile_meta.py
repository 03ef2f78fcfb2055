"""Profiling a model built on the meta device: one layer materialised at a time, the same profile otherwise."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from profiler import Profile, load_profile
from profiler.cli import main
from profiler.hf import for_pipeline
from profiler.materialize import has_meta, init_function, layer_seed, materialized, materialized_buffers
from profiler.measure import profile_model
from profiler.noise import MEDIAN_LIMIT, spread

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_models  # noqa: E402

pytestmark = pytest.mark.timeout(180)

FAST: dict[str, Any] = {"warmup": 0, "repeats": 1}


def _seq() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                         nn.BatchNorm2d(32), nn.Flatten(), nn.Linear(32 * 64, 10))


def _gpt() -> nn.Module:
    from pipedream_ft_examples.gpt import gpt

    return gpt(n_layer=2, n_embd=32, n_head=2, block_size=16)


def _llama() -> nn.Module:
    import transformers

    return for_pipeline(transformers.LlamaForCausalLM(hf_models._config("llama", False)))


def _gemma2() -> nn.Module:
    import transformers

    return for_pipeline(transformers.Gemma2ForCausalLM(hf_models._config("gemma2", False)))


def _same_structure(whole: Profile, meta: Profile) -> None:
    assert [(l.name, l.description, l.kind, l.activation_bytes, l.parameter_bytes) for l in whole.layers] == \
        [(l.name, l.description, l.kind, l.activation_bytes, l.parameter_bytes) for l in meta.layers]
    assert whole.edges == meta.edges and whole.tied == meta.tied and whole.inputs == meta.inputs
    assert whole.keep_together == meta.keep_together
    assert whole.structure_hash() == meta.structure_hash()


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "sequential": (_seq, lambda: torch.randn(4, 1, 8, 8)),
    "gpt": (_gpt, lambda: torch.randint(0, 256, (2, 16))),
    "llama": (_llama, lambda: torch.randint(0, hf_models.VOCAB, (2, 8))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_meta_model_profiles_as_the_whole_model_does(case: str) -> None:
    build, example = CASES[case]
    x = example()
    torch.manual_seed(0)
    whole = profile_model(build(), x, reuse=False, **FAST)
    with torch.device("meta"):
        model = build()
    profile = profile_model(model, x, **FAST)
    _same_structure(whole, profile)
    assert profile.meta["materialized"] == "per layer" and profile.meta["seed"] == 0
    assert "materialized" not in whole.meta
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))  # left as it was
    assert all(p.grad is None for p in model.parameters())


def test_identical_decoder_layers_are_measured_once() -> None:
    with torch.device("meta"):
        model = _llama()
    profile = profile_model(model, torch.randint(0, hf_models.VOCAB, (2, 8)), **FAST)
    reused = {l.name: l.reused_from for l in profile.layers if l.reused_from}
    assert reused == {"model_layers_1": "model_layers_0", "model_layers_2": "model_layers_0",
                      "model_layers_3": "model_layers_0"}
    first, copy = profile.layers[profile.index("model_layers_0")], profile.layers[profile.index("model_layers_3")]
    assert (copy.forward_ms, copy.backward_ms) == (first.forward_ms, first.backward_ms)
    again = Profile.from_json(profile.to_json())
    assert again.layers[again.index("model_layers_2")].reused_from == "model_layers_0"


def test_layers_of_different_attention_are_not_reused_for_each_other() -> None:
    with torch.device("meta"):
        model = _gemma2()  # sliding and full attention alternate
    profile = profile_model(model, torch.randint(0, hf_models.VOCAB, (2, 8)), **FAST)
    reused = {l.name: l.reused_from for l in profile.layers if l.name.startswith("model_layers_")}
    assert reused == {"model_layers_0": None, "model_layers_1": None, "model_layers_2": "model_layers_0",
                      "model_layers_3": "model_layers_1"}


def test_identical_layers_of_the_gpt_example_are_reused_and_a_whole_model_is_not_by_default() -> None:
    x = torch.randint(0, 256, (2, 16))
    with torch.device("meta"):
        model = _gpt()
    profile = profile_model(model, x, **FAST)
    assert profile.layers[profile.index("h_1_attn_c_attn")].reused_from == "h_0_attn_c_attn"
    assert profile.layers[profile.index("h_0_attn_c_attn")].reused_from is None
    whole = profile_model(_gpt(), x, **FAST)
    assert all(l.reused_from is None for l in whole.layers)


def test_the_seed_is_recorded_and_changes_no_structure() -> None:
    with torch.device("meta"):
        model = _seq()
    a = profile_model(model, torch.randn(2, 1, 8, 8), seed=7, **FAST)
    assert a.meta["seed"] == 7


def test_layer_seed_is_stable_and_depends_on_both_parts() -> None:
    assert layer_seed(0, "model.layers.0") == 7866710355461995336
    assert layer_seed(0, "model.layers.0") != layer_seed(1, "model.layers.0")
    assert layer_seed(0, "model.layers.0") != layer_seed(0, "model.layers.1")
    with pytest.raises(TypeError, match="seed must be an int"):
        layer_seed("0", "x")  # type: ignore[arg-type]


def _values(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_a_materialised_layer_is_initialised_deterministically_per_seed_and_name() -> None:
    with torch.device("meta"):
        model = _llama()
    layer = model.model.layers[1]
    init = init_function(model)
    assert init is not None

    def draw(seed: int, name: str) -> list[torch.Tensor]:
        with materialized(layer, "cpu", seed=seed, name=name, init=init):
            assert not has_meta(layer)
            return _values(layer)

    torch.manual_seed(123)
    first = draw(0, "model.layers.1")
    torch.manual_seed(456)  # the global RNG plays no part
    second = draw(0, "model.layers.1")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not all(torch.equal(a, b) for a, b in zip(first, draw(1, "model.layers.1")))
    assert not all(torch.equal(a, b) for a, b in zip(first, draw(0, "model.layers.2")))
    assert has_meta(layer) and all(p.is_meta for p in layer.parameters())
    # the model's own initialiser ran: transformers' normal(0, initializer_range) on the projections, norms at 1
    q = dict(zip([n for n, _ in layer.named_parameters()], first))
    assert torch.equal(q["input_layernorm.weight"], torch.ones(32))
    assert 0.005 < float(q["self_attn.q_proj.weight"].std()) < 0.05


def test_a_module_without_a_model_initialiser_uses_its_reset_parameters() -> None:
    with torch.device("meta"):
        conv = nn.Conv2d(1, 4, 3)
    with materialized(conv, "cpu", seed=0, name="0"):
        w = conv.weight.detach().clone()
        assert float(w.abs().sum()) > 0 and float(w.abs().max()) <= 1 / 3  # kaiming_uniform's bound, fan_in 9
    assert conv.weight.is_meta


def test_tied_parameters_stay_tied_and_meta_after_materialising() -> None:
    with torch.device("meta"):
        model = _gpt()
    with materialized(model.lm_head, "cpu", seed=0, name="lm_head"):
        assert not model.lm_head.weight.is_meta and model.wte.weight.is_meta
    assert model.lm_head.weight is model.wte.weight


def test_computed_buffers_get_their_real_values() -> None:
    torch.manual_seed(0)
    reference = _llama()
    with torch.device("meta"):
        model = _llama()
    with materialized_buffers(model, "cpu", init=init_function(model)):
        for (name, real), (_, mine) in zip(reference.named_buffers(), model.named_buffers()):
            assert torch.equal(real, mine), name
    assert all(b.is_meta for b in model.buffers())


class _Config:
    width = 6


class _Computed(nn.Module):
    """A buffer computed in ``__init__`` from a config, and no initialiser that recomputes it."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("table", torch.arange(config.width, dtype=torch.float32) / 2, persistent=False)


class _Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(3, dtype=torch.float32), persistent=False)


def test_a_computed_buffer_no_initialiser_sets_is_rebuilt_from_its_config_or_refused() -> None:
    with torch.device("meta"):
        computed, opaque = _Computed(_Config()), nn.Sequential(_Opaque())
    with materialized_buffers(computed, "cpu"):
        assert torch.equal(computed.table, torch.arange(6, dtype=torch.float32) / 2)
    with pytest.raises(ValueError, match=r"buffer 0\.table of _Opaque is on the meta device and nothing recomputes"):
        with materialized_buffers(opaque, "cpu"):
            pass
    assert opaque[0].table.is_meta


class _Clock:
    """Times from a list, in turn (the profiler's timer, injected)."""

    def __init__(self, times: list[float]) -> None:
        self.times = times
        self.i = 0

    def start(self) -> None:
        pass

    def stop(self) -> float:
        t = self.times[self.i % len(self.times)]
        self.i += 1
        return t


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


def test_a_noisy_timer_gives_one_warning_line(capsys: pytest.CaptureFixture[str]) -> None:
    noisy = _Clock([1.0, 1.0, 9.0, 1.0, 1.0, 30.0, 2.0])
    profile = profile_model(_mlp(), torch.randn(4, 8), warmup=0, repeats=7, clock=noisy)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("warning: the machine was too noisy to trust these times: median spread")
    assert "worst: " in err[0]
    assert profile.meta["timing_spread"]["median_spread"] > MEDIAN_LIMIT
    assert all(l.forward_spread is not None and l.forward_spread > 0 for l in profile.layers)


def test_a_quiet_timer_gives_no_warning(capsys: pytest.CaptureFixture[str]) -> None:
    profile = profile_model(_mlp(), torch.randn(4, 8), warmup=0, repeats=7, clock=_Clock([2.0]))
    assert capsys.readouterr().err == ""
    assert all(l.forward_spread == 0 and l.backward_spread == 0 for l in profile.layers)
    assert profile.meta["timing_spread"] == {"median_spread": 0.0, "layers": 3, "worst": [["0", 0.0], ["1", 0.0],
                                                                                         ["2", 0.0]]}
    profile_model(_mlp(), torch.randn(4, 8), warmup=0, repeats=7, clock=_Clock([1.0, 40.0]), warn=False)
    assert capsys.readouterr().err == ""


def test_one_wild_layer_is_enough_to_warn(capsys: pytest.CaptureFixture[str]) -> None:
    from profiler.noise import noise_warning
    from profiler.profile import Layer

    layers = [Layer(f"l{i}", "", 1.0, 2.0, 0.0, 0.0, forward_spread=0.05, backward_spread=0.05) for i in range(9)]
    quiet = Profile(tuple(layers), ())
    assert noise_warning(quiet) is None
    wild = Profile((*layers, Layer("conv", "", 1.0, 2.0, 0.0, 0.0, forward_spread=40.0, backward_spread=0.1)), ())
    line = noise_warning(wild)
    assert line is not None and "worst: conv 40.00" in line and "median spread (p75-p25)/median 0.05" in line


OLD = """{"format": "pipedream-ft-profile", "version": 1, "meta": {"model": "m"},
 "layers": [{"name": "0", "description": "Linear", "forward_ms": 1.0, "backward_ms": 2.0,
             "activation_bytes": 64, "parameter_bytes": 288},
            {"name": "1", "description": "ReLU", "forward_ms": 0.1, "backward_ms": 0.1,
             "activation_bytes": 64, "parameter_bytes": 0, "kind": "tensor", "weight_backward_ms": 0.0}],
 "edges": [[0, 1]]}
"""


def test_an_old_profile_still_loads_and_new_fields_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(OLD)
    old = load_profile(path)
    assert [(l.forward_spread, l.backward_spread, l.reused_from) for l in old.layers] == [(None, None, None)] * 2
    assert "forward_spread" not in old.to_json()["layers"][0] and "reused_from" not in old.to_json()["layers"][0]
    with torch.device("meta"):
        model = _gpt()
    new = profile_model(model, torch.randint(0, 256, (2, 16)), **FAST)
    new.save(tmp_path / "new.json")
    back = load_profile(tmp_path / "new.json")
    assert back.layers == new.layers and back.structure_hash() == new.structure_hash()


def test_reused_from_must_name_a_layer(tmp_path: Path) -> None:
    from profiler import ProfileError

    bad = OLD.replace('"parameter_bytes": 0,', '"parameter_bytes": 0, "reused_from": "nope",')
    path = tmp_path / "bad.json"
    path.write_text(bad)
    with pytest.raises(ProfileError, match="reused_from names 'nope', which is no layer of the profile"):
        load_profile(path)


FACTORIES = '''
import sys
import torch
sys.path.insert(0, {tests!r})
import hf_models
from torch import nn

def raw():
    return hf_models.tiny("llama")

def on_meta():
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
'''


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(sys, "path", list(sys.path))
    file = tmp_path / "factories.py"
    file.write_text(FACTORIES.format(tests=str(Path(__file__).resolve().parent)))
    return file


def test_the_cli_tells_a_raw_hugging_face_model_to_use_for_pipeline(factories: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "raw.json"
    rc = main([f"{factories}:raw", "--input", f"input_ids:8:int:{hf_models.VOCAB}", "--batch-size", "2",
               "--warmup", "0", "--repeats", "1", "-o", str(out)])
    assert rc == 2 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("pipedream-profile: error: ")
    assert "raw Hugging Face LlamaForCausalLM" in err[0] and "profiler.hf.for_pipeline(model)" in err[0]


def test_the_cli_profiles_a_model_built_on_meta(factories: Path, tmp_path: Path) -> None:
    out = tmp_path / "meta.json"
    rc = main([f"{factories}:on_meta", "--input-shape", "8", "--batch-size", "4", "--seed", "3",
               "--warmup", "0", "--repeats", "1", "-o", str(out)])
    assert rc == 0
    p = load_profile(out)
    assert p.meta["materialized"] == "per layer" and p.meta["seed"] == 3
    assert [l.activation_bytes for l in p.layers] == [256, 256, 64]
    assert [l.parameter_bytes for l in p.layers] == [(8 * 16 + 16) * 4, 0, (16 * 4 + 4) * 4]


class _Watcher:
    """A timer that, each time it starts, notes which of the model's parameters are real (not meta)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.seen: set[tuple[str, ...]] = set()

    def start(self) -> None:
        self.seen.add(tuple(n for n, p in self.model.named_parameters() if not p.is_meta))

    def stop(self) -> float:
        return 1.0


def test_only_the_layer_being_timed_is_materialised() -> None:
    with torch.device("meta"):
        model = _llama()
    watcher = _Watcher(model)
    profile_model(model, torch.randint(0, hf_models.VOCAB, (2, 4)), clock=watcher, reuse=False, **FAST)
    prefixes = {tuple(sorted({n.rsplit(".", 1)[0].split(".self_attn")[0].split(".mlp")[0]
                              .split(".input_layernorm")[0].split(".post_attention_layernorm")[0] for n in names}))
                for names in watcher.seen}
    assert prefixes == {("model.embed_tokens",), ("model.layers.0",), ("model.layers.1",), ("model.layers.2",),
                        ("model.layers.3",), ("model.norm",), ("lm_head",)}
    assert all(p.is_meta for p in model.parameters())


def test_the_spread_is_the_relative_interquartile_range() -> None:
    assert spread([1.0, 1.0, 1.0, 1.0, 100.0]) == 0.0  # one stray repeat in five moves neither median nor spread
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4 - 2) / 3)
    assert spread([2.0]) == 0.0 and spread([0.0, 0.0, 0.0]) == 0.0


class _WalksItself(nn.Module):
    """A model whose ``_init_weights()`` initialises the whole model: not a per-module initialiser."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def _init_weights(self) -> None:
        nn.init.zeros_(self.fc.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_the_models_own_initialiser_is_used_only_when_it_takes_a_module() -> None:
    assert init_function(_WalksItself()) is None
    assert init_function(_gpt()) is not None and init_function(_seq()) is None
    with torch.device("meta"):
        model = _WalksItself()
    profile = profile_model(model, torch.randn(2, 4), **FAST)
    assert profile.layers[0].parameter_bytes == 80


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def test_a_failing_layer_leaves_the_meta_model_as_it_was() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), _Fails())
    with pytest.raises(RuntimeError, match=r"layer 2 \(_Fails.*boom"):
        profile_model(model, torch.randn(3, 4), **FAST)
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
