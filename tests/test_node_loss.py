"""Losing a whole machine: the memory tier's peer copies (each rank's part also kept by a rank on another
machine) let the restarted group resume from the newest memory-tier cut, though the lost machine's shared
memory is gone.

Two torchrun agents on loopback (two "machines" of 2 ranks each, their memory tiers in separate directories)
train the test MLP with memory-tier checkpoints every 4 minibatches and no durable checkpoint in reach. The
second agent is killed with all its processes and its memory tier deleted; a new agent takes its place;
torchrun restarts the group; the final weights must be bitwise those of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port, wait_listening
from test_elastic_torchrun import kill_tree

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

WORKER = Path(__file__).with_name("ft_worker.py")
TOTAL = 160


def agent(port: int, tmp: Path, out: Path, name: str, nnodes: int, nproc: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", f"node-loss-{port}", "--monitor-interval", "0.5",
           str(WORKER), "--ckpt", str(tmp / "ckpt"), "--total", str(TOTAL), "--every", "100000",
           "--memory-every", "4", "--out", str(out), "--sleep-ms", "30", "--timeout", "6"]
    # without the agents' shared store, the rendezvous id names the job (and its memory tier)
    env = dict(os.environ, OMP_NUM_THREADS="1", PIPEDREAM_FT_RECOVERY="restart",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.Popen(cmd, env=env, stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_a_lost_machine_resumes_from_its_peers_copies(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    one = agent(free_port(), ref, ref / "final.pt", "ref", 1, 4)
    assert one.wait(timeout=200) == 0, (ref / "ref.log").read_text()[-4000:]
    reference = torch.load(ref / "final.pt")

    run = tmp_path / "run"
    run.mkdir()
    out = run / "final.pt"
    port = free_port()
    a = agent(port, run, out, "a", 2, 2)
    wait_listening(port, a)  # a hosts the rendezvous store: b is the machine that is lost
    b = agent(port, run, out, "b", 2, 2)
    b2 = None
    try:
        deadline = time.monotonic() + 120
        while not (out.with_suffix(".pt.ranks").exists() and len(out.with_suffix(".pt.ranks").read_text().splitlines()) >= 4):
            assert time.monotonic() < deadline, (run / "a.log").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2.5)  # well into training: several memory-tier cuts taken
        ranks = [json.loads(l) for l in out.with_suffix(".pt.ranks").read_text().splitlines()]
        lost = kill_tree(b.pid)
        b.wait(timeout=30)
        lost_nodes = {r["node"] for r in ranks if r["pid"] in lost}
        assert lost_nodes, (ranks, lost)
        for node in lost_nodes:  # the lost machine's shared memory is gone with it
            for d in Path("/dev/shm").glob(f"pdft-*-n{node}"):
                shutil.rmtree(d, ignore_errors=True)
        b2 = agent(port, run, out, "b2", 2, 2)
        assert a.wait(timeout=240) == 0, (run / "a.log").read_text()[-5000:]
        assert b2.wait(timeout=60) == 0, (run / "b2.log").read_text()[-5000:]
    finally:
        for p in (a, b, b2):
            if p is not None and p.poll() is None:
                kill_tree(p.pid)
    attempts = [json.loads(l) for l in out.with_suffix(".pt.attempts").read_text().splitlines()]
    resumed = [x["resumed_from"] for x in attempts if x["resumed_from"] is not None]
    assert resumed and resumed[0] > 0 and resumed[0] % 4 == 0, attempts  # a memory-tier cut: no durable one exists
    got = torch.load(out)
    for k, v in reference.items():
        assert torch.equal(got[k], v), k
