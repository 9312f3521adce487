"""The commit reporter's ticker (:class:`~elasticd.replication.ticker.Ticker`) ticks when work is due, not ten times
a second on every node whatever happens: with nothing pending a node ticks about once a
second, and a failed report still has its retry on time (the failure wakes the ticker)."""

from __future__ import annotations

import threading
import time

import pytest

from elasticd.clock import SystemClock
from elasticd.coordination.keys import Keyspace
from elasticd.replication.api import ReplicationError
from elasticd.replication.background import Background
from elasticd.replication.election import Coordinatorship
from elasticd.replication.placement import compute_placement
from elasticd.replication.report import Reply
from elasticd.replication.tracker import CommitTracker
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore

JOB = "job"


def _tracker(send=lambda node, report: Reply(True, "", (), None)):
    """Node n2's commit tracker on an in-memory etcd, sending reports with ``send``; and the
    pool it runs on (close both)."""
    background = Background("ticker-test", 2)
    return CommitTracker("n2", MemoryCoordinator(MemoryStore()), Keyspace("/t"), SystemClock(),
                         background, lambda job: None, commit_wait=0.0, send=send,
                         lease_ttl=2.0), background


def test_an_idle_node_ticks_rarely_and_a_failed_report_is_retried_on_time():
    sent: list[float] = []
    fail = threading.Event()

    def send(node, report):
        sent.append(time.monotonic())
        if fail.is_set():
            fail.clear()
            raise ReplicationError("peer unreachable")
        return Reply(True, "", (), None)

    tracker, background = _tracker(send)
    reporter = tracker.reporter
    ticks: list[float] = []
    real_tick = reporter.tick

    def counted() -> float:
        ticks.append(time.monotonic())
        return real_tick()

    reporter.tick = counted  # type: ignore[method-assign]
    try:
        tracker.set_placement(JOB, compute_placement(["n1", "n2"], {"n1": [0], "n2": [1]}, 2,
                                                     round=1))
        reporter.coordinator_seen(JOB, Coordinatorship("n1", 7, 1))  # a report goes at once
        reporter.ticker.start()
        time.sleep(2.0)
        # Nothing pending (its report taken, n1 coordinating): the old ticker ran 20 times.
        assert 1 <= len(ticks) <= 4, len(ticks)
        assert len(sent) == 1
        fail.set()
        reporter.changed(JOB)  # a report that fails: retried after 0.1 s by the ticker
        time.sleep(0.6)
        assert len(sent) == 3 and sent[2] - sent[1] < 0.45, [t - sent[0] for t in sent]
        assert reporter.settled()
    finally:
        tracker.close()
        background.close()


def test_a_report_in_flight_and_a_known_coordinator_make_no_tick_due(monkeypatch):
    # Every node's report is in flight for part of each step (its sender sends it again while
    # due, a failure wakes the ticker): the tick scheduled a retry at TICK meanwhile (~4 ticks
    # per node per second at N = 60), and searched the placement's node list for its campaign
    # delay at every tick (O(N)) though a coordinator was known.
    from elasticd.replication import reporter as module
    tracker, background = _tracker()
    reporter = tracker.reporter
    try:
        tracker.set_placement(JOB, compute_placement(["n1", "n2"], {"n1": [0], "n2": [1]}, 2,
                                                     round=1))
        reporter.coordinator_seen(JOB, Coordinatorship("n1", 7, 1))
        assert background.wait_idle(5) and reporter.settled()
        delays: list[str] = []
        real = module._delay
        monkeypatch.setattr(module, "_delay", lambda node, st: (delays.append(node),
                                                                real(node, st))[1])
        with tracker.lock:
            j = reporter.jobs[JOB]
            j.dirty, j.busy = True, True  # what changed while its last report is sent
        assert reporter.tick() == module.IDLE_TICK and delays == []
        with tracker.lock:  # not sent after all (a failure): its retry, after a backoff
            j.busy, j.retry_at = False, time.monotonic() + 0.5
        assert reporter.tick() < module.IDLE_TICK  # due at its retry, 0.5 s away or less
    finally:
        tracker.close()
        background.close()


@pytest.mark.parametrize("coordinator", ["", "n2"])
def test_a_report_that_cannot_be_sent_is_tried_at_the_ticks_pace_not_in_a_loop(coordinator):
    # The coordinator record unreadable (""), or naming this node's own earlier term ("n2"
    # with no coordination here): the sender returns with the report still due and wakes the
    # ticker, which kicked it again at once: a loop between the ticker and the pool at full
    # speed on every node (the whole suite's etcd fuzz: etcd starved, its clients timed out).
    tracker, background = _tracker()
    reporter = tracker.reporter
    tries: list[float] = []
    real_send_once = reporter._send_once

    def counted(job: str) -> bool:
        tries.append(time.monotonic())
        return real_send_once(job)

    reporter._send_once = counted  # type: ignore[method-assign]
    try:
        tracker.set_placement(JOB, compute_placement(["n1", "n2"], {"n1": [0], "n2": [1]}, 2,
                                                     round=1))
        reporter.coordinator_seen(JOB, Coordinatorship(coordinator, 7, 1))
        reporter.ticker.start()
        reporter.changed(JOB)
        time.sleep(1.0)
        # At most one try a TICK (0.1 s), as when the ticker polled at TICK; thousands before.
        assert 1 <= len(tries) <= 15, len(tries)
    finally:
        tracker.close()
        background.close()
