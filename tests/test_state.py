"""StageState: a captured part restores the stage exactly, whatever the stage did after the cut."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipedream_ft.pipeline.state import StageState


def _state(keep: int = 1) -> StageState:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    return StageState(module, lambda ps: torch.optim.Adam(ps, lr=0.1), stage=1, replica=0, keep=keep)


def _train_step(state: StageState, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=g)
    state.module(x).square().sum().backward()
    assert state.optimizer is not None
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.versions.publish()


def test_restore_brings_back_weights_optimizer_versions_and_position() -> None:
    state = _state()
    for i in range(3):
        _train_step(state, i)
    part = copy.deepcopy(state.capture(cut=3))
    expected = {k: v.clone() for k, v in state.module.state_dict().items()}
    for i in range(3, 6):
        _train_step(state, i)
    state.restore(part)
    assert state.position == 3 and state.versions.current.updates == 3
    for k, v in state.module.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert sorted(state.versions.history) == [2]


def test_a_rollback_drops_gradients_of_a_backward_whose_update_never_came() -> None:
    """A peer failed after this stage's backward had accumulated a gradient but before its update: the redone
    minibatch must start from no gradient, or the restored stage trains differently from an uninterrupted one."""
    reference, rolled_back = _state(), _state()
    for st in (reference, rolled_back):
        _train_step(st, 0)
    part = copy.deepcopy(rolled_back.capture(cut=1))
    rolled_back.module(torch.ones(5, 4)).sum().backward()  # the backward of the minibatch being lost
    assert all(p.grad is not None for p in rolled_back.module.parameters())
    rolled_back.restore(part)
    assert all(p.grad is None for p in rolled_back.module.parameters())
    _train_step(reference, 1)
    _train_step(rolled_back, 1)
    for (k, a), b in zip(reference.module.state_dict().items(), rolled_back.module.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_stage_without_parameters_has_no_optimizer_and_round_trips() -> None:
    called = []
    state = StageState(nn.Sequential(nn.ReLU(), nn.MaxPool1d(2)), lambda ps: called.append(ps) or None,
                       stage=2, replica=0, keep=0)
    assert state.optimizer is None and called == []
    part = state.capture(cut=4)
    state.restore(part)
    assert state.position == 4


def test_a_store_that_keeps_no_older_version_aliases_the_live_weights_until_an_offset():
    import pytest as _pytest

    from pipedream_ft.pipeline.versions import VersionStore

    w = torch.nn.Parameter(torch.ones(3))
    store = VersionStore([w], alias=True)
    assert store.live and store.current.tensors[0] is w
    with torch.no_grad():
        w.add_(1.0)
    assert store.publish().tensors[0] is w and store.current.updates == 1 and not store.history
    store.offset = [torch.full((3,), 0.5)]
    predicted = store.publish()  # weight prediction: a copy with the offset, never the live weights
    assert predicted.tensors[0] is not w and torch.equal(predicted.tensors[0], torch.full((3,), 2.5))
    assert not store.live and store.saved() == {2: predicted}
    assert store.publish().tensors[0] is w and store.live
    with _pytest.raises(ValueError, match="a version store that keeps 1 older versions cannot alias the live"):
        VersionStore([w], keep=1, alias=True)
    copied = VersionStore([w])
    assert copied.current.tensors[0] is not w and not copied.live
