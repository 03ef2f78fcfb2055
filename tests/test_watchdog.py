"""The watchdog (pipedream_ft.ft.watchdog): a rank that stops making progress fails, named; a wait that has a
deadline of its own (a recovery, the last checkpoints' commit) does not trip it."""

from __future__ import annotations

import threading

import pytest
from torch import nn

from pipedream_ft.ft.watchdog import Watchdog, WatchdogHook

pytestmark = pytest.mark.timeout(120)


def watched(timeout_s: float = 0.3) -> tuple[Watchdog, list[str], threading.Event]:
    fired: list[str] = []
    event = threading.Event()
    dog = Watchdog(timeout_s, on_timeout=lambda msg: (fired.append(msg), event.set()))
    return dog, fired, event


def test_no_beat_while_armed_fails_naming_what_the_rank_was_doing():
    dog, fired, event = watched()
    hook = WatchdogHook(dog, stage=2)
    hook.on_train_start(0, 8)
    hook.on_event("gathering")
    assert event.wait(10)
    assert fired == ["no progress for 0.3s while gathering the losses"]
    dog.close()


def test_beats_keep_it_quiet_and_a_disarmed_watchdog_never_fires(tmp_path):
    health = tmp_path / "health"
    # beats ten times as often as the timeout: a loaded machine may stretch a 0.1 s wait, not ten times over
    fired: list[str] = []  # the watchdog's thread calls on_timeout: record, and assert here
    dog = Watchdog(1.0, on_timeout=fired.append, health_file=str(health))
    dog.arm()
    for _ in range(25):  # 2.5 s of progress: more than two timeouts' worth
        dog.beat("running 3F1 on stage 0")
        threading.Event().wait(0.1)
    assert "running 3F1 on stage 0" in health.read_text()
    assert fired == []
    dog.disarm()
    threading.Event().wait(2.5)
    dog.close()
    assert fired == []


@pytest.mark.parametrize("disarming", ["finishing", "failure"])
def test_waits_with_a_deadline_of_their_own_disarm_it_until_training_goes_on(disarming):
    """The last checkpoints' commit waits up to the commit timeout, a recovery up to its own deadline: both are
    longer than the watchdog's timeout may be, and neither may be cut short by it."""
    dog, fired, event = watched()
    hook = WatchdogHook(dog, stage=0)
    hook.on_train_start(0, 8)
    hook.on_event("draining")
    hook.on_event(disarming)
    assert not event.wait(1.2)
    if disarming == "failure":  # the recovery formed the group again: training goes on, watched
        hook.on_event("recovered")
        assert event.wait(10)
        assert fired == ["no progress for 0.3s while waiting for the last sends"]
    dog.close()


def _slow_last_commit_case(url: str) -> float:
    """Two ranks, a watchdog of 1.5 s, and storage that takes 2.5 s per write: ``fit``'s wait for the last
    checkpoint to commit outlasts the watchdog's timeout (but not the commit timeout)."""
    import time

    from pipedream_ft import CheckpointConfig, PipelineConfig, PipelineTrainer
    from pipedream_ft.checkpoint import storage
    from pipedream_ft.policies import EveryNSteps
    from runtime_cases import data, mlp, plan_for, sgd

    write = storage.Storage.write_bytes

    def slow_write(self, rel, payload):
        time.sleep(2.5)
        return write(self, rel, payload)

    storage.Storage.write_bytes = slow_write
    model = mlp()
    trainer = PipelineTrainer(model, plan_for(model, [[0, 1, 2, 3], [4, 5, 6, 7, 8]]),
                              loss_fn=nn.functional.cross_entropy, optimizer_factory=sgd,
                              config=PipelineConfig(mode="flush", flush_every=4, timeout_s=30, watchdog_s=1.5,
                                                    summary=False),
                              checkpoint=CheckpointConfig(url=url, policy=EveryNSteps(8), commit_timeout_s=60))
    t0 = time.monotonic()
    trainer.fit(data, 8)
    waited = time.monotonic() - t0
    trainer.close()
    return waited


def test_fit_waits_for_a_slow_last_commit_without_the_watchdog_firing(tmp_path):
    """Before the wait for the last commit disarmed it, the watchdog ended such a rank (exit 70) with
    "no progress ... while waiting for the last sends"; a loaded machine's in-place recovery test met it."""
    from dist_helpers import run_world

    out = run_world(_slow_last_commit_case, 2, str(tmp_path / "ckpt"), timeout=90)
    assert all(ok for ok, _ in out.values()), out
    assert all(waited > 1.5 for _, waited in out.values()), out  # the wait did outlast the watchdog's timeout
    from pipedream_ft.checkpoint import Storage, list_committed

    assert 8 in list_committed(Storage(str(tmp_path / "ckpt")))
