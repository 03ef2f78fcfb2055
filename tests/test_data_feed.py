"""Data sources: callables, DataLoaders, StatefulDataLoader and stateful iterables, read once by stage 0, the
targets sent to the last stage, exact resume from checkpoints, and the refusals (one line on every rank)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from dist_helpers import run_world
from feature_cases import BATCH, ToyData, bad_case, batch_of, feature_case, files_under, make_source
from pipedream_ft import Epochs
from pipedream_ft.errors import PipelineSetupError
from pipedream_ft.pipeline.data import pack_targets, source_problem, unpack_targets
from pipedream_ft.pipeline.sources import resume_problem

pytestmark = [pytest.mark.timeout(300)]

MLP3 = [[0, 1, 2, 3], [4, 5, 6], [7, 8]]


def assert_bitwise(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


# -- single process ----------------------------------------------------------------------------------------


def _stream_and_states(source, count):
    it = iter(source)
    seq, states = [], []
    for _ in range(count):
        seq.append(next(it)[1].tolist())
        states.append(copy.deepcopy(source.state_dict()))
    return seq, states


@pytest.mark.parametrize("inner", ["loader", "sdl"])
def test_epochs_resumes_exactly_across_epoch_boundaries(inner):
    def fresh():
        ds = ToyData(27)  # 5 minibatches per epoch, the last one partial
        if inner == "loader":
            loader = DataLoader(ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3))
        else:
            from torchdata.stateful_dataloader import StatefulDataLoader

            torch.manual_seed(3)
            loader = StatefulDataLoader(ds, batch_size=BATCH, shuffle=True)
        return Epochs(loader, 3)

    first = fresh()
    assert len(first) == 15
    seq, states = _stream_and_states(first, 15)
    assert seq[:5] != seq[5:10]  # every epoch reshuffles
    for k in range(15):
        again = fresh()
        torch.manual_seed(1234)  # the global generator must not matter
        again.load_state_dict(states[k])
        assert [b[1].tolist() for b in again] == seq[k + 1:], k


def test_resume_problems_name_the_fix():
    ds = ToyData(12)
    assert resume_problem(DataLoader(ds, batch_size=3)) is None
    assert resume_problem(DataLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator())) is None
    assert resume_problem([(torch.zeros(1), torch.zeros(1))]) is None
    assert resume_problem(make_source("sdl", 12)[0]) is None
    line = resume_problem(DataLoader(ds, batch_size=3, shuffle=True))
    assert "generator=" in line and "StatefulDataLoader" in line and "\n" not in line
    assert "cannot be resumed exactly" in resume_problem(x for x in range(3))
    assert resume_problem(Epochs(DataLoader(ds, shuffle=True), 2)) is not None

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert "IterableDataset" in resume_problem(DataLoader(Stream()))
    assert source_problem(DataLoader(ds, batch_size=3), start=0, stop=4, checkpointing=True) is None
    short = source_problem(DataLoader(ds, batch_size=3), start=2, stop=6, checkpointing=False)
    assert "has 4 minibatches" in short and "2..5 (6 in all)" in short and "Epochs" in short


@pytest.mark.parametrize("targets", [
    torch.arange(6),
    (torch.arange(6), torch.ones(2, 3, dtype=torch.bfloat16)),
    {"labels": torch.arange(4), "mask": [torch.zeros(4, dtype=torch.bool)]},
])
def test_targets_travel_with_their_structure(targets):
    got = unpack_targets(pack_targets(targets, torch.device("cpu")))
    flat_got, spec_got = torch.utils._pytree.tree_flatten(got)
    flat_want, spec_want = torch.utils._pytree.tree_flatten(targets)
    assert spec_got == spec_want
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(flat_got, flat_want))


def test_targets_must_be_tensors():
    with pytest.raises(PipelineSetupError, match="targets must be tensors.*str"):
        pack_targets(("cat", torch.zeros(1)), torch.device("cpu"))


# -- real processes ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_dataloader_trains_like_the_callable_and_stage_0_reads_each_minibatch_once():
    base = {"stages": MLP3, "total": 12, "n": 600}
    loader = run_world(feature_case, 3, {**base, "source": "loader"})
    call = run_world(feature_case, 3, {**base, "source": "callable"})
    assert_bitwise(loader[0][1]["state"], call[0][1]["state"])
    assert loader[0][1]["losses"] == call[0][1]["losses"]
    # stage 0 read minibatches 0..11 once each (the pre-flight's read is minibatch 0's); later stages never read
    assert [loader[r][1]["reads"] for r in range(3)] == [12 * BATCH, 0, 0]


@pytest.mark.slow
def test_replicated_stage_0_reads_the_whole_stream_and_keeps_its_own_minibatches():
    base = {"stages": MLP3, "replicas": [2, 1, 1], "total": 12, "opt": "adam"}
    loader = run_world(feature_case, 4, {**base, "source": "loader"})
    call = run_world(feature_case, 4, {**base, "source": "callable"})
    assert_bitwise(loader[0][1]["state"], call[0][1]["state"])
    # each replica reads the stream up to its own last minibatch: replica 0 up to 10, replica 1 up to 11
    assert [loader[r][1]["reads"] for r in range(4)] == [11 * BATCH, 12 * BATCH, 0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("source, extra", [
    ("sdl", {"stages": MLP3, "sched": "step"}),
    ("epochs", {"stages": [[0, 1, 2, 3], [4, 5, 6, 7, 8]], "replicas": [2, 1], "n": 60, "epochs": 3}),
])
def test_a_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, source, extra):
    """The interrupted run goes past its last checkpoint (8) with stage 0 reading ahead, and dies at 14;
    the resumed run loads the source state after exactly 8 reads — into a loader seeded differently, so only
    the saved state can give the same order. Epochs: 10 minibatches per epoch, so the resumed run crosses two
    epoch boundaries."""
    world = sum(extra.get("replicas") or [1] * len(extra["stages"]))
    spec = {"source": source, "total": 24, "every": 8, **extra}
    run_world(feature_case, world, {**spec, "url": str(tmp_path / "a"), "stop_at": 14})
    resumed = run_world(feature_case, world, {**spec, "url": str(tmp_path / "a"), "shuffle_seed": 99})[0][1]
    straight = run_world(feature_case, world, {**spec, "url": str(tmp_path / "b")})[0][1]
    assert resumed["resumed"] == 8 and straight["resumed"] is None
    # StatefulDataLoader continues from its state; Epochs replays the current epoch's first 8 minibatches
    assert resumed["reads"] == (16 if source == "sdl" else 24) * BATCH
    assert_bitwise(resumed["state"], straight["state"])
    assert resumed["losses"] == straight["losses"][8:]
    assert resumed["lr"] == straight["lr"]


def _messages(out: dict) -> set[str]:
    assert all(not ok for ok, _ in out.values()), out
    return {payload[1] for _, payload in out.values()}


@pytest.mark.slow
@pytest.mark.parametrize("kind, pattern", [
    ("short", r"data source DataLoader has 6 minibatches, but training asks for minibatches 0\.\.7 \(8 in all\)"),
    ("random_nogen", r"RandomSampler drawing from the global random generator.*pass generator=.*StatefulDataLoader"),
    ("generator", r"data source generator cannot be resumed exactly"),
])
def test_bad_sources_stop_every_rank_with_one_line_before_training(tmp_path, kind, pattern):
    url = tmp_path / "ckpt"
    out = run_world(bad_case, 2, kind, str(url), expect_failure=True, timeout=90)
    msgs = _messages(out)
    assert len(msgs) == 1, msgs
    msg = msgs.pop()
    assert re.search(pattern, msg) and "\n" not in msg, msg
    assert {payload[0] for _, payload in out.values()} == {"PipelineSetupError"}
    assert not [f for f in files_under(str(url)) if f[0].isdigit()], files_under(str(url))  # no checkpoint


def test_batches_must_be_pairs():
    from pipedream_ft.pipeline.data import _split

    with pytest.raises(PipelineSetupError, match="minibatch 3 of data source X is a dict"):
        _split({"x": 1}, 3, "X")
    assert _split(batch_of(ToyData(4), [0, 1]), 0, "X")[0].shape == (2, 12)


def test_dict_minibatches_bind_to_the_model_inputs_by_name():
    from pipedream_ft.pipeline.data import bind_inputs, split_batch

    ids, mask, labels = torch.ones(2, 3), torch.zeros(2, 3), torch.full((2, 3), 7)
    inputs, targets = split_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, 0, "DataLoader")
    assert targets is labels
    assert bind_inputs(inputs, ["input_ids", "attention_mask"]) == [ids, mask]  # the model's order, not the dict's
    assert bind_inputs((ids, mask), ["a", "b"]) == [ids, mask] and bind_inputs(ids, ["a"]) == [ids]
    with pytest.raises(PipelineSetupError, match=r"takes inputs \['input_ids'\], but the minibatch's dict has "
                                                 r"\['attention_mask'\] besides"):
        bind_inputs(inputs, ["input_ids"])
    with pytest.raises(PipelineSetupError, match=r"lacks \['position_ids'\]$"):
        bind_inputs(inputs, ["input_ids", "attention_mask", "position_ids"])
    with pytest.raises(PipelineSetupError, match="takes 2 inputs \\['a', 'b'\\], but the data gives 1"):
        bind_inputs(ids, ["a", "b"])
