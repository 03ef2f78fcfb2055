"""Messages between stages (pipedream_ft.pipeline.comm): a link's first activation teaches the receiver its shapes;
later small ones travel with their header as one message (Packing), large ones as a header and one message per
tensor; every dtype and shape arrives as sent, on 2 real gloo processes. With headers on the host (what a device
backend does) nothing is packed and the header travels on the gloo control group."""

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


def _exchange(big: bool, host_headers: bool = False) -> list[tuple[str, int]]:
    """Rank 0 sends minibatches -1 (the pre-flight's, unpacked) and 0..5 to rank 1; rank 1 checks each and returns
    what it was sent as: ("packed" | "separate", minibatch); rank 0 then refuses to send other shapes."""
    import os

    import torch.distributed as dist

    from pipedream_ft.pipeline.comm import Messenger
    from pipedream_ft.pipeline.group import CommGroup

    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0, timeout=timedelta(seconds=60))
    group = CommGroup(store, rank=rank, world_size=2, backend="gloo", device=torch.device("cpu"), timeout_s=60)
    m = Messenger(group, 60, host_headers=host_headers)
    assert m.host_headers is host_headers
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
                assert h.header_buf is not None and h.header_buf.device.type == "cpu"
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


def test_headers_on_the_host_travel_apart_from_their_tensors():
    out = run_world(_exchange, 2, False, True, timeout=90)
    assert out[1][1] == [("separate", b) for b in range(-1, 6)]
    assert out[0][1] == [("refused", 6)]


def test_headers_go_to_the_gloo_control_group_and_tensors_to_their_link():
    from pipedream_ft.pipeline.group import CommGroup

    group = CommGroup.__new__(CommGroup)
    group.world, group.control = "nccl-world", "gloo-control"
    group._links = {(1, "act"): ("nccl-act-link", 0)}
    assert group._route(1, "hdr") == ("gloo-control", 1) and group._route(1, "hdr:2") == ("gloo-control", 1)
    assert group._route(1, "act") == ("nccl-act-link", 0) and group._route(1, "tgt") == ("nccl-world", 1)


def test_a_packing_keeps_every_tensor_aligned_and_refuses_a_large_message():
    specs = [TensorSpec((3, 5), torch.float16), TensorSpec((), torch.float32), TensorSpec((2,), torch.bool),
             TensorSpec((0, 4), torch.int64), TensorSpec((2, 2), torch.complex64)]
    p = Packing.of(specs)
    assert p is not None and all(o % 16 == 0 for o in p.offsets)
    assert p.nbytes == (30, 4, 2, 0, 32) and p.size == p.offsets[-1] + 32
    assert Packing.of([TensorSpec((PACK_LIMIT // 4 + 1,), torch.float32)]) is None



def test_a_packed_message_made_on_the_host_is_the_one_made_of_tensors_and_unpacks_to_its_tensors():
    from pipedream_ft.pipeline.comm import _encode, _template

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g).to(torch.float16), torch.randn((), generator=g),
               torch.tensor([True, False]), torch.zeros(0, 4, dtype=torch.int64),
               torch.randn(2, 2, generator=g).to(torch.bfloat16).requires_grad_(),
               torch.randn(4, 6, generator=g).t(),  # not contiguous
               torch.randn(2, 3, generator=g, dtype=torch.complex64).conj()]  # a lazily conjugated view
    specs = [TensorSpec.of(t) for t in tensors]
    p, header = Packing.of(specs), Header(7, 3, 2)
    assert p is not None
    host = p.pack_host(_template(specs), header, tensors)
    made = p.pack(_encode(header, specs, torch.device("cpu"), _template(specs)), tensors)
    assert host.dtype == torch.uint8 and torch.equal(host, made)
    for back in (p.unpack(host, specs), p.unpack_host(host.numpy(), host, specs)):
        assert all(torch.equal(a, b.detach()) and a.dtype == b.dtype and a.shape == b.shape
                   for a, b in zip(back, tensors))


@pytest.mark.parametrize("sent,minibatch,match", [
    ([TensorSpec((3,), torch.float32)], 4, "expected minibatch 5 from rank 0, got 4"),
    ([TensorSpec((1, 3), torch.float32)], 5, r"rank 0 sent float32\[1, 3\] for minibatch 5, but earlier minibatches "
                                            r"were float32\[3\]"),
])
def test_a_packed_message_read_in_place_that_is_not_the_one_expected_is_refused_by_name(sent, minibatch, match):
    from pipedream_ft.pipeline.comm import RecvHandle, _template

    expected = [TensorSpec((3,), torch.float32)]

    class Receiver:  # the messenger's part a posted receive reads
        _tails = {0: _template(expected)[4:].tobytes()}

        def _wait(self, work, what, peer):
            pass

    p = Packing.of(expected)
    assert p is not None and Packing.of(sent) == p  # the same bytes: only the header tells them apart
    h = RecvHandle(Receiver(), 0, 5, "activation")  # type: ignore[arg-type]
    h.packing, h.expected, h.header_work = p, expected, object()
    h.header_buf = p.pack_host(_template(sent), Header(minibatch), [torch.ones(sent[0].shape)])
    h.host = h.header_buf.numpy()
    with pytest.raises(ShapeMismatchError, match=match):
        h.wait()

def _headers(host: bool, case, *args):
    """``case(*args)`` on this rank, every messenger sending its headers on the host (as under NCCL) if ``host``."""
    from pipedream_ft.pipeline import comm

    comm.Messenger.__init__.__kwdefaults__["host_headers"] = True if host else None
    return case(*args)


def _as_under_nccl(host: bool, case, *args):
    """``case(*args)`` with headers and a replicated stage's cut flags on the host (as under NCCL) if ``host``."""
    from pipedream_ft.pipeline import group

    group.CommGroup.__init__.__kwdefaults__["flags_on_host"] = True if host else None
    return _headers(host, case, *args)


def test_a_replicated_stage_summing_its_cut_flags_on_the_host_trains_and_checkpoints_bitwise_as_on_its_device(
        tmp_path):
    """A checkpoint every 4 minibatches reaches one replica of the middle stage in a header; the other learns it
    at their shared update, from the gradients' all-reduce, or (as under NCCL) from a sum over a gloo group of
    their own: the same losses, weights and checkpoints either way, asynchronous (stash) and flush."""
    from runtime_cases import replicated_cuts_case

    modes = ["stash", "flush"]
    runs = [run_world(_as_under_nccl, 4, host, replicated_cuts_case, 16, modes, str(tmp_path / name), timeout=240)
            for host, name in ((False, "device"), (True, "host"))]
    for mode in modes:
        device, host = runs[0][3][1][mode], runs[1][3][1][mode]
        assert host["losses"] == device["losses"] and len(device["losses"]) == 16, mode
        assert all(torch.equal(host["state"][k], v) for k, v in device["state"].items()), mode
        listed = [sorted(str(p.relative_to(tmp_path / name / mode)) for p in (tmp_path / name / mode).rglob("*")
                         if p.is_file()) for name in ("device", "host")]
        assert listed[0] == listed[1] and any("16" in p for p in listed[0]), (mode, listed)


@pytest.mark.parametrize("mode", ["vertical", "flush"])
def test_a_pipeline_with_headers_on_the_host_trains_bitwise_as_with_headers_on_its_link(mode, tmp_path):
    """Headers carry the version tag (vertical sync) and the cut flags (a checkpoint every 4 minibatches): the same
    losses and weights, and the same checkpoints, either way."""
    from runtime_cases import gpt_case, gpt_plan

    plan = gpt_plan(3)
    runs = [run_world(_headers, 3, host, gpt_case, plan, 12, mode, "sgd", 4, str(tmp_path / name), timeout=200)
            for host, name in ((False, "link"), (True, "host"))]
    (_, link), (_, host) = runs[0][2], runs[1][2]
    assert host["losses"] == link["losses"] and len(link["losses"]) == 12
    assert all(torch.equal(host["state"][k], v) for k, v in link["state"].items())
    assert sorted(p.name for p in (tmp_path / "host").iterdir()) == sorted(p.name for p in (tmp_path / "link").iterdir())


def test_stages_of_one_process_with_headers_on_the_host_train_and_evaluate_as_with_headers_on_their_link():
    """ZBV: two stages per process, messages only between processes (tagged by stage); the data read once on stage
    0, which sends the targets to the last stage (their own channel), and evaluation's channel of variable shapes."""
    from runtime_cases import stages_case

    stages = [[0, 1], [2, 3, 4], [5, 6], [7, 8]]
    link, host = (run_world(_headers, 2, h, stages_case, stages, 8, "zbv", {"stream": True}, timeout=200) for h in (False, True))
    for rank in (0, 1):
        a, b = link[rank][1], host[rank][1]
        assert a["stages"] == b["stages"] and len(a["stages"]) == 2
        assert a["losses"] == b["losses"] and a["eval"] == b["eval"]
        assert all(torch.equal(b["state"][k], v) for k, v in a["state"].items())
