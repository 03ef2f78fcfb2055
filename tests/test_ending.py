"""The end of a ``fit`` under in-place recovery: each wait gives way to a peer's failure, and the group settles,
once for every rank, whether rank 0 finished or everybody recovers (here over a real TCPStore, the ranks as
threads)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from dist_helpers import free_port
from pipedream_ft.ft.ending import FINISHED, RECOVER, Ending, keys_set
from pipedream_ft.pipeline.group import GroupError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    yield master
    del master


def settler(store: dist.Store, position: int = 48):
    return lambda proposal: store.compare_set(f"finished/{position}", "", proposal).decode()


def test_a_wait_ends_when_its_step_is_done_or_its_time_is_up(store):
    calls: list[float] = []
    ending = Ending(48, None, settler(store))
    assert ending.wait(lambda s: (calls.append(s), len(calls) == 3)[1], 5.0)
    assert len(calls) == 3
    t0 = time.monotonic()
    assert not ending.wait(keys_set(store, ["never"]), 0.3)
    assert 0.3 <= time.monotonic() - t0 < 10.0  # it returns once its time is up (not a timing bound)


def test_without_in_place_recovery_a_wait_is_not_cut_into_slices(store):
    asked: list[float] = []
    Ending(48, None, settler(store)).wait(lambda s: (asked.append(s), True)[1], 30.0)
    assert asked[0] > 25  # one wait, as long as the timeout: nothing to look at between slices


def test_a_peer_failure_settles_the_end_as_recover_and_every_rank_raises(store):
    failed = threading.Event()
    errors: list[str] = []

    def rank(name: str) -> None:
        ending = Ending(48, failed.is_set, settler(store), slice_s=0.02)
        try:
            ending.wait(keys_set(store, ["ckpt-finish/48/part/1"]), 20.0)
        except GroupError as exc:
            errors.append(f"{name}: {exc}")

    threads = [threading.Thread(target=rank, args=(n,)) for n in ("rank 0", "rank 2")]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert errors == []
    failed.set()  # rank 1 died before it reported its part
    for t in threads:
        t.join(10)
    assert sorted(errors) == ["rank 0: a peer failed while checkpoint 48 was being finished",
                              "rank 2: a peer failed while checkpoint 48 was being finished"]
    assert store.get("finished/48").decode() == RECOVER
    with pytest.raises(GroupError, match="checkpoint 48"):  # rank 0 cannot finish what the group gave up
        Ending(48, None, settler(store)).finish()


def test_once_rank_0_finished_a_later_failure_is_not_this_ends_to_recover_from(store):
    Ending(48, None, settler(store)).finish()
    failed = [0]

    def failed_now() -> bool:
        failed[0] += 1
        return True

    ending = Ending(48, failed_now, settler(store), slice_s=0.01)
    done = iter([False, False, True])
    assert ending.wait(lambda s: next(done), 5.0)
    assert failed[0] == 1  # asked once: settled as finished, failures are no longer looked at
    assert store.get("finished/48").decode() == FINISHED


def test_a_slice_must_be_positive(store):
    with pytest.raises(ValueError, match="slice_s must be positive, got 0"):
        Ending(48, None, settler(store), slice_s=0)
