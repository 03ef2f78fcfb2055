"""The runtime against single-process references, on real gloo processes."""


import pytest
import torch

from dist_helpers import run_world
from pipedream_reference import minibatch_sgd_reference, weight_stashing_reference
from runtime_cases import (OPTIMIZERS, MODELS, bad_input_case, data, plain_training, plan_for, replicated_case,
                           stuck_peer_case, train_case)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

loss_fn = torch.nn.functional.cross_entropy


def assert_states_close(got, want, atol):
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=k)


def test_one_stage_is_plain_pytorch_bit_for_bit():
    out = run_world(train_case, 1, "mlp", [list(range(9))], None, "sgd", 10)
    want = plain_training(10)
    got = out[0][1]
    assert got["losses"] == want["losses"]
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), k


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_weight_stashing_matches_pipedream_semantics(opt):
    stages = [[0, 1], [2, 3], [4, 5], [6, 7, 8]]
    out = run_world(train_case, 4, "mlp", stages, None, opt, 16)
    model = MODELS["mlp"]()
    want, losses = weight_stashing_reference(model, plan_for(model, stages), data, loss_fn, OPTIMIZERS[opt], 16)
    for rank in range(4):
        assert_states_close(out[rank][1]["state"], want, atol=1e-6)
        assert out[rank][1]["losses"] == pytest.approx(losses, abs=1e-6)
    # stage s holds at most S - s weight versions (its stash plus the current one)
    assert [out[r][1]["stats"].peak_stash_versions for r in range(4)] == [4, 3, 2, 1]


def test_weight_stashing_with_a_skip_connection_across_stages():
    model = MODELS["skip"]()
    stages = [[0, 1], [2, 3, 4, 5], [6, 7]]
    out = run_world(train_case, 3, "skip", stages, None, "sgd", 12)
    want, _ = weight_stashing_reference(model, plan_for(model, stages), data, loss_fn, OPTIMIZERS["sgd"], 12)
    assert_states_close(out[0][1]["state"], want, atol=1e-6)


def test_vertical_sync_matches_reference():
    stages = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    out = run_world(train_case, 3, "mlp", stages, None, "sgd", 12, "vertical")
    model = MODELS["mlp"]()
    want, _ = weight_stashing_reference(model, plan_for(model, stages), data, loss_fn, OPTIMIZERS["sgd"], 12,
                                        vertical=True)
    assert_states_close(out[0][1]["state"], want, atol=1e-6)


def test_flushing_mode_is_minibatch_sgd():
    stages = [[0, 1, 2, 3], [4, 5, 6, 7, 8]]
    out = run_world(train_case, 2, "mlp", stages, None, "adam", 12, "flush", 4)
    want, losses = minibatch_sgd_reference(MODELS["mlp"](), data, loss_fn, OPTIMIZERS["adam"], 12, 4)
    assert_states_close(out[0][1]["state"], want, atol=1e-6)
    assert out[0][1]["losses"] == pytest.approx(losses, abs=1e-6)


def test_replicated_stage_trains():
    out = run_world(replicated_case, 4, 48)
    losses = out[0][1]
    assert len(losses) == 48
    assert sum(losses[-8:]) / 8 < 0.5 * sum(losses[:8]) / 8


@pytest.mark.parametrize("kind, message", [
    ("world", "plan needs 2 workers, but the world size is 3"),
    ("model", "plan was made for another model"),
    ("shapes", "stage 2 .* cannot run on its input \\[float32\\[6, 24\\]\\]"),
])
def test_bad_input_stops_every_rank_with_one_message(kind, message):
    out = run_world(bad_input_case, 3, kind, expect_failure=True, timeout=90)
    msgs = {out[r][1][1] for r in range(3)}
    assert all(not out[r][0] for r in range(3))
    assert len(msgs) == 1, msgs
    import re
    assert re.search(message, msgs.pop())


def test_stuck_peer_fails_the_others_within_the_timeout():
    """Rank 1 stops for 15 s after the pre-flight: the others give up on it after their 4 s timeout (the wait
    each reports, measured inside the process: spawning and importing under load do not count), long before
    it would have come back."""
    import re

    out = run_world(stuck_peer_case, 3, 1, expect_failure=True, timeout=90)
    for rank in (0, 2):
        ok, (etype, msg, _) = out[rank]
        assert not ok and etype == "PeerTimeoutError", msg
        assert "rank 1" in msg
        waited = re.search(r"after ([0-9.]+)s", msg)
        assert waited and 3.5 <= float(waited.group(1)) < 10, msg
