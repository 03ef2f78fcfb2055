"""The training call's record in checkpoint parts (pipedream_ft.pipeline.record), without processes."""

from __future__ import annotations

import pytest

from pipedream_ft.pipeline.record import TrainRecord

pytestmark = pytest.mark.timeout(30)


def _part(losses: list[tuple[int, float]], start: int, stop: int, cut: int) -> dict:
    record = TrainRecord(lambda: losses)
    assert record.capture(cut) is None  # between calls: nothing to record
    record.begin(start, stop)
    return record.capture(cut)


def test_a_restored_call_is_continued_with_the_losses_before_the_cut():
    losses = [(b, 1.0 / (b + 1)) for b in range(30)]  # the last stage ran ahead of the cut
    part = _part(losses, 0, 48, 20)
    assert part["start"] == 0 and part["stop"] == 48 and part["minibatches"].tolist() == list(range(20))
    replacement = TrainRecord(lambda: [])
    replacement.restore(part)
    start, got = replacement.begin(20, 48)  # fit(48) from the restored cut
    assert start == 0 and got == losses[:20]  # bitwise: float64 holds a Python float exactly
    assert replacement.call == (0, 48)


@pytest.mark.parametrize("position, stop", [(20, 60), (8, 48)])
def test_another_call_starts_afresh(position, stop):
    """A call with another stop (train(data, n) for another n), or one from before the restored call's start,
    is not the restored call: it starts at its own position with no losses."""
    part = _part([(b, 0.5) for b in range(10, 20)], 10, 48, 20)
    record = TrainRecord(lambda: [])
    record.restore(part)
    assert record.begin(position, stop) == (position, [])


def test_the_end_of_a_call_and_a_reshard_forget_the_restored_record():
    part = _part([(0, 0.5)], 0, 8, 4)
    record = TrainRecord(lambda: [])
    record.restore(part)
    record.end()
    assert record.begin(4, 8) == (4, [])
    record.restore(part)
    record.reshard([part])  # another plan's parts: a new attempt's call
    assert record.begin(4, 8) == (4, [])
    record.restore(None)  # a part written before records existed
    assert record.begin(4, 8) == (4, [])


def test_a_replica_records_only_its_minibatches_and_only_of_this_call():
    losses = [(b, float(b)) for b in range(0, 40, 2)]  # replica 0 of a 2-replica last stage
    part = _part(losses, 16, 40, 24)
    assert part["minibatches"].tolist() == [16, 18, 20, 22]
    assert part["losses"].tolist() == [16.0, 18.0, 20.0, 22.0]
