"""The lease keeper replaces a lease a caller found gone before its own keep-alive did."""

from __future__ import annotations

from elasticd.testing.clock import FakeClock
from elasticd.coordination.api import LeaseLost
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.lease import LeaseKeeper
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore


def _keeper() -> tuple[MemoryStore, MemoryCoordinator, LeaseKeeper, list[str]]:
    clock = FakeClock()
    store = MemoryStore(clock)
    coord = MemoryCoordinator(store)
    changes: list[str] = []
    keeper = LeaseKeeper(coord, 2, EtcdHealth(clock), on_change=lambda: changes.append("x"),
                         clock=clock)
    return store, coord, keeper, changes


def test_a_lease_etcd_lost_is_replaced_at_the_callers_request():
    store, coord, keeper, changes = _keeper()
    old = keeper.grant()
    store.wipe()  # etcd restarted empty: every lease is gone
    try:
        coord.put(b"k", b"v", lease=old)
    except LeaseLost:
        pass
    else:
        raise AssertionError("the memory store kept a wiped lease")
    new = keeper.replace(old)
    assert new != old and keeper.lease == new
    assert coord.put(b"k", b"v", lease=new) > 0
    assert keeper.take_lost() == [old]
    assert changes == ["x"]  # the owner re-writes what it held under the old lease


def test_replacing_an_already_replaced_lease_grants_nothing_more():
    store, _, keeper, changes = _keeper()
    old = keeper.grant()
    store.wipe()
    first = keeper.replace(old)
    assert keeper.replace(old) == first  # a second caller with the same stale id
    assert keeper.take_lost() == [old] and changes == ["x"]


def test_put_under_a_lease_etcd_lost_replaces_the_lease_and_writes():
    store, coord, keeper, changes = _keeper()
    old = keeper.grant()
    store.wipe()
    keeper.put(b"node", b"record")  # raised LeaseLost before
    kv = coord.get(b"node")
    assert kv is not None and kv.value == b"record" and kv.lease == keeper.lease != old
    assert changes == ["x"]
