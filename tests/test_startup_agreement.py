"""Every rank agrees on the plan, model, mode and data contract before the first minibatch
(pipedream_ft/ft/agreement.py): the pure comparison, and real gloo ranks given different plans."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from dist_helpers import run_world
from partitioner.plan import Plan
from pipedream_ft.errors import EXIT_SETUP
from pipedream_ft.ft.agreement import (AGREED, AgreementError, Fact, agree, data_fact, disagreement, mode_fact,
                                       model_fact, plan_fact)
from runtime_cases import data, mlp, plan_for, timed_profile

pytestmark = pytest.mark.timeout(120)


def _facts(**changed: Fact) -> dict[str, Fact]:
    model = mlp()
    base = {"plan": plan_fact(plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]])),
            "model": model_fact([str(i) for i in range(9)], model),
            "mode": mode_fact({"mode": "stash", "update_every": None}),
            "data": data_fact(seed=0, checkpoint_url=None)}
    return {**base, **changed}


def test_equal_facts_agree():
    assert disagreement({0: _facts(), 1: _facts(), 2: _facts()}) is None


def test_a_plan_cut_elsewhere_is_named_with_its_holders():
    other = plan_fact(plan_for(mlp(), [[0, 1, 2], [3, 4, 5, 6, 7, 8]]))
    mine = _facts()["plan"]
    line = disagreement({0: _facts(), 1: _facts(plan=other), 2: _facts()})
    assert line == (f"ranks disagree on the plan: ranks 0,2 hold {mine.digest[:8]} (layers 0-3 | 4-8), "
                    f"rank 1 holds {other.digest[:8]} (layers 0-2 | 3-8); every rank must load the same plan file "
                    "(profile and partition once, outside torchrun)")
    assert "\n" not in line


def test_the_first_difference_in_order_is_reported():
    line = disagreement({0: _facts(), 1: _facts(mode=mode_fact({"mode": "vertical", "update_every": None}),
                                               data=data_fact(seed=1, checkpoint_url=None))})
    assert line is not None and line.startswith("ranks disagree on the mode and schedule: rank 0 holds ")
    assert "(mode stash)" in line and "(mode vertical)" in line
    assert AGREED.index("mode") < AGREED.index("data")


def test_predicted_times_are_not_part_of_the_plan():
    """Two profiles of one model never share their times: plans that cut alike agree."""
    plan = plan_for(mlp(), [[0, 1, 2, 3], [4, 5, 6, 7, 8]])
    timed = replace(plan, time_per_minibatch_s=1.5, stages=tuple(replace(s, time_s=0.7) for s in plan.stages))
    assert plan_fact(plan) == plan_fact(timed)
    assert plan_fact(plan) != plan_fact(plan_for(mlp(), [[0, 1, 2, 3], [4, 5, 6, 7, 8]], [2, 1]))


def test_the_model_fact_sees_shapes_and_dtypes_not_values():
    names = [str(i) for i in range(9)]
    a, b = mlp(), mlp()
    with torch.no_grad():
        b[0].weight.add_(1.0)
    assert model_fact(names, a) == model_fact(names, b)
    assert model_fact(names, a) != model_fact(names, mlp().double())
    wider = nn.Sequential(*list(mlp())[:-1], nn.Linear(24, 6))
    assert model_fact(names, a) != model_fact(names, wider)
    assert model_fact(names, a).summary == f"9 layers, {sum(p.numel() for p in a.parameters()):,} parameters"


def test_facts_must_name_everything():
    facts = _facts()
    del facts["data"]
    with pytest.raises(ValueError, match="missing data"):
        agree(None, rank=0, world_size=2, facts=facts, timeout_s=1)  # type: ignore[arg-type]


def _store_case(cut: int) -> str | None:
    """A rank's side of :func:`agree` over a real TCPStore (rank 1 holds a plan cut at ``cut``)."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    facts = _facts(plan=plan_fact(plan_for(mlp(), [list(range(cut)), list(range(cut, 9))]))) if rank == 1 \
        else _facts()
    try:
        agree(store, rank=rank, world_size=2, facts=facts, timeout_s=60)
    except AgreementError as exc:
        return str(exc)
    store.set(f"bye/{rank}", "1")  # ranks that agree go on together (here: the store's host leaves last)
    if rank == 0:
        store.wait(["bye/0", "bye/1"], timedelta(seconds=60))
    return None


def test_agree_over_a_store_raises_the_same_line_on_every_rank():
    out = run_world(_store_case, 2, 3)
    assert out[0][1] == out[1][1] and out[0][1].startswith("ranks disagree on the plan: rank 0 holds ")
    agreed = run_world(_store_case, 2, 4)
    assert agreed[0][1] is None and agreed[1][1] is None


def _train_case(stage_layers_by_rank: dict[int, list[list[int]]] | None, noisy: bool) -> None:
    """Build a trainer (rank 1 with another plan, or every rank partitioning its own noisy profile) and train:
    run as a script would, under :func:`pipedream_ft.exit_on_error`."""
    import os

    from pipedream_ft import PipelineConfig, PipelineTrainer, exit_on_error

    rank = int(os.environ["RANK"])

    def body() -> None:
        model = mlp()
        if noisy:  # the README's invitation: profile on every rank, then partition
            from partitioner.optimizer import partition

            prof = timed_profile(model)
            slow = 0 if rank == 0 else 8  # rank 0 measured its first layer slow, rank 1 its last
            prof = replace(prof, layers=tuple(replace(l, forward_ms=l.forward_ms * (30 if i == slow else 1))
                                              for i, l in enumerate(prof.layers)))
            plan: Plan = partition(prof, [2], [1e9], straight=True)
        else:
            assert stage_layers_by_rank is not None
            plan = plan_for(model, stage_layers_by_rank[rank])
        trainer = PipelineTrainer(model, plan, loss_fn=nn.functional.cross_entropy,
                                  optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.05),
                                  config=PipelineConfig(timeout_s=60, progress=False, summary=False))
        trainer.train(data, 4)
        trainer.close()

    exit_on_error(body)


@pytest.mark.slow
@pytest.mark.parametrize("noisy", [False, True], ids=["another plan file", "profiled on every rank"])
def test_ranks_with_different_plans_stop_with_one_line(noisy, capfd):
    cuts = {0: [[0, 1, 2, 3], [4, 5, 6, 7, 8]], 1: [[0, 1, 2], [3, 4, 5, 6, 7, 8]]}
    out = run_world(_train_case, 2, None if noisy else cuts, noisy, expect_failure=True, timeout=100)
    assert {r: (ok, payload[:2]) for r, (ok, payload) in out.items()} == \
        {0: (False, ("SystemExit", str(EXIT_SETUP))), 1: (False, ("SystemExit", str(EXIT_SETUP)))}
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "ranks disagree" in line]
    assert lines, err
    assert len(set(lines)) == 1, lines
    assert lines[0].startswith("pipedream-ft: error: ranks disagree on the plan: rank 0 holds ")
    assert "rank 1 holds" in lines[0] and "every rank must load the same plan file" in lines[0]
    if not noisy:
        assert "(layers 0-3 | 4-8)" in lines[0] and "(layers 0-2 | 3-8)" in lines[0]
