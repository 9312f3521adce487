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
from elasticd.rendezvous.failures import mark_key, mark_prefix
from elasticd.rendezvous.records import NodeRecord, RoundRecord
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
    watch.follow()
    assert live(watch) == ["a", "b"] and watch.events == 0
    put(coord, "c")
    coord.delete(PREFIX + b"a")
    assert live(watch) == ["b", "c"] and watch.events == 2 and len(woken) == 2
    # An event the listing already holds is not applied again.
    stale = KeyValue(PREFIX + b"z", NodeRecord("z", 0).encode(), 1, 1)
    watch.on_nodes([WatchEvent(EventType.PUT, stale)])
    assert live(watch) == ["b", "c"] and watch.events == 2
    watch.refresh()  # not asked: no listing
    watch.follow()  # nor watches
    assert distrusted == []
    watch.stop()


def test_a_bad_record_or_one_under_another_name_is_not_counted_and_logged_once(caplog):
    coord = MemoryCoordinator()
    coord.put(PREFIX + b"bad", b"{not json")
    coord.put(PREFIX + b"liar", NodeRecord("someone-else", 0).encode())
    watch, _, _ = make(coord)
    with caplog.at_level(logging.WARNING, logger="elasticd.rendezvous.handler"):
        watch.refresh()
        watch.follow()
        coord.put(PREFIX + b"bad", b"{still not json")
    assert live(watch) == []
    assert sum("refusing rendezvous node" in r.getMessage() for r in caplog.records) == 1
    watch.stop()


def test_a_watch_error_asks_for_a_listing_and_only_a_broken_watch_is_distrusted():
    coord = MemoryCoordinator()
    watch, distrusted, woken = make(coord)
    watch.refresh()
    watch.follow()
    watch.stop()  # events from here on are missed
    put(coord, "a")
    assert live(watch) == []
    watch.on_nodes(Compacted(5))
    assert distrusted == [] and len(woken) == 1
    watch.refresh()  # the events were lost: the listing brings them, and watches again
    watch.follow()
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
    watch.follow()
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


# -- the failure marks (elasticd/rendezvous/failures.py), followed beside the records -------

def closer_on(coord, clock, woken):
    """A closer of round 0 (members a, b, c) holding the election key, on ``coord``."""
    from elasticd.rendezvous.closer import Closer
    from elasticd.rendezvous.config import HandlerSettings

    control = Control(NATIVE, clock)
    coord.put(control.round_key, RoundRecord(0, ("a", "b", "c")).encode())
    election = coord.put(control.closer_key, b"a")
    for kv in coord.get_prefix(control.round_key)[0]:
        control.set(kv)
    agent = AgentContext(coord, control, OutageGrace(), clock, "a", lambda _: None,
                         lambda: woken.append(1))
    return Closer(agent, election, HandlerSettings("job", 2, 3, liveness_confirm=60.0)), control


def record(coord, node, target, lease):
    coord.put(PREFIX + node.encode(), NodeRecord(node, target, daemon="d" + node,
                                                 daemon_lease=lease).encode())


def test_the_round_closes_at_the_mark_before_its_writer_deletes_the_dead_members_record():
    # Issue 31: the survivors rejoined at the failure; the dead member's record stays until
    # the mark's writer lists the rendezvous and deletes it (a listing and a write after the
    # mark; the old closer closed only then). The mark alone drops it now.
    coord, clock, woken = MemoryCoordinator(), FakeClock(), []
    closer, control = closer_on(coord, clock, woken)
    record(coord, "a", 1, 0xa1)
    record(coord, "b", 0, 0xb1)  # dead, its record still there
    record(coord, "c", 1, 0xc1)
    closer.step(trusted=True)
    assert control.round.round == 0  # b still counts as training
    coord.create(mark_key(NATIVE, "db", 0xb0), b"{}")  # another lease of b's node: no news
    closer.step(trusted=True)
    assert control.round.round == 0
    woken.clear()
    coord.create(mark_key(NATIVE, "db", 0xb1), b'{"v":2,"members":[]}')
    assert woken  # the duty steps at the mark's event, not at a poll
    closer.step(trusted=True)
    assert control.round.round == 1 and control.round.members == ("a", "c")
    assert coord.get(PREFIX + b"b") is not None  # closed before any delete
    closer.stop()


def test_a_mark_after_the_record_expired_ends_the_wait_at_once_and_nothing_is_polled():
    # The other order (the record expired first). The old closer listed the marks at every
    # step while a member was absent, and stepped every 20 ms for it (MARK_POLL).
    coord, clock, woken = MemoryCoordinator(), FakeClock(), []
    closer, control = closer_on(coord, clock, woken)
    for node, target, lease in (("a", 0, 0xa1), ("b", 0, 0xb1), ("c", 0, 0xc1)):
        record(coord, node, target, lease)
    closer.step(trusted=True)
    listings = []
    get_prefix = coord.get_prefix
    coord.get_prefix = lambda prefix: listings.append(prefix) or get_prefix(prefix)
    coord.delete(PREFIX + b"b")
    clock.advance(0.5)
    due = closer.step(trusted=True)
    assert due == clock.monotonic() - 0.5 + 60.0  # b's confirmation: no poll before it
    assert listings == [] and control.waiting is None  # nobody dead: no summary
    woken.clear()
    coord.create(mark_key(NATIVE, "db", 0xb1), b'{"v":2,"members":[]}')
    assert woken
    closer.step(trusted=True)  # same moment: nothing waited out
    assert control.waiting.dead == ("b",) and listings == []
    closer.stop()


def test_a_mark_that_does_not_read_is_nobodys_and_a_mark_gone_is_forgotten():
    coord = MemoryCoordinator()
    watch, _, woken = make(coord)
    watch.refresh()
    watch.follow()
    coord.put(PREFIX + b"b", NodeRecord("b", 0, daemon="db", daemon_lease=0xb1).encode())
    coord.put(mark_prefix(NATIVE) + b"db@zz", b"{}")  # not a lease
    coord.put(mark_prefix(NATIVE) + b"db@0b1", b"{}")  # not how a mark is spelled
    assert live(watch) == ["b"]
    coord.put(mark_key(NATIVE, "db", 0xb1), b"{}")
    assert live(watch) == []
    coord.delete(mark_key(NATIVE, "db", 0xb1))
    with watch.counts() as tally:
        assert tally.marks == {}
    # b writes again (after the mark): counted again
    coord.put(PREFIX + b"b", NodeRecord("b", 1, daemon="db", daemon_lease=0xb1).encode())
    assert live(watch) == ["b"]
    watch.stop()


def test_a_new_closer_closes_a_closable_round_before_it_creates_its_watches():
    # A closer's takeover: the old closer's lease expired with its record, every survivor
    # rejoined; the new closer's listing holds a round it may close. It used to create its
    # two watches (two round trips each on etcd) before its first close attempt.
    coord, clock, woken = MemoryCoordinator(), FakeClock(), []
    closer, control = closer_on(coord, clock, woken)
    for node, lease in (("a", 0xa1), ("b", 0xb1), ("c", 0xc1)):
        record(coord, node, 1, lease)
    calls = []
    watch_prefix, transaction = coord.watch_prefix, coord.transaction

    def txn(compares, ops):
        calls.append("txn")
        out = transaction(compares, ops)
        if calls.count("txn") == 1:  # after the listing, before the watches: not missed
            record(coord, "d", 2, 0xd1)
        return out

    coord.watch_prefix = lambda *args: calls.append("watch") or watch_prefix(*args)
    coord.transaction = txn
    closer.step(trusted=True)
    assert control.round.round == 1 and control.round.members == ("a", "b", "c")
    assert calls[0] == "txn" and calls.count("watch") == 2
    with closer.nodes.counts() as tally:
        assert tally.nodes["d"].target == 2
    record(coord, "e", 2, 0xe1)  # and followed from then on
    with closer.nodes.counts() as tally:
        assert sorted(tally.nodes) == ["a", "b", "c", "d", "e"]
    closer.stop()
