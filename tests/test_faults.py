"""The fault injector's own rules: parsing, arming by attempt, and faults tagged to fire together (they meet in a
real TCPStore; the injectors run in threads of this process, with the ``exception`` kind so nothing dies)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from dist_helpers import free_port
from pipedream_ft.ft import faults as faults_mod
from pipedream_ft.ft.faults import Fault, FaultInjector, InjectedFault, parse_faults

pytestmark = pytest.mark.timeout(60)


def test_parse_reads_every_field_and_names_what_is_wrong():
    got = parse_faults("kill@rank=1,step=21,together=a; exception@rank=3,step=21,attempt=0,together=a;"
                       "hang@rank=2,step=5,attempt=1")
    assert got == [Fault("kill", 1, 21, 0, "a"), Fault("exception", 3, 21, 0, "a"), Fault("hang", 2, 5, 1)]
    assert str(got[0]) == "kill@rank=1,step=21,attempt=0,together=a"
    assert str(got[2]) == "hang@rank=2,step=5,attempt=1"
    for text, words in [("kill", "must look like"), ("kill@rank=1", "needs rank= and step="),
                        ("kill@rank=1,step=x", "step must be an integer, got 'x'"),
                        ("kill@rank=1,step=2,when=3", "unknown field 'when=3'"),
                        ("explode@rank=1,step=2", "got 'explode'"),
                        ("kill@rank=1,step=2,together=a", "together='a' need at least two faults"),
                        # tags meet within one attempt: two attempts' faults never fire together
                        ("kill@rank=1,step=2,together=a;kill@rank=2,step=2,attempt=1,together=a", "together='a'"),
                        ("rejoin@rank=1,step=0,together=a;kill@rank=2,step=2,together=a", "take together="),
                        ("kill@rank=1,step=2,together=a/b;kill@rank=2,step=2,together=a/b", "got 'a/b'")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
            parse_faults(text)


def test_faults_are_armed_for_their_attempt_only():
    inj = FaultInjector(parse_faults("exception@rank=0,step=3,attempt=1"), rank=0, attempt=0)
    inj.at_forward(10)  # attempt 0: nothing armed
    inj.set_attempt(1)
    inj.at_forward(2)
    with pytest.raises(InjectedFault):
        inj.at_forward(3)
    inj.at_forward(4)  # fired once only


def test_checkpoint_faults_act_through_the_declared_seams_only(tmp_path, monkeypatch):
    """``ckpt_crash`` acts in the storage's ``before_write`` seam and ``corrupt`` in the checkpointer's
    ``before_save``; the injector replaces no method of either."""
    from pipedream_ft.checkpoint import Storage

    assert not FaultInjector(parse_faults("kill@rank=0,step=3"), rank=0, attempt=0).checkpoint_faults
    assert not FaultInjector(parse_faults("ckpt_crash@rank=1,step=3"), rank=0, attempt=0).checkpoint_faults
    inj = FaultInjector(parse_faults("ckpt_crash@rank=0,step=4,attempt=1"), rank=0, attempt=0)
    assert inj.checkpoint_faults  # armed in a later attempt: the seam is declared now
    killed: list[int] = []
    monkeypatch.setattr(faults_mod.os, "kill", lambda pid, sig: killed.append(sig))
    storage = Storage(str(tmp_path), before_write=inj.before_part_write)
    storage.write_bytes("step-0000000004/part-stage0.pt", b"0123456789")  # attempt 0: not armed
    assert not killed and storage.read_bytes("step-0000000004/part-stage0.pt") == b"0123456789"
    inj.set_attempt(1)
    storage.write_bytes("step-0000000003/part-stage0.pt", b"abcdefgh")  # before its step
    storage.write_bytes("step-0000000005/commit.json", b"{}")  # not a part
    assert not killed
    storage.write_bytes("step-0000000005/part-stage0.pt", b"abcdefgh")  # os.kill is stubbed: the write goes on
    assert killed and storage.read_bytes("step-0000000005/part-stage0.pt.partial") == b"abcd"
    killed.clear()
    storage.write_bytes("step-0000000006/part-stage0.pt", b"abcdefgh")  # fired once only
    assert not killed


def test_a_tagged_fault_needs_the_store():
    with pytest.raises(ValueError, match="need the job's store"):
        FaultInjector(parse_faults("kill@rank=1,step=2,together=a;kill@rank=2,step=2,together=a"), rank=1,
                      attempt=0)
    FaultInjector(parse_faults("kill@rank=1,step=2,together=a;kill@rank=2,step=2,together=a"), rank=0, attempt=0)


@pytest.fixture
def store():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)

    def connect():
        return dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=30),
                             wait_for_workers=False)

    yield connect
    del master


def test_tagged_faults_fire_only_once_every_one_is_reached(store):
    spec = parse_faults("exception@rank=1,step=21,together=a;exception@rank=3,step=21,together=a")
    first = FaultInjector(spec, rank=1, attempt=0, connect=store)
    second = FaultInjector(spec, rank=3, attempt=0, connect=store)
    fired: list[str] = []

    def reach() -> None:
        with pytest.raises(InjectedFault):
            first.at_forward(21)
        fired.append("rank 1")

    waiting = threading.Thread(target=reach)
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and fired == []  # rank 1 waits for rank 3, however long that takes
    second.at_forward(20)  # not yet at its step
    waiting.join(0.2)
    assert waiting.is_alive() and fired == []
    with pytest.raises(InjectedFault):
        second.at_forward(21)
    waiting.join(10)
    assert not waiting.is_alive() and fired == ["rank 1"]


def test_a_tagged_fault_whose_partner_never_comes_says_so(store, monkeypatch):
    monkeypatch.setattr(faults_mod, "TOGETHER_WAIT_S", 0.3)
    spec = parse_faults("exception@rank=1,step=21,together=a;kill@rank=3,step=21,together=a")
    with pytest.raises(InjectedFault, match="1 of the 2 faults tagged together=a were reached"):
        FaultInjector(spec, rank=1, attempt=0, connect=store).at_forward(21)


def test_a_finishing_fault_fires_once_every_rank_is_finishing(store, monkeypatch):
    killed: list[int] = []
    monkeypatch.setattr(faults_mod.os, "kill", lambda pid, sig: killed.append(sig))
    spec = parse_faults("finishing@rank=1,step=0")
    ranks = [FaultInjector(spec, rank=r, attempt=0, connect=store) for r in range(3)]
    waiting = threading.Thread(target=ranks[1].at_finishing, args=(3,))
    waiting.start()
    ranks[0].at_finishing(3)  # a rank without the fault checks in and goes on
    waiting.join(0.5)
    assert waiting.is_alive() and killed == []  # rank 1 waits for rank 2
    ranks[2].at_finishing(3)
    waiting.join(10)
    assert not waiting.is_alive() and killed == [faults_mod.signal.SIGKILL]
    ranks[1].set_attempt(1)  # a later attempt: nothing armed, nobody waits
    ranks[1].at_finishing(3)
    assert len(killed) == 1


def test_a_finishing_fault_needs_the_store_and_names_the_ranks_missing(store, monkeypatch):
    spec = parse_faults("finishing@rank=1,step=0")
    with pytest.raises(ValueError, match="finishing fault needs the job's store"):
        FaultInjector(spec, rank=0, attempt=0)
    monkeypatch.setattr(faults_mod, "TOGETHER_WAIT_S", 0.3)
    with pytest.raises(InjectedFault, match="1 of the 4 ranks began finishing"):
        FaultInjector(spec, rank=1, attempt=0, connect=store).at_finishing(4)
