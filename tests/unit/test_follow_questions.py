"""When a node's follower of an uncommitted version asks the commit coordinator whether that
version is hopeless (:mod:`elasticd.replication.follower`): once, shortly before the node's next
snapshot wants the slot (not every few tenths of a second from the first acknowledgement on),
past the deadline of a blocking version at once; and a hopeless answer ends its wait at once."""

from __future__ import annotations

import threading
import time

from elasticd.clock import SystemClock
from elasticd.coordination.keys import Keyspace
from elasticd.replication import follower
from elasticd.replication.background import Background
from elasticd.replication.commit import commit_of
from elasticd.replication.commit_state import CommitBook, Holder, Verdict
from elasticd.replication.election import Coordinatorship
from elasticd.replication.placement import compute_placement
from elasticd.replication.report import Reply
from elasticd.replication.tracker import CommitTracker
from elasticd.testing.clock import FakeClock
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore

JOB, VERSION = "job", (0, 7)
ASK_LEAD = 0.1  # elasticd.replication.follower's (imported where the test needs the module)


def test_a_follower_asks_once_shortly_before_the_next_snapshot_is_due():
    """n1's versions land 0.5 s apart and never commit (n2 never reports): each report it
    sends is either the news of a version or a question. Only one question is worth asking per
    version, ``ASK_LEAD`` before the next snapshot (an answer then can still free the slot)."""
    sent: list[tuple[float, tuple]] = []
    background = Background("follow-test", 4)
    t0 = [0.0]

    def send(node, report):
        sent.append((time.monotonic() - t0[0], tuple(sorted(v for vs in report.ranks.values()
                                                            for v in vs))))
        return Reply(True, "", (), None)

    tracker = CommitTracker("n1", MemoryCoordinator(MemoryStore()), Keyspace("/t"),
                            SystemClock(), background, lambda job: None, commit_wait=0.0,
                            withdraw_after=1.0, send=send, lease_ttl=2.0)
    try:
        tracker.set_placement(JOB, compute_placement(["n1", "n2"], {"n1": [0], "n2": [1]}, 2,
                                                     round=1))
        tracker.reporter.coordinator_seen(JOB, Coordinatorship("n2", 7, 1))
        tracker.reporter.ticker.start()  # it starts each follower (as the replicator's does)
        t0[0] = time.monotonic()
        for step in (1, 2):
            tracker.on_pushed(JOB, (0, step), (0,), "n2")
            if step == 1:
                time.sleep(0.5)
        time.sleep(1.3)  # past both deadlines (1.0 s after each landing): both followers idle
        seen: dict[tuple, float] = {}
        news, questions = [], []
        for t, versions in sent:
            if not versions:  # the report before any version: the coordinator's first sight
                continue
            if versions not in seen:
                news.append(t)
                seen[versions] = t
            elif t - seen[versions] > ASK_LEAD / 2:
                questions.append(t)
            # else: the same news sent twice within a few ms (the landing's and the ack's
            # reports not coalesced on a loaded host: seen once in a unit-suite run), not a
            # question; the old follower's first question came 0.1 s after the news.
        # The old follower asked at 0.1, 0.3 and 0.7 s after each landing: 4-6 questions here.
        assert len(news) == 2 and 1 <= len(questions) <= 2, sent
        # The first version's follower learned the cadence (0.5 s) after it went to sleep
        # until its deadline's lead (0.9 s); the second's is due at 0.5 + 0.5 - 0.1 = 0.9 s:
        # nothing is asked before.
        assert all(t >= 0.9 - ASK_LEAD / 2 for t in questions), sent
        assert all(t < 1.3 for t in questions), sent
    finally:
        tracker.close()
        background.close()


def test_the_book_asks_before_the_next_snapshot_or_the_deadline_whichever_is_first():
    book = CommitBook(withdraw_after=1.0)
    book.landed_ranks(Holder.LOCAL, (0,), (0, 1), 10.0)
    assert book.ask_at((0, 1), 0.1) == 10.9  # no cadence known yet: before the deadline
    book.landed_ranks(Holder.LOCAL, (0,), (0, 2), 10.5)
    assert book.cadence == 0.5
    assert book.ask_at((0, 2), 0.1) == 10.9  # the next snapshot, at 11.0, comes first
    book.landed_ranks(Holder.LOCAL, (0,), (0, 3), 13.5)  # a slower cadence: the deadline first
    assert book.ask_at((0, 3), 0.1) == 14.4
    book.landed_ranks(Holder.LOCAL, (0,), (1, 3), 14.0)  # a new generation: no cadence across it
    assert book.cadence == 3.0


class Book:
    """A version that stays undecided (no deadline) unless the coordinator calls it hopeless."""

    def verdict(self, version, now, hopeless=False):
        return Verdict.WITHDRAW if hopeless else Verdict.WAIT

    def deadline(self, version):
        return float("inf")

    def ask_at(self, version, lead):
        return float("inf")


class Follower:
    """What :func:`follow` uses of its tracker, recording each question."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.jobs = {JOB: type("St", (), {"book": Book()})()}
        self.clock, self.closing = SystemClock(), False
        self.asked: list[float] = []
        self.answer, self.withdrawn_at = False, None
        self.reporter, self.t0 = self, time.monotonic()

    def hopeless(self, job, version, fresh_after=float("-inf"), every=float("inf"),
                 ask=True):
        if ask:
            self.asked.append(time.monotonic() - self.t0)
        return self.answer

    def withdraw(self, job, version) -> None:
        self.withdrawn_at = time.monotonic() - self.t0


def test_a_hopeless_answer_ends_the_wait_at_once():
    assert follower.ASK_LEAD == ASK_LEAD
    f = Follower()
    thread = threading.Thread(target=follower.follow, args=(f, JOB, VERSION), daemon=True)
    thread.start()
    time.sleep(0.5)
    with f.cond:  # the reporter took a reply (to another report) naming the version hopeless
        f.answer = True
        f.cond.notify_all()
    thread.join(2)
    assert f.withdrawn_at is not None and f.withdrawn_at < 0.7
    assert f.asked == []  # its question was not due: the answer came with another report


def test_a_version_holds_no_pool_thread_while_it_waits_for_its_commit():
    """A follower holds a thread of the tracker's pool while it runs (2 on a daemon, where
    reports and pushes need them), so it starts only when it may have to act, by the reporter's
    tick: a version committed before its question is due is never followed by a thread; one
    that is not gets its follower from the tick before its question, and the question is asked.
    The old followers waited for the commit on the pool's threads from the acknowledgement on:
    two versions waiting took both."""
    clock, sent = FakeClock(), []
    background = Background("follow-test", 2)

    def send(node, report):
        sent.append(report)
        return Reply(True, "", (), None)

    tracker = CommitTracker("n1", MemoryCoordinator(MemoryStore()), Keyspace("/t"), clock,
                            background, lambda job: None, commit_wait=0.0,
                            withdraw_after=60.0, send=send, lease_ttl=2.0)
    try:
        placement = compute_placement(["n1", "n2"], {"n1": [0], "n2": [1]}, 2, round=1)
        tracker.set_placement(JOB, placement)
        tracker.reporter.coordinator_seen(JOB, Coordinatorship("n2", 7, 1))
        for step in (1, 2):
            tracker.on_pushed(JOB, (0, step), [0], "n2")
            clock.advance(1.0)  # a snapshot a second
        ran = threading.Event()
        background.submit(ran.set)  # the pool's threads are free while both wait
        assert ran.wait(10)
        tracker.learn(JOB, commit_of((0, 2), placement, "n2", clock.wall()))
        assert follower.start_due(tracker, clock.monotonic() + 60) == float("inf")
        assert tracker.jobs[JOB].unstarted == {}  # committed: never followed by a thread

        tracker.on_pushed(JOB, (0, 3), [0], "n2")
        assert background.wait_idle(10)
        look = tracker.jobs[JOB].unstarted[(0, 3)]
        before = len(sent)
        clock.advance(look - clock.monotonic())
        tracker.reporter.tick()  # starts its follower, which asks whether (0, 3) is hopeless
        assert tracker.jobs[JOB].unstarted == {}
        until = time.monotonic() + 10
        while len(sent) == before and time.monotonic() < until:
            time.sleep(0.01)
        assert len(sent) > before and (0, 3) in sent[-1].ask
    finally:
        tracker.close()
        background.close()
