"""The agent's commit gate for the ``interval:MIN`` grow policy (:mod:`elasticd.agent.commit_watch`):
the rule alone, and the watch that keeps it current on the in-memory coordinator."""

from __future__ import annotations

import threading
import time

from elasticd.agent.commit_watch import CommitWatch, at_committed_step
from elasticd.coordination.api import CoordinationError
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.replication.commit import Committed, encode_ahead, encode_committed

KEYS = Keyspace("/t")


def test_the_job_is_at_a_committed_step_when_no_node_has_a_newer_version():
    assert not at_committed_step(None, [])  # nothing committed: growing would restart at 0
    assert at_committed_step((0, 5), [(0, 5), (0, 4)])
    assert not at_committed_step((0, 5), [(0, 5), (0, 6)])  # a rank's next step replicated
    assert at_committed_step((1, 2), [(0, 9)])  # an older generation's record


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)


def test_the_watch_follows_the_committed_and_ahead_records_only():
    store = MemoryStore()
    writer, reader = MemoryCoordinator(store), MemoryCoordinator(store)
    watch = CommitWatch(reader, KEYS, "job")
    try:
        assert not watch()  # the first ask lists and watches, in a thread
        wait_until(lambda: watch._fresh)
        assert not watch()  # no commit yet
        writer.put(KEYS.replication("job").commit_ahead, encode_ahead((0, 3)))
        writer.put(KEYS.replication("job").committed,
                   encode_committed(Committed(0, 3, (0,), {0: ("n1",)})))
        wait_until(watch)
        writer.put(KEYS.replication("job").commit_ahead, encode_ahead((0, 4)))
        wait_until(lambda: not watch())  # step 4 replicated, not committed yet
        # Keys outside the committed prefix are not watched at all (the old per-node records).
        writer.put(KEYS.replication("job").replicated("n2"), b"{}")
        writer.put(KEYS.replication("job").committed,
                   encode_committed(Committed(0, 4, (0,), {0: ("n1",)})))
        wait_until(watch)
        writer.delete(KEYS.replication("job").committed)
        wait_until(lambda: not watch())
        assert reader.store._watches[0].prefix == KEYS.replication("job").committed
    finally:
        watch.stop()


def test_after_a_watch_error_the_gate_says_no_until_the_records_are_listed_again():
    store = MemoryStore()
    writer, reader = MemoryCoordinator(store), MemoryCoordinator(store)
    writer.put(KEYS.replication("job").commit_ahead, encode_ahead((0, 3)))
    writer.put(KEYS.replication("job").committed,
               encode_committed(Committed(0, 3, (0,), {0: ("n1",)})))
    watch = CommitWatch(reader, KEYS, "job")
    try:
        watch()  # the first ask lists and watches, in a thread
        wait_until(watch)
        listed, release = [], threading.Event()
        real = reader.get_prefix

        def slow_listing(prefix):
            listed.append(prefix)
            release.wait(5)
            return real(prefix)

        reader.get_prefix = slow_listing
        watch._on_watch(CoordinationError("watch broke"))  # as the watch thread reports it
        wait_until(lambda: listed)  # re-listing, in a thread of its own
        assert not watch()  # a doubtful view: no growing on it
        release.set()
        wait_until(watch)
    finally:
        watch.stop()


def test_the_gate_watches_etcd_only_while_it_is_asked():
    """The agent's gate holds no watch until first asked (every node's agent watching the
    committed prefix for the whole run doubled the nodes' watch events per step), and lets
    it go once unasked for IDLE seconds."""
    from elasticd.agent.commit_watch import IDLE
    from elasticd.testing.clock import FakeClock

    store, clock = MemoryStore(), FakeClock()
    writer, reader = MemoryCoordinator(store), MemoryCoordinator(store)
    writer.put(KEYS.replication("job").committed, encode_committed(Committed(0, 3, (0,), {0: ("n1",)})))
    gate = CommitWatch(reader, KEYS, "job", clock=clock)
    try:
        time.sleep(0.1)
        assert not store._watches  # built, not asked: no watch
        gate()  # the first ask starts it (in a thread: it says no until listed)
        wait_until(gate)
        assert len(store._watches) == 1
        clock.advance(IDLE + 1)  # unasked since: the next event ends the watch
        writer.put(KEYS.replication("job").committed,
                   encode_committed(Committed(0, 4, (0,), {0: ("n1",)})))
        wait_until(lambda: all(w.cancelled for w in store._watches))
        gate()
        wait_until(gate)  # asked again: listed and watched again
        assert sum(not w.cancelled for w in store._watches) == 1
    finally:
        gate.stop()


def test_the_handler_asks_the_commit_gate_only_when_a_newcomer_waits():
    import types

    from elasticd.rendezvous.handler import EtcdNativeRendezvousHandler
    from elasticd.rendezvous.records import RoundRecord, Waiting

    asked = []
    handler = types.SimpleNamespace(
        settings=types.SimpleNamespace(grow_interval=60.0), _clock=types.SimpleNamespace(
            wall=lambda: 1000.0), commit_gate=lambda: asked.append(1) or False)
    current = RoundRecord(3, ("a", "b"), grew_at=100.0)  # the interval is over
    at_commit = EtcdNativeRendezvousHandler._at_commit
    assert at_commit(handler, current, Waiting(3, rejoining=1)) and not asked
    assert at_commit(handler, current, Waiting(2, outsiders=1)) and not asked  # an old summary
    assert not at_commit(handler, current, Waiting(3, outsiders=1)) and asked == [1]
