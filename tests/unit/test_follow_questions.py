"""How often a node's follower of an uncommitted version asks the commit coordinator whether
that version is hopeless (``CommitTracker._follow``): at first after 0.1 s, then less and less
often, and a hopeless answer ends its wait at once."""

from __future__ import annotations

import threading
import time

from elasticd.clock import SystemClock
from elasticd.replication.commit_state import Verdict
from elasticd.replication.tracker import CommitTracker

JOB, VERSION = "job", (0, 7)


class Book:
    """A version that stays undecided (no deadline) unless the coordinator calls it hopeless."""

    def verdict(self, version, now, hopeless=False):
        return Verdict.WITHDRAW if hopeless else Verdict.WAIT

    def deadline(self, version):
        return float("inf")


class Follower:
    """What ``CommitTracker._follow`` uses of its tracker, recording each question."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.jobs = {JOB: type("St", (), {"book": Book()})()}
        self.clock, self.closing = SystemClock(), False
        self.asked: list[tuple[float, float]] = []  # (seconds since start, every)
        self.answer, self.withdrawn_at = False, None
        self.reporter, self.t0 = self, time.monotonic()

    def hopeless(self, job, version, fresh_after=float("-inf"), every=0.2):
        self.asked.append((time.monotonic() - self.t0, every))
        return self.answer

    def _withdraw(self, job, version) -> None:
        self.withdrawn_at = time.monotonic() - self.t0


def follow(f: Follower) -> threading.Thread:
    thread = threading.Thread(target=CommitTracker._follow, args=(f, JOB, VERSION), daemon=True)
    thread.start()
    return thread


def test_a_waiting_follower_asks_less_and_less_often():
    f = Follower()
    thread = follow(f)
    time.sleep(1.7)
    with f.cond:
        f.closing = True
        f.cond.notify_all()
    thread.join(2)
    # 0.1, 0.3, 0.7, 1.5 s: four looks in 1.7 s (a look every 0.1 s before: 16), each asking
    # only when the last answer is older than the wait just done (0.2 s at least). The close
    # itself wakes it for one more look (past 1.7 s), not counted.
    assert len(f.asked) <= 5, f.asked
    looks = f.asked[:4]
    assert [every for _, every in looks] == [0.2, 0.2, 0.4, 0.8]
    for k, ((t, _), want) in enumerate(zip(looks, (0.1, 0.3, 0.7, 1.5))):
        assert want - 0.01 <= t <= want + 0.05 * (k + 2)  # a loaded machine wakes late


def test_a_hopeless_answer_ends_the_wait_at_once():
    f = Follower()
    thread = follow(f)
    time.sleep(0.8)  # past the third look: the follower now waits 0.8 s
    with f.cond:  # the reporter took a reply naming the version hopeless
        f.answer = True
        f.cond.notify_all()
    thread.join(2)
    assert f.withdrawn_at is not None and f.withdrawn_at < 0.95
