"""The executor's entry point for one action: what it refuses before touching any state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipedream_ft.errors import PipelineSetupError
from pipedream_ft.pipeline.executor import Executor
from pipedream_ft.pipeline.hooks import Hooks
from pipedream_ft.schedules import parse_action

pytestmark = pytest.mark.timeout(60)


class _Recorder:
    """Stands in for the executor's action methods: records what :meth:`Executor.run` dispatched."""

    def __init__(self, ex: Executor) -> None:
        self.calls: list[str] = []
        ex.forward = lambda b, data: self.calls.append(f"F{b}:{data}")  # type: ignore[method-assign]
        ex.backward = lambda b: self.calls.append(f"B{b}")  # type: ignore[method-assign]
        ex.backward_input = lambda b: self.calls.append(f"I{b}")  # type: ignore[method-assign]
        ex.backward_weight = lambda b: self.calls.append(f"W{b}")  # type: ignore[method-assign]
        ex.update = lambda j: self.calls.append(f"U{j}")  # type: ignore[method-assign]
        for kind, name in (("RECV_F", "post_activation_recv"), ("SEND_F", "send_activations"),
                           ("RECV_B", "post_gradient_recv"), ("SEND_B", "send_input_grads")):
            setattr(ex, name, lambda b, kind=kind: self.calls.append(f"{kind}{b}"))


def _executor(stage: int) -> Executor:
    topo = SimpleNamespace(stage=stage, rank=5)
    return Executor(topo, SimpleNamespace(), SimpleNamespace(), connection=SimpleNamespace(),  # type: ignore[arg-type]
                    device=torch.device("cpu"), loss_fn=lambda o, t: o, seed=0, hooks=Hooks())


def test_run_dispatches_each_kind_of_its_own_stage() -> None:
    ex = _executor(2)
    rec = _Recorder(ex)
    for text in "2F0 2F1 2B0 2I1 2W1 2U0".split():
        ex.run(parse_action(text), "feed")  # type: ignore[arg-type]
    assert rec.calls == ["F0:feed", "F1:feed", "B0", "I1", "W1", "U0"]


def test_an_action_of_another_stage_is_refused_with_its_name() -> None:
    ex = _executor(2)
    rec = _Recorder(ex)
    with pytest.raises(PipelineSetupError, match="action 1F3 is for stage 1, but rank 5 runs stage 2"):
        ex.run(parse_action("1F3"), None)  # type: ignore[arg-type]
    assert rec.calls == []


def test_the_sends_and_receives_of_the_lowered_list_are_actions_of_their_own() -> None:
    ex = _executor(2)
    rec = _Recorder(ex)
    for text in "2RECV_F0 2F0 2SEND_F0 2RECV_B0 2B0 2SEND_B0".split():
        ex.run(parse_action(text), "feed")  # type: ignore[arg-type]
    assert rec.calls == ["RECV_F0", "F0:feed", "SEND_F0", "RECV_B0", "B0", "SEND_B0"]


@pytest.mark.parametrize("text, says", [("2SEND_F3", "SEND_F of minibatch 3 comes before anything to send or receive "
                                                     r"\(its forward did not run\)"),
                                        ("2SEND_B3", r"SEND_B of minibatch 3 .*\(its backward did not run\)"),
                                        ("2RECV_B3", r"RECV_B of minibatch 3 .*\(its forward did not run\)")])
def test_a_send_or_receive_out_of_order_is_refused_naming_it(text: str, says: str) -> None:
    ex = _executor(2)
    with pytest.raises(PipelineSetupError, match=f"stage 2: {says}: the lowered schedule is out of order"):
        ex.run(parse_action(text), None)  # type: ignore[arg-type]


def test_a_hook_list_calls_each_hook_that_does_something_for_an_action_in_order() -> None:
    from pipedream_ft.pipeline.hooks import HookList

    calls: list[str] = []

    class Actions(Hooks):
        def on_action(self, action) -> None:  # type: ignore[no-untyped-def]
            calls.append(f"action {action}")

    class Updates(Hooks):
        def on_update(self, round_: int, done: int, start: float, end: float) -> None:
            calls.append(f"update {round_}")

        def on_train_end(self, start: int, stop: int) -> None:
            calls.append("end")

    hooks = HookList([Actions(), Hooks(), Updates()])
    hooks.add(Actions())
    hooks.on_action(parse_action("1F2"))
    hooks.on_update(3, 4, 0.0, 1.0)
    hooks.on_forward(2, 0.0, 1.0)
    hooks.on_train_end(0, 4)
    assert calls == ["action 1F2", "action 1F2", "update 3", "end"]
    assert len(hooks.hooks) == 4
