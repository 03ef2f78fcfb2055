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

pytestmark = pytest.mark.timeout(60)


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
