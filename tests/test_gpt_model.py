"""The example GPT: shapes, weight tying, deterministic init, fx tracing, and that it learns."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch.nn import functional as F

from pipedream_ft_examples.gpt import GPT, GPTConfig, gpt

pytestmark = pytest.mark.timeout(120)

SMALL = {"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16}


def test_logits_shape_and_tying() -> None:
    torch.manual_seed(0)
    model = gpt(**SMALL)
    assert isinstance(model, GPT) and model.config == GPTConfig(**SMALL)
    idx = torch.randint(0, 256, (3, 11))
    assert model(idx).shape == (3, 11, 256)
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # one parameter, first reached as wte
    assert sorted(k for k in model.state_dict() if "weight" in k and ("wte" in k or "lm_head" in k)) == [
        "lm_head.weight", "wte.weight"]


def test_init_is_deterministic_and_gpt2_style() -> None:
    torch.manual_seed(0)
    a = gpt(**SMALL)
    torch.manual_seed(0)
    b = gpt(**SMALL)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    big = gpt(n_layer=8, n_embd=256, n_head=4)
    assert big.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.h[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 0.02 / sqrt(2 * 8)
    assert torch.all(big.h[0].attn.c_attn.bias == 0) and torch.all(big.h[0].ln_1.weight == 1)


def test_causal() -> None:
    torch.manual_seed(0)
    model = gpt(**SMALL).eval()
    idx = torch.randint(0, 256, (1, 10))
    changed = idx.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 256
    a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_fx_trace_has_shape_arithmetic_and_matches() -> None:
    torch.manual_seed(0)
    model = gpt(**SMALL).eval()
    gm = torch.fx.symbolic_trace(model)
    kinds = {(n.op, getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes}
    assert {("call_method", "size"), ("call_function", "getitem"), ("call_function", "floordiv"),
            ("call_function", "arange"), ("call_method", "split"), ("call_method", "view")} <= kinds
    idx = torch.randint(0, 256, (2, 9))
    assert torch.equal(gm(idx), model(idx))


def test_loss_falls_on_random_data() -> None:
    torch.manual_seed(0)
    model = gpt(**SMALL)
    data = torch.randint(0, 16, (8, 17))  # a 16-symbol alphabet: the unigram distribution alone is learnable
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("bad,needle", [
    ({"n_embd": 30, "n_head": 4}, "multiple of n_head"),
    ({"n_layer": 0}, "n_layer must be a positive integer"),
    ({"dropout": 1.0}, "dropout"),
])
def test_bad_config(bad, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        gpt(**bad)
