"""The daemon's watch on its peers' records, alone: listing, watching, bad records, the flags it
raises (a stale view, this node's own record gone)."""

from __future__ import annotations

import logging

from elasticd.cluster.membership import Membership, NodeRecord, ObservationKind
from elasticd.coordination.api import CoordinationError
from elasticd.coordination.keys import Keyspace
from elasticd.daemon.peer_watch import PeerWatch
from elasticd.testing.clock import FakeClock
from elasticd.testing.coordination import MemoryCoordinator

KEYS = Keyspace("/t")


def rec(node, lease=1):
    return NodeRecord(node=node, state="up", address="a", hostname="h", pid=1, incarnation="i",
                      started_at=0.0, heartbeat_at=100.0, version="0", lease=lease)


def make(coord, node="me"):
    woken = []
    watch = PeerWatch(node, coord, KEYS, Membership(node, 5), FakeClock(),
                      wake=lambda: woken.append(1))
    return watch, woken


def kinds(obs):
    return sorted((o.kind, o.node) for o in obs)


def test_lists_then_follows_puts_and_deletes():
    coord = MemoryCoordinator()
    coord.put(KEYS.node("a"), rec("a").encode())
    watch, woken = make(coord)
    assert kinds(watch.start()) == [(ObservationKind.JOINED, "a")]
    coord.put(KEYS.node("b"), rec("b").encode())
    coord.delete(KEYS.node("a"))
    assert woken and not watch.empty()
    obs = watch.take(now=10.0, cut_off=False, leaving=False)
    assert kinds(obs) == [(ObservationKind.FAILED, "a"), (ObservationKind.JOINED, "b")]
    assert watch.empty() and not watch.stale and not watch.own_record_gone
    watch.close()


def test_a_bad_record_is_ignored_and_logged_once(caplog):
    coord = MemoryCoordinator()
    coord.put(KEYS.node("a"), b"{not json")
    watch, _ = make(coord)
    with caplog.at_level(logging.WARNING):
        assert watch.start() == []
        recs, _ = watch.list()
    assert recs == []
    assert sum("ignoring node record" in r.getMessage() for r in caplog.records) == 1
    watch.close()


def test_own_record_deleted_raises_its_flag_unless_leaving():
    coord = MemoryCoordinator()
    coord.put(KEYS.node("me"), rec("me").encode())
    watch, _ = make(coord)
    watch.start()
    coord.delete(KEYS.node("me"))
    watch.take(now=1.0, cut_off=False, leaving=True)
    assert not watch.own_record_gone
    coord.put(KEYS.node("me"), rec("me").encode())
    coord.delete(KEYS.node("me"))
    watch.take(now=2.0, cut_off=False, leaving=False)
    assert watch.own_record_gone
    watch.close()


def test_a_broken_watch_marks_the_view_stale_until_a_reset():
    coord = MemoryCoordinator()
    watch, _ = make(coord)
    watch.start()
    watch._feed.put(CoordinationError("watch broke"))
    assert watch.take(now=1.0, cut_off=False, leaving=False) == []
    assert watch.stale
    coord.put(KEYS.node("a"), rec("a").encode())
    recs, revision = watch.list()
    assert [r.node for r in recs] == ["a"] and revision > 0
    assert kinds(watch.reset(recs, now=2.0, cut_off=False)) == [(ObservationKind.JOINED, "a")]
    assert not watch.stale
    watch.close()
