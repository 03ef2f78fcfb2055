"""Benchmark of a small activation's message on the CPU: made and read on the host, against torch's ops.

Run: ``python benchmarks/bench_packing.py [--number 20000]``.

Once a link's shapes are known, an activation of at most ``PACK_LIMIT`` bytes travels with its header as one
buffer (``pipeline.comm.Packing``). On the CPU the sender writes the header and the tensors' bytes into one
numpy buffer (``Packing.pack_host``) and the receiver checks the header's bytes against the link's and reads the
tensors as numpy views (``Packing.unpack_host``). The peer is the path every device takes (and the CPU took
before): the header encoded as a tensor, ``torch.cat`` of the pieces (``Packing.pack``), and the header decoded
whole and the tensors sliced and viewed by torch (``Packing.unpack``). Microseconds per message, the best of
five repeats, for a few activation shapes; the buffers are checked equal first.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipedream_ft.pipeline.comm import (  # noqa: E402
    _HEADER_BYTES, _MAGIC, _TAIL, Header, Packing, TensorSpec, _decode, _encode, _template)

__all__ = ["main"]

CASES = {
    "float32[8, 64]": [torch.randn(8, 64)],
    "float32[4, 128, 64]": [torch.randn(4, 128, 64)],
    "bfloat16[8, 64] + int64[8]": [torch.randn(8, 64).to(torch.bfloat16), torch.arange(8)],
    "float16[8, 64] x 3": [torch.randn(8, 64).half() for _ in range(3)],
}


def _best_us(fn, number: int) -> float:
    return 1e6 * min(timeit.repeat(fn, number=number, repeat=5)) / number


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--number", type=int, default=20000)
    a = p.parse_args(argv)
    cpu, header = torch.device("cpu"), Header(5, 1, 0)
    print(f"a small activation's message on the CPU, µs per message (best of 5 x {a.number})")
    print(f"{'tensors':<28} {'bytes':>7} {'send ours':>10} {'peer':>7} {'peer/ours':>10} "
          f"{'read ours':>10} {'peer':>7} {'peer/ours':>10}")
    torch.set_num_threads(1)
    for name, tensors in CASES.items():
        specs = [TensorSpec.of(t) for t in tensors]
        packing = Packing.of(specs)
        assert packing is not None, name
        template = _template(specs)
        tail = template[4:].tobytes()
        buf = packing.pack_host(template, header, tensors)
        if not torch.equal(buf, packing.pack(_encode(header, specs, cpu, template), tensors)):
            raise SystemExit(f"{name}: the two ways of packing differ")
        arr = buf.numpy()

        def read_ours() -> list[torch.Tensor]:
            fields = arr[:_HEADER_BYTES].view(np.int64)
            assert fields[0] == _MAGIC and fields[1] == 5 and arr[_TAIL:_HEADER_BYTES].tobytes() == tail
            Header(int(fields[1]), int(fields[2]), int(fields[3]))
            return packing.unpack_host(arr, buf, specs)

        def read_peer() -> list[torch.Tensor]:
            got, got_specs = _decode(buf[:_HEADER_BYTES].view(torch.int64))
            assert got.minibatch == 5 and got_specs == specs
            return packing.unpack(buf, got_specs)

        if not all(torch.equal(x, y) for x, y in zip(read_ours(), read_peer())):
            raise SystemExit(f"{name}: the two ways of reading differ")
        send_ours = _best_us(lambda: packing.pack_host(template, header, tensors), a.number)
        send_peer = _best_us(lambda: packing.pack(_encode(header, specs, cpu, template), tensors), a.number)
        recv_ours, recv_peer = _best_us(read_ours, a.number), _best_us(read_peer, a.number)
        print(f"{name:<28} {packing.size:>7} {send_ours:>10.1f} {send_peer:>7.1f} {send_peer / send_ours:>10.2f} "
              f"{recv_ours:>10.1f} {recv_peer:>7.1f} {recv_peer / recv_ours:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
