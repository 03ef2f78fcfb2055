"""CommGroup's construction (pipedream_ft.pipeline.group): a recovery's groups stop connecting as soon as the
epoch fails, instead of waiting out the timeout for a peer that will never come; a connection that fails is a
GroupError (the recovery forms the next epoch), not the backend's raw error."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pipedream_ft.pipeline.group import CommGroup, GroupError

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def store():
    host = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=90), wait_for_workers=False)
    yield dist.PrefixStore("epoch/", host)


def test_connecting_stops_as_soon_as_the_epoch_fails(store):
    failed_at = time.monotonic() + 0.3  # rank 1 never comes: the epoch fails meanwhile
    t0 = time.monotonic()
    with pytest.raises(GroupError, match="the epoch failed while its process groups were being connected"):
        CommGroup(store, rank=0, world_size=2, backend="gloo", device=torch.device("cpu"), timeout_s=60,
                  cancelled=lambda: time.monotonic() > failed_at)
    assert time.monotonic() - t0 < 30  # far less than the 60 s the connection would have waited


def test_a_connection_that_fails_is_a_group_error(store):
    with pytest.raises(GroupError, match="cannot connect the process groups"):
        CommGroup(store, rank=0, world_size=2, backend="gloo", device=torch.device("cpu"), timeout_s=1,
                  cancelled=lambda: False)


def test_connecting_in_a_thread_builds_the_same_group(store):
    group = CommGroup(store, rank=0, world_size=1, backend="gloo", device=torch.device("cpu"), timeout_s=10,
                      cancelled=lambda: False)
    try:
        assert group.all_gather_object({"a": 1}) == [{"a": 1}]
    finally:
        group.close()


def _build_and_close_at_once(rounds: int) -> int:
    import os

    rank = int(os.environ["RANK"])
    host = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0, timeout=timedelta(seconds=30))
    for i in range(rounds):
        group = CommGroup(dist.PrefixStore(f"epoch-{i}/", host), rank=rank, world_size=2, backend="gloo",
                          device=torch.device("cpu"), timeout_s=30)
        group.close()  # nothing to send: a rank that is done closes at once
    if rank == 0:  # the host's store outlives rank 1's last use of it
        host.set("closed-0", "1")
        host.wait(["closed-1"])
    else:
        host.wait(["closed-0"])
        host.set("closed-1", "1")
    return rounds


def test_a_rank_that_closes_at_once_does_not_cut_off_a_peer_still_connecting():
    """Gloo's mesh handshake lets one side of a pair return first; were it to close its groups at once (a run that
    sends nothing), the other side could fail mid-handshake with "Connection closed by peer". Without the barrier
    that ends the construction, this failed in 2 of 80 fresh worlds beside a CPU hog (in the first round of a
    world: the ranks fall into step after it), so it runs many short worlds."""
    from dist_helpers import run_world

    for _ in range(24):
        assert run_world(_build_and_close_at_once, 2, 2, timeout=60) == {0: (True, 2), 1: (True, 2)}


def _replica_flags(on_host: bool | None, flags: list[int]) -> tuple[bool, int | None]:
    import os

    rank = int(os.environ["RANK"])
    host = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0, timeout=timedelta(seconds=30))
    group = CommGroup(dist.PrefixStore("epoch/", host), rank=rank, world_size=2, backend="gloo",
                      device=torch.device("cpu"), timeout_s=30, replica_ranks=[0, 1], flags_on_host=on_host)
    try:
        started = group.replica_flags(flags[rank])
        if started is None:
            return group.flags_on_host, None
        work, summed = started
        assert work.wait() is not False and summed.device.type == "cpu"
        return group.flags_on_host, int(summed[0])
    finally:
        group.close()


def test_replicas_sum_their_cut_flags_on_the_host_only_where_asked_or_under_a_device_backend():
    """Under gloo the flags travel with the gradients' all-reduce (nothing on the host); asked to (as under NCCL by
    default), the replicas sum them over a gloo group of their own."""
    from dist_helpers import run_world

    assert run_world(_replica_flags, 2, None, [4, 0], timeout=60) == {0: (True, (False, None)),
                                                                        1: (True, (False, None))}
    assert run_world(_replica_flags, 2, True, [0, 6], timeout=60) == {0: (True, (True, 6)), 1: (True, (True, 6))}
