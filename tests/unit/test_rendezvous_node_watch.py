"""The closer's view of the node records (:mod:`elasticd.rendezvous.node_watch`), alone, on the
in-memory coordinator (its watch calls back synchronously): the listing, the events after it,
bad records, and what a watch error asks for. The handler's contract tests run it on real etcd
(tests/integration/test_rendezvous_native.py)."""

from __future__ import annotations

import logging

from elasticd.coordination.api import Compacted, EventType, KeyValue, Unavailable, WatchEvent
from elasticd.rendezvous.grace import OutageGrace
from elasticd.rendezvous.control import AgentContext, Control
from elasticd.rendezvous.node_watch import NodeWatch
from elasticd.rendezvous.records import NodeRecord
from elasticd.testing.clock import FakeClock
from elasticd.testing.coordination import MemoryCoordinator

NATIVE = b"/r/native/"
PREFIX = NATIVE + b"nodes/"


def make(coord):
    distrusted, woken = [], []
    clock = FakeClock()
    watch = NodeWatch(AgentContext(coord, Control(NATIVE, clock), OutageGrace(), clock, "a",
                                   distrusted.append, lambda: woken.append(1)))
    return watch, distrusted, woken


def live(watch):
    with watch.counts() as tally:
        return sorted(tally.nodes)


def put(coord, node, target=0):
    coord.put(PREFIX + node.encode(), NodeRecord(node, target).encode())


def test_it_lists_once_then_counts_the_events_after_the_listing():
    coord = MemoryCoordinator()
    put(coord, "a")
    put(coord, "b")
    watch, distrusted, woken = make(coord)
    assert live(watch) == []  # nothing before the first refresh
    watch.refresh()
    assert live(watch) == ["a", "b"] and watch.events == 0
    put(coord, "c")
    coord.delete(PREFIX + b"a")
    assert live(watch) == ["b", "c"] and watch.events == 2 and len(woken) == 2
    # An event the listing already holds is not applied again.
    stale = KeyValue(PREFIX + b"z", NodeRecord("z", 0).encode(), 1, 1)
    watch.on_nodes([WatchEvent(EventType.PUT, stale)])
    assert live(watch) == ["b", "c"] and watch.events == 2
    watch.refresh()  # not asked: no listing
    assert distrusted == []
    watch.stop()


def test_a_bad_record_or_one_under_another_name_is_not_counted_and_logged_once(caplog):
    coord = MemoryCoordinator()
    coord.put(PREFIX + b"bad", b"{not json")
    coord.put(PREFIX + b"liar", NodeRecord("someone-else", 0).encode())
    watch, _, _ = make(coord)
    with caplog.at_level(logging.WARNING, logger="elasticd.rendezvous.handler"):
        watch.refresh()
        coord.put(PREFIX + b"bad", b"{still not json")
    assert live(watch) == []
    assert sum("refusing rendezvous node" in r.getMessage() for r in caplog.records) == 1
    watch.stop()


def test_a_watch_error_asks_for_a_listing_and_only_a_broken_watch_is_distrusted():
    coord = MemoryCoordinator()
    watch, distrusted, woken = make(coord)
    watch.refresh()
    watch.stop()  # events from here on are missed
    put(coord, "a")
    assert live(watch) == []
    watch.on_nodes(Compacted(5))
    assert distrusted == [] and len(woken) == 1
    watch.refresh()  # the events were lost: the listing brings them, and watches again
    assert live(watch) == ["a"]
    put(coord, "b")
    assert live(watch) == ["a", "b"]
    watch.on_nodes(Unavailable("etcd went away"))
    assert distrusted == ["rendezvous node watch: etcd went away"]
    watch.stop()


def test_what_it_remembers_of_bad_records_is_bounded(caplog):
    # Anyone who may write node records may write millions of bad ones: the closer remembers
    # a bounded number of the keys it warned about (the oldest forgotten first).
    coord = MemoryCoordinator()
    watch, _, _ = make(coord)
    watch._complaints.limit = 2
    watch.refresh()
    with caplog.at_level(logging.WARNING, logger="elasticd.rendezvous.handler"):
        for name in (b"bad1", b"bad2", b"bad3", b"bad1"):
            coord.put(PREFIX + name, b"{not json")
    refused = [r.getMessage().split()[3].rstrip(":") for r in caplog.records]
    assert refused == [(PREFIX + n).decode() for n in (b"bad1", b"bad2", b"bad3", b"bad1")]
    assert len(watch._complaints._seen) == 2
    watch.stop()


def test_the_control_copy_warns_once_a_bad_summary_and_remembers_a_bounded_number(caplog):
    control = Control(b"/r/native/", FakeClock())
    control._complaints.limit = 1
    with caplog.at_level(logging.WARNING, logger="elasticd.rendezvous.handler"):
        for value in (b"{bad", b"{still bad"):
            control.set(KeyValue(control.waiting_key, value, 1, 1))
        assert len(caplog.records) == 1 and control.waiting is None
        control._complaints.warn(b"other", b"", "another")  # pushes the summary's key out
        control.set(KeyValue(control.waiting_key, b"{bad", 1, 1))
    assert len(caplog.records) == 3
