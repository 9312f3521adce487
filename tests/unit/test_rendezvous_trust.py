"""Whether an agent trusts its own view of who is dead (:mod:`elasticd.rendezvous.trust`): the
provisional expiry rule on the agent's side, alone, on a fake clock."""

from __future__ import annotations

import logging
import threading

from elasticd.rendezvous.trust import Trust
from elasticd.testing.clock import FakeClock


def test_a_failure_is_distrusted_for_twice_the_ttl_and_a_later_one_extends_it(caplog):
    clock = FakeClock()
    trust = Trust(3, clock)
    assert trust.trusted() and trust.until == float("-inf")
    with caplog.at_level(logging.INFO, logger="elasticd.rendezvous.handler"):
        trust.distrust("etcd call failed")
        clock.advance(5.9)
        assert not trust.trusted()
        trust.distrust("the rendezvous lease was lost")  # already distrusted: extends, quietly
        clock.advance(5.9)
        assert not trust.trusted()
        clock.advance(0.1)
        assert trust.trusted()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["rendezvous: counting no member as dead for 6s (etcd call failed)"]


def test_failures_reported_from_two_threads_at_once_are_taken_one_at_a_time():
    # The keeper's thread and a watch's thread may report at the same moment: the second waits
    # for the first, so neither a later deadline nor the log's "was trusted" is lost.
    inside, proceed = threading.Event(), threading.Event()
    second_done = threading.Event()

    class SlowClock(FakeClock):
        def monotonic(self) -> float:
            if threading.current_thread().name == "first":
                inside.set()
                proceed.wait(5)
                return 100.0
            return 101.0

    trust = Trust(3, SlowClock())

    def second():
        trust.distrust("second")
        second_done.set()

    first = threading.Thread(target=trust.distrust, args=("first",), name="first")
    first.start()
    assert inside.wait(5)
    other = threading.Thread(target=second)
    other.start()
    overlapped = second_done.wait(0.3)  # done while the first is half-way: no lock
    proceed.set()
    first.join(5)
    other.join(5)
    assert not overlapped
    assert trust.until == 107.0
