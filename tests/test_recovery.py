"""Heartbeats (pipedream_ft.ft.recovery.Heartbeat): a peer whose heartbeat stops is evicted within about a
second, whatever the operations' timeout; a peer that keeps beating, or that finished, never is. Real TCPStore,
one connection per heartbeat, as in a job."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pipedream_ft.ft.coordination import LiveGroup
from pipedream_ft.ft.recovery import Heartbeat

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32


@pytest.fixture
def connect():
    host = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)

    def live() -> LiveGroup:
        client = dist.TCPStore("127.0.0.1", host.port, 1, False, timeout=timedelta(seconds=30))
        return LiveGroup(client, "run", "round", key=KEY)

    live().start()
    yield live
    del host


def wait_for(condition, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_peer_whose_heartbeat_stops_is_evicted_and_one_that_beats_is_not(connect):
    watcher_live, beating_live, hung_live = connect(), connect(), connect()
    beating = Heartbeat(beating_live, 1, 0, interval_s=0.05, hang_s=0.4)
    hung = Heartbeat(hung_live, 2, 0, interval_s=0.05, hang_s=0.4)
    watcher = Heartbeat(watcher_live, 0, 0, world_size=3, interval_s=0.05, hang_s=0.4)
    try:
        hung._stop.set()  # as a SIGSTOPped process: the beats stop, nothing says it finished
        hung._thread.join()
        stopped = time.monotonic()
        assert wait_for(lambda: watcher_live.evicted(2) == 0), "the hung peer was never evicted"
        assert time.monotonic() - stopped < 15  # found by its heartbeat, not by any operation's timeout
        assert watcher.evictions == [(2, 0)]
        assert watcher_live.evicted(1) is None  # it kept beating all along
    finally:
        for hb in (watcher, beating):
            hb.close()


def test_a_peer_that_finished_or_is_being_replaced_is_not_evicted(connect):
    watcher_live, done_live, dead_live = connect(), connect(), connect()
    done = Heartbeat(done_live, 1, 0, interval_s=0.05, hang_s=0.4)
    dead = Heartbeat(dead_live, 2, 0, interval_s=0.05, hang_s=0.4)
    watcher = Heartbeat(watcher_live, 0, 0, world_size=3, interval_s=0.05, hang_s=0.4)
    try:
        done.close()  # it finished: it says so before it stops beating
        dead._stop.set()  # it died and its supervisor has already started process 1
        dead._thread.join()
        dead_live.announce_replacement(2, 1)
        seen = watcher._seen
        # the watcher has seen both heartbeats unchanged for well over hang_s
        assert wait_for(lambda: all(r in seen and time.monotonic() - seen[r][1] > 1.0 for r in (1, 2)))
        assert watcher.evictions == [] and watcher_live.evicted(1) is None and watcher_live.evicted(2) is None
    finally:
        watcher.close()


def test_hang_s_must_exceed_two_beats(connect):
    with pytest.raises(ValueError, match="hang_s must exceed two heartbeat intervals"):
        Heartbeat(connect(), 0, 0, interval_s=0.5, hang_s=0.9)
