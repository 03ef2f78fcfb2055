"""The owner record of a checkpoint location: one job at a time (see pipedream_ft.checkpoint.owner)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid

import pytest

from pipedream_ft.checkpoint.owner import OWNER_FILE, Owner, OwnershipError
from pipedream_ft.checkpoint.storage import RetryConfig, Storage

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path) -> Storage:
    if request.param == "local":
        return Storage(str(tmp_path / "ckpt"))
    return Storage(f"memory://pdft-owner-{uuid.uuid4().hex}", retry=RetryConfig(attempts=1))


def owner(storage: Storage, job: str, clock: Clock, model: str = "m" * 64, plan: str = "p" * 64) -> Owner:
    return Owner(storage, job=job, model_hash=model, plan_hash=plan, lease_s=60.0, settle_s=0.0, clock=clock)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_first_claim_creates_the_record(storage):
    clock = Clock()
    a = owner(storage, "job-a", clock)
    assert a.claim() == "claimed"
    record = a.read()
    assert record.job == "job-a" and record.token == a.token and not record.released
    a.check(8)  # still ours


def test_a_live_owner_refuses_a_second_job_naming_the_url_and_the_owner(storage):
    clock = Clock()
    owner(storage, "job-a", clock).claim()
    with pytest.raises(OwnershipError) as err:
        owner(storage, "job-b", clock).claim()
    text = str(err.value)
    assert storage.url in text and "in use by job job-a" in text


def test_the_same_job_renews_its_own_record(storage):
    clock = Clock()
    a = owner(storage, "job-a", clock)
    a.claim()
    again = owner(storage, "job-a", clock)  # a torchrun restart of the same job
    assert "own location" in again.claim()
    with pytest.raises(OwnershipError):  # the earlier claim of the job is superseded: it must not commit
        a.check(16)
    again.check(16)


def test_an_expired_lease_of_the_same_model_is_taken_over_and_remembered(storage):
    clock = Clock()
    owner(storage, "job-a", clock).claim()
    clock.now += 61
    b = owner(storage, "job-b", clock)
    note = b.claim()
    assert note.startswith("taken over from job job-a") and "lease expired" in note
    assert b.read().previous == ("job-a",)


def test_a_released_location_is_taken_over_at_once(storage):
    clock = Clock()
    a = owner(storage, "job-a", clock)
    a.claim()
    a.release()
    assert "released by it" in owner(storage, "job-b", clock).claim()


def test_a_dead_owner_process_on_this_host_frees_the_location(storage):
    clock = Clock()
    a = owner(storage, "job-a", clock)
    a.claim()
    record = json.loads(storage.read_bytes(OWNER_FILE))
    record["pid"] = dead_pid()
    storage.write_bytes(OWNER_FILE, json.dumps(record).encode())
    assert owner(storage, "job-b", clock).claim().startswith("taken over")


def test_another_model_is_refused_even_when_expired(storage):
    clock = Clock()
    owner(storage, "job-a", clock).claim()
    clock.now += 1000
    with pytest.raises(OwnershipError, match="written for another model"):
        owner(storage, "job-b", clock, model="x" * 64).claim()


def test_a_job_refuses_a_location_another_job_took_over_since_it_last_wrote(storage):
    clock = Clock()
    a = owner(storage, "job-a", clock)
    a.claim()
    a.release()
    b = owner(storage, "job-b", clock)
    b.claim()
    b.release()  # even after the other job ended
    with pytest.raises(OwnershipError, match=r"was taken over by job job-b .* after this job \(job-a\) last wrote"):
        owner(storage, "job-a", clock).claim()


def test_a_commit_after_a_takeover_is_refused(storage):
    clock = Clock()
    a = owner(storage, "job-a", clock)
    a.claim()
    clock.now += 61  # job a stalled past its lease
    owner(storage, "job-b", clock).claim()
    with pytest.raises(OwnershipError, match="checkpoint 24 not committed"):
        a.check(24)
    assert a.lost is not None
    a.release()  # must not release job b's record
    assert not owner(storage, "job-b", clock).read().released


def test_heartbeat_renews_the_lease(tmp_path):
    storage = Storage(str(tmp_path / "ckpt"))
    clock = Clock()
    a = Owner(storage, job="job-a", model_hash="m", plan_hash="p", lease_s=0.2, settle_s=0.0, clock=clock)
    a.claim()
    first = a.read().heartbeat
    clock.now += 5
    a.start_heartbeat()
    deadline = threading.Event()
    for _ in range(200):
        if a.read().heartbeat > first:
            break
        deadline.wait(0.05)
    a.release()
    assert a.read().heartbeat > first and a.read().released


def test_two_claims_at_once_on_local_disk_have_one_winner(tmp_path):
    storage = Storage(str(tmp_path / "ckpt"))
    clock = Clock()
    results: dict[str, str] = {}

    def claim(job: str) -> None:
        try:
            results[job] = owner(storage, job, clock).claim()
        except OwnershipError as exc:
            results[job] = f"refused: {exc}"

    threads = [threading.Thread(target=claim, args=(f"job-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(v == "claimed" for v in results.values()) == [False, False, False, True], results


def test_an_unreadable_record_is_refused_with_a_hint(storage):
    storage.write_bytes(OWNER_FILE, b"{not json")
    with pytest.raises(OwnershipError, match=f"remove {OWNER_FILE}"):
        owner(storage, "job-a", Clock()).claim()
