"""Messages between stages (pipedream_ft.pipeline.comm): a link's first activation teaches the receiver its shapes;
later small ones travel with their header as one message (Packing), large ones as a header and one message per
tensor; every dtype and shape arrives as sent, on 2 real gloo processes."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from dist_helpers import run_world
from pipedream_ft.pipeline.comm import PACK_LIMIT, Header, Packing, ShapeMismatchError, TensorSpec

pytestmark = pytest.mark.timeout(120)


def _values(b: int, big: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    rows = 1 + PACK_LIMIT // 256 if big else 3  # big: a float32 tensor of more than PACK_LIMIT bytes
    return [torch.randn(rows, 64, generator=g), torch.randn(5, generator=g).half(), torch.tensor(float(b)),
            torch.arange(b, b + 3) > b, torch.randint(0, 9, (2, 2), generator=g), torch.zeros(0, 4)]


def _exchange(big: bool) -> list[tuple[str, int]]:
    """Rank 0 sends minibatches -1 (the pre-flight's, unpacked) and 0..5 to rank 1; rank 1 checks each and returns
    what it was sent as: ("packed" | "separate", minibatch); rank 0 then refuses to send other shapes."""
    import os

    import torch.distributed as dist

    from pipedream_ft.pipeline.comm import Messenger
    from pipedream_ft.pipeline.group import CommGroup

    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0, timeout=timedelta(seconds=60))
    group = CommGroup(store, rank=rank, world_size=2, backend="gloo", device=torch.device("cpu"), timeout_s=60)
    m = Messenger(group, 60)
    seen: list[tuple[str, int]] = []
    try:
        if rank == 0:
            for b in range(-1, 6):
                m.send_activations(1, Header(b, tag=b + 7, flags=b % 3), _values(b, big))
            with pytest.raises(ShapeMismatchError, match="use fixed-size minibatches"):
                m.send_activations(1, Header(6), _values(6, big)[:-1])  # one tensor fewer than the link's shapes
            seen.append(("refused", 6))
        else:
            handles = {b: m.post_activations(0, b) for b in range(-1, 3)}  # posted ahead, as the executor does
            for b in range(-1, 6):
                h = handles.pop(b) if b in handles else m.post_activations(0, b)
                header, got = h.wait()
                assert header == Header(b, b + 7, b % 3)
                want = _values(b, big)
                assert [TensorSpec.of(t) for t in got] == [TensorSpec.of(t) for t in want]
                assert all(torch.equal(x, y) for x, y in zip(got, want)), b
                seen.append(("packed" if h.packing is not None else "separate", b))
        m.flush()
        group.control.allreduce([torch.zeros(1)]).wait()
    finally:
        group.close()
    return seen


@pytest.mark.parametrize("big", [False, True], ids=["small", "large"])
def test_activations_arrive_as_sent_packed_once_the_shapes_are_known(big):
    out = run_world(_exchange, 2, big, timeout=90)
    how = "separate" if big else "packed"
    assert out[1][1] == [("separate", -1)] + [(how, b) for b in range(6)]
    assert out[0][1] == [("refused", 6)]


def test_a_packing_keeps_every_tensor_aligned_and_refuses_a_large_message():
    specs = [TensorSpec((3, 5), torch.float16), TensorSpec((), torch.float32), TensorSpec((2,), torch.bool),
             TensorSpec((0, 4), torch.int64), TensorSpec((2, 2), torch.complex64)]
    p = Packing.of(specs)
    assert p is not None and all(o % 16 == 0 for o in p.offsets)
    assert p.nbytes == (30, 4, 2, 0, 32) and p.size == p.offsets[-1] + 32
    assert Packing.of([TensorSpec((PACK_LIMIT // 4 + 1,), torch.float32)]) is None
