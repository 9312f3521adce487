"""One contract, two implementations: the in-memory fake and a real etcd server.

Each scenario is written once in :class:`CoordinatorContract` and runs against both, so the fake
that the fast unit tests rely on cannot drift from etcd's behaviour: stale revisions, lost
leases, watches across a server restart, compaction, and corrupt values.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from elasticd.testing.clock import FakeClock
from elasticd.coordination import records
from elasticd.coordination.api import (
    Compacted,
    Compare,
    Delete,
    EventType,
    LeaseLost,
    Put,
    Unavailable,
)
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from tests.conftest import connect


class Collector:
    def __init__(self):
        self.items = []
        self.cv = threading.Condition()

    def __call__(self, batch):
        with self.cv:
            self.items.append(batch)
            self.cv.notify_all()

    def events(self):
        return [e for b in self.items if not isinstance(b, Exception) for e in b]

    def errors(self):
        return [b for b in self.items if isinstance(b, Exception)]

    def wait(self, pred, timeout=10):
        deadline = time.monotonic() + timeout
        with self.cv:
            while not pred(self):
                left = deadline - time.monotonic()
                assert left > 0, f"timed out; got {self.items}"
                self.cv.wait(left)


class CoordinatorContract:
    """Subclasses provide the fixtures ``coord`` and ``ctl`` (outage, expiry, compaction)."""

    def test_put_get_prefix_and_revisions(self, coord, prefix):
        p = prefix.encode()
        r1 = coord.put(p + b"/a", b"1")
        r2 = coord.put(p + b"/b", b"2")
        assert r2 > r1
        kv = coord.get(p + b"/a")
        assert (kv.value, kv.mod_revision, kv.create_revision, kv.version) == (b"1", r1, r1, 1)
        coord.put(p + b"/a", b"1b")
        kv = coord.get(p + b"/a")
        assert kv.version == 2 and kv.create_revision == r1 and kv.mod_revision > r2
        kvs, rev = coord.get_prefix(p + b"/")
        assert [k.key for k in kvs] == [p + b"/a", p + b"/b"] and rev >= kv.mod_revision
        assert coord.get(p + b"/nope") is None
        assert coord.delete(p + b"/a") and not coord.delete(p + b"/a")
        assert coord.delete_prefix(p + b"/") == 1

    def test_stale_revision_loses_compare_and_set(self, coord, prefix):
        key = (prefix + "/cas").encode()
        assert coord.create(key, b"v1")
        assert not coord.create(key, b"again")
        kv = coord.get(key)
        assert coord.compare_and_set(key, b"v2", kv.mod_revision)
        assert not coord.compare_and_set(key, b"v3", kv.mod_revision)  # stale
        assert coord.get(key).value == b"v2"
        ok, _ = coord.transaction([Compare(key, 0)], [Put(key, b"x")])
        assert not ok
        cur = coord.get(key).mod_revision
        ok, rev = coord.transaction([Compare(key, cur)], [Delete(key), Put(key + b"2", b"y")])
        assert ok and rev > cur
        assert coord.get(key) is None and coord.get(key + b"2").value == b"y"
        # Every change of one transaction has its revision (the commit protocol's fences
        # rely on it: a withdrawal's returned revision is its fence key's mod_revision).
        ok, rev = coord.transaction([], [Put(key + b"3", b"a"), Put(key + b"4", b"b")])
        assert ok and coord.get(key + b"3").mod_revision == coord.get(key + b"4").mod_revision == rev

    def test_create_revision_compare_fails_once_the_key_was_re_created(self, coord, prefix):
        # etcd's election recipe: a leader's write compares its key's create_revision.
        key, target = (prefix + "/leader").encode(), (prefix + "/guarded").encode()
        assert coord.create(key, b"me")
        created = coord.get(key).create_revision
        coord.put(key, b"me again")  # a rewrite keeps the create_revision
        ok, _ = coord.transaction([Compare(key, created, "create")], [Put(target, b"1")])
        assert ok and coord.get(target).value == b"1"
        coord.delete(key)
        assert coord.create(key, b"someone else")
        ok, _ = coord.transaction([Compare(key, created, "create")], [Put(target, b"2")])
        assert not ok and coord.get(target).value == b"1"
        with pytest.raises(ValueError, match="target"):
            Compare(key, 1, "version")

    def test_lease_compare_holds_only_while_the_key_is_bound_to_that_lease(self, coord, prefix):
        # A join record names its daemon's lease: written only while the daemon's record is
        # bound to it (elasticd/rendezvous/join.py). Absent key or no lease: compares as 0.
        key, target = (prefix + "/daemon").encode(), (prefix + "/named").encode()
        old, new = coord.grant_lease(30), coord.grant_lease(30)
        try:
            def write(lease: int, value: bytes) -> bool:
                return coord.transaction([Compare(key, lease, "lease")], [Put(target, value)])[0]

            assert not write(old, b"absent") and write(0, b"absent, as 0")
            coord.put(key, b"d", lease=old)
            assert write(old, b"1") and not write(new, b"x") and not write(0, b"x")
            coord.put(key, b"d", lease=new)  # re-registered under a new lease
            assert not write(old, b"x") and write(new, b"2")
            coord.put(key, b"d")  # no lease
            assert not write(new, b"x") and write(0, b"3")
            assert coord.get(target).value == b"3"
        finally:
            coord.revoke_lease(old)
            coord.revoke_lease(new)

    def test_lost_lease_deletes_keys_and_is_reported(self, coord, ctl, prefix):
        key = (prefix + "/leased").encode()
        lease = coord.grant_lease(2)
        assert coord.keep_alive(lease) >= 1
        coord.put(key, b"v", lease)
        assert coord.get(key).lease == lease
        ctl.let_leases_expire(2)
        with pytest.raises(LeaseLost):
            coord.keep_alive(lease)
        assert coord.get(key) is None
        with pytest.raises(LeaseLost):
            coord.put(key, b"v", lease)
        with pytest.raises(LeaseLost):
            coord.transaction([], [Put(key, b"v", lease)])
        coord.revoke_lease(lease)  # revoking a lost lease is not an error

    def test_revoke_deletes_bound_keys_with_prev_in_watch(self, coord, prefix):
        p = (prefix + "/w/").encode()
        got, plain = Collector(), Collector()
        start = coord.revision() + 1
        w = coord.watch_prefix(p, got, start, prev_kv=True)
        w2 = coord.watch_prefix(p, plain, start)
        try:
            lease = coord.grant_lease(10)
            coord.put(p + b"n", b"rec", lease)
            coord.revoke_lease(lease)
            got.wait(lambda c: len(c.events()) >= 2)
            put, delete = got.events()[:2]
            assert put.type is EventType.PUT and put.kv.value == b"rec"
            assert delete.type is EventType.DELETE and delete.prev.value == b"rec"
            assert delete.prev.lease == lease
            # Without prev_kv etcd reads no previous value (and the fake hands none).
            plain.wait(lambda c: len(c.events()) >= 2)
            assert [e.prev for e in plain.events()[:2]] == [None, None]
        finally:
            w.cancel()
            w2.cancel()

    def test_watch_key_sees_that_key_only(self, coord, prefix):
        key = (prefix + "/k/node").encode()
        got = Collector()
        w = coord.watch_key(key, got, coord.revision() + 1)
        try:
            coord.put(key + b"x", b"longer")  # under the key as a prefix: not the key
            coord.put(key, b"rec")
            coord.delete(key)
            got.wait(lambda c: len(c.events()) >= 2)
            assert [(e.type, e.kv.key) for e in got.events()] == [
                (EventType.PUT, key), (EventType.DELETE, key)]
        finally:
            w.cancel()

    def test_watch_replays_from_start_revision(self, coord, prefix):
        p = (prefix + "/r/").encode()
        r1 = coord.put(p + b"1", b"a")
        coord.put(p + b"2", b"b")
        got = Collector()
        w = coord.watch_prefix(p, got, r1)
        try:
            got.wait(lambda c: len(c.events()) >= 2)
            assert [e.kv.key for e in got.events()] == [p + b"1", p + b"2"]
        finally:
            w.cancel()

    def test_watch_after_reconnect(self, coord, ctl, prefix):
        p = (prefix + "/rc/").encode()
        got = Collector()
        w = coord.watch_prefix(p, got, coord.revision() + 1)
        try:
            coord.put(p + b"before", b"1")
            got.wait(lambda c: len(c.events()) >= 1)
            ctl.outage()
            with pytest.raises(Unavailable):
                coord.get(p + b"before")
            got.wait(lambda c: len(c.errors()) >= 1)
            ctl.restore()
            deadline = time.monotonic() + 10
            while True:
                try:
                    coord.put(p + b"after", b"2")
                    break
                except Unavailable:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            got.wait(lambda c: any(e.kv.key == p + b"after" for e in c.events()))
            keys = [e.kv.key for e in got.events()]
            assert keys.count(p + b"before") == 1  # nothing delivered twice
        finally:
            w.cancel()

    def test_compacted_start_revision(self, coord, ctl, prefix):
        p = (prefix + "/c/").encode()
        r1 = coord.put(p + b"1", b"a")
        r2 = coord.put(p + b"1", b"b")
        ctl.compact(r2)
        got = Collector()
        w = coord.watch_prefix(p, got, r1)
        try:
            # Like etcd, the fake reports compaction to the callback, then keeps watching.
            got.wait(lambda c: any(isinstance(e, Compacted) for e in c.errors()))
            coord.put(p + b"2", b"c")
            got.wait(lambda c: any(e.kv.key == p + b"2" for e in c.events()))
        finally:
            w.cancel()

    def test_corrupt_value_is_refused_clearly(self, coord, prefix):
        key = (prefix + "/nodes/x").encode()
        coord.put(key, b"\x80not json")
        with pytest.raises(records.CorruptRecord, match="not a valid record"):
            records.decode(coord.get(key).value, "node", key)
        coord.put(key, records.encode("event", {"a": 1}))
        with pytest.raises(records.CorruptRecord, match="expected a 'node' record"):
            records.decode(coord.get(key).value, "node", key)
        coord.put(key, b'{"schema": 99, "record": "node"}')
        with pytest.raises(records.UnsupportedRecordVersion, match="upgrade elasticd"):
            records.decode(coord.get(key).value, "node", key)


class MemoryControls:
    def __init__(self, store: MemoryStore, clock: FakeClock):
        self.store, self.clock = store, clock

    def let_leases_expire(self, ttl):
        self.clock.advance(ttl + 0.1)
        self.store.expire_leases()

    def outage(self):
        self.store.set_available(False)

    def restore(self):
        self.store.set_available(True)

    def compact(self, revision):
        self.store.compact(revision)


class TestMemoryCoordinator(CoordinatorContract):
    @pytest.fixture
    def ctl(self):
        clock = FakeClock()
        return MemoryControls(MemoryStore(clock), clock)

    @pytest.fixture
    def coord(self, ctl):
        c = MemoryCoordinator(ctl.store)
        yield c
        c.close()


class EtcdControls:
    def __init__(self, server):
        self.server = server

    def let_leases_expire(self, ttl):
        time.sleep(ttl + 1.0)  # etcd checks expiry every 500 ms (docs/facts.md)

    def outage(self):
        self.server.members[0].kill()

    def restore(self):
        self.server.members[0].start()
        self.server.wait_healthy()

    def compact(self, revision):
        import pyetcd

        c = pyetcd.MultiEndpointEtcd3Client(
            [pyetcd.Endpoint("127.0.0.1", self.server.members[0].client_port, secure=False,
                             time_retry=0.5)], timeout=2, failover=True)
        try:
            c.compact(revision, physical=True)
        finally:
            c.close()


@pytest.mark.etcd
@pytest.mark.timeout(60)
class TestEtcdCoordinator(CoordinatorContract):
    @pytest.fixture
    def ctl(self, private_etcd):
        return EtcdControls(private_etcd)

    @pytest.fixture
    def coord(self, private_etcd):
        c = connect(private_etcd)
        yield c
        c.close()


@pytest.mark.etcd
@pytest.mark.timeout(60)
def test_late_watch_creation_answer_never_feeds_another_prefix(private_etcd, prefix):
    """pyetcd binds a "created" answer to whichever watch is being created at that moment: a
    creation that timed out on the client (a frozen or overloaded etcd) is answered late and
    handed to the next watch on the same stream, which then got the other prefix's events
    (seen at N = 1,000: the node watch received a checkpoint key). No callback may ever see a
    key outside its own prefix, and each watch must still get its own events."""
    coord = connect(private_etcd, timeout=0.3)
    p = prefix.encode()
    coord.put(p + b"/a/k", b"1")
    coord.put(p + b"/b/k", b"2")
    a, b = Collector(), Collector()
    member = private_etcd.members[0]
    member.signal(signal.SIGSTOP)
    try:
        # A's creation times out (twice) and goes on in A's own thread; B's queues behind it.
        coord.watch_prefix(p + b"/a/", a, 1)
        creating_b = threading.Thread(target=coord.watch_prefix, args=(p + b"/b/", b, 1))
        creating_b.start()
        time.sleep(1.0)
    finally:
        member.signal(signal.SIGCONT)
    try:
        creating_b.join(20)
        a.wait(lambda c: any(e.kv.key == p + b"/a/k" for e in c.events()), timeout=20)
        b.wait(lambda c: any(e.kv.key == p + b"/b/k" for e in c.events()), timeout=20)
        time.sleep(0.5)  # any further mis-bound event would arrive now
        assert [e.kv.key for e in a.events() if not e.kv.key.startswith(p + b"/a/")] == []
        assert [e.kv.key for e in b.events() if not e.kv.key.startswith(p + b"/b/")] == []
    finally:
        coord.close()
