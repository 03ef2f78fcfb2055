"""Connection (pipedream_ft.pipeline.connection): one handle per rank that each epoch re-configures, so the
components that talk hold it once instead of being handed every new group; between epochs it says so."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pipedream_ft.pipeline.connection import Connection, NotConnectedError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def host():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)


def _connection(**kw) -> Connection:
    return Connection(rank=0, world_size=1, backend="gloo", device=torch.device("cpu"), timeout_s=10, **kw)


def test_each_epoch_configures_the_same_handle_and_its_holders_see_the_new_groups(host) -> None:
    conn = _connection()

    class Holder:  # what the executor, stepper, feed, tied weights and checkpointer do
        def gather(self, x):
            return conn.group.all_gather_object(x)

    holder = Holder()
    conn.configure(dist.PrefixStore("epoch-1/", host))
    first = conn.group
    assert conn.configured and conn.epochs == 1 and conn.messenger.group is first
    assert holder.gather({"epoch": 1}) == [{"epoch": 1}]
    conn.flush()
    conn.release()
    assert not conn.configured
    conn.flush()  # nothing to flush between epochs
    conn.release()  # idempotent
    conn.configure(dist.PrefixStore("epoch-2/", host), cancelled=lambda: False)
    assert conn.epochs == 2 and conn.group is not first
    assert holder.gather({"epoch": 2}) == [{"epoch": 2}]
    conn.release()


def test_between_epochs_asking_for_the_group_names_the_state(host) -> None:
    conn = _connection()
    with pytest.raises(NotConnectedError, match="rank 0 has no process group: its connection is not configured yet"):
        conn.messenger
    conn.configure(dist.PrefixStore("e/", host))
    with pytest.raises(RuntimeError, match="configure\\(\\) while epoch 1's groups are still held"):
        conn.configure(dist.PrefixStore("f/", host))
    conn.release()
    with pytest.raises(NotConnectedError, match="released after epoch 1"):
        conn.group


def test_links_are_asked_for_at_each_configure_and_only_nccl_opens_them(host) -> None:
    asked: list[int] = []
    conn = _connection(links=lambda: asked.append(1) or [(1, "act")], replica_ranks=[0])
    assert conn.replica_ranks is None  # a stage of one replica has no all-reduce group
    conn.configure(dist.PrefixStore("g/", host))
    assert asked == [] and conn.group.replica is None  # gloo: no per-link communicators
    conn.release()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        Connection(rank=0, world_size=1, backend="mpi", device=torch.device("cpu"), timeout_s=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 3"):
        Connection(rank=3, world_size=2, backend="gloo", device=torch.device("cpu"), timeout_s=1)


def test_the_backend_defaults_to_nccl_with_cuda_and_names_what_is_missing() -> None:
    from pipedream_ft.errors import PipelineSetupError
    from pipedream_ft.pipeline.connection import backend_and_device

    if not torch.cuda.is_available():
        assert backend_and_device(0, None) == ("gloo", torch.device("cpu"))
        with pytest.raises(PipelineSetupError,
                           match="backend 'nccl' needs CUDA, but torch.cuda.is_available\\(\\) is False"):
            backend_and_device(0, "nccl")
    else:
        assert backend_and_device(0, None) == ("nccl", torch.device("cuda", 0))
        count = torch.cuda.device_count()
        with pytest.raises(PipelineSetupError, match=f"LOCAL_RANK {count} has no GPU \\({count} visible\\)"):
            backend_and_device(count, "nccl")
    assert backend_and_device(0, "gloo") == ("gloo", torch.device("cpu"))
