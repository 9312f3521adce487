"""The watch feed the daemon and the job manager share: batches wait in order for the loop,
unwanted events are dropped on the watch thread, and an error batch tells the loop to re-list."""

from __future__ import annotations

from elasticd.coordination.api import EventType, Unavailable, WatchEvent
from elasticd.testing.coordination import MemoryCoordinator
from elasticd.coordination.watch_feed import WatchFeed


def test_events_wait_in_order_and_unwanted_ones_are_dropped():
    coord = MemoryCoordinator()
    wakes = []
    feed = WatchFeed(keep=lambda e: not e.kv.key.endswith(b"/skip"),
                     wake=lambda: wakes.append(1))
    feed.start(coord, b"/t/", coord.revision(b"/t/") + 1)
    coord.put(b"/t/a", b"1")
    coord.put(b"/t/skip", b"2")
    coord.put(b"/t/b", b"3")
    coord.delete(b"/t/a")
    events, stale = feed.take()
    assert [(e.type.name, e.kv.key) for e in events] == [
        ("PUT", b"/t/a"), ("PUT", b"/t/b"), ("DELETE", b"/t/a")]
    assert not stale and len(wakes) == 3  # the dropped event woke nobody
    assert feed.take() == ([], False) and feed.empty()
    feed.close()
    coord.put(b"/t/c", b"4")
    assert feed.empty()


def test_an_error_batch_asks_for_a_relist_and_keeps_the_events_around_it():
    feed = WatchFeed()
    feed.put([])  # nothing wanted: not queued
    assert feed.empty()
    coord = MemoryCoordinator()
    coord.put(b"/t/a", b"1")
    kv = coord.get(b"/t/a")
    feed.put([WatchEvent(EventType.PUT, kv)])
    feed.put(Unavailable("watch broke"))
    feed.put([WatchEvent(EventType.PUT, kv)])
    events, stale = feed.take()
    assert stale and len(events) == 2
    assert feed.take() == ([], False)
