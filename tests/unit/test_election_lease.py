"""A commit coordinator's term keeps its election lease alive every TTL/3 and ends when the lease
is lost, or when no keep-alive got through for a whole TTL (etcd unreachable: the key may be
gone already and another node coordinating)."""

from __future__ import annotations

from elasticd.coordination.api import CoordinationError, LeaseLost
from elasticd.coordination.keys import Keyspace
from elasticd.replication.coordinator import ElectionLease, JobCoordinator
from elasticd.replication.election import Coordinatorship
from elasticd.replication.placement import compute_placement
from elasticd.replication.tally import Tally
from elasticd.testing.clock import FakeClock
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore


class Coord:
    """Counts keep-alives; raises what it is told to."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.fail: Exception | None = None

    def keep_alive(self, lease: int) -> float:
        self.calls.append(lease)
        if self.fail is not None:
            raise self.fail
        return 6.0


def test_the_lease_is_refreshed_every_third_of_its_ttl():
    coord = Coord()
    lease = ElectionLease(coord, 7, ttl=6.0, now=100.0)
    assert lease.keep(101.9) is None and coord.calls == []
    assert lease.keep(102.0) is None and coord.calls == [7]
    assert lease.keep(103.9) is None and coord.calls == [7]  # counted from the last refresh
    assert lease.keep(104.0) is None and coord.calls == [7, 7]


def test_a_lost_lease_ends_the_term_at_once():
    coord = Coord()
    lease = ElectionLease(coord, 7, ttl=6.0, now=100.0)
    coord.fail = LeaseLost("lease 7 not found")
    assert lease.keep(102.0) == "its election lease expired"


def test_etcd_unreachable_ends_the_term_only_after_a_whole_ttl():
    coord = Coord()
    lease = ElectionLease(coord, 7, ttl=6.0, now=100.0)
    coord.fail = CoordinationError("etcd unreachable")
    assert lease.keep(102.0) is None  # tried, failed, still within the TTL
    assert lease.keep(106.0) is None
    assert lease.keep(106.1) == "its election lease could not be kept alive (etcd unreachable)"
    coord.fail = None  # had it got through in time, the term would have gone on
    lease = ElectionLease(coord, 7, ttl=6.0, now=100.0)
    assert lease.keep(105.0) is None and lease.keep(110.9) is None


def test_a_term_whose_lease_expired_ends_and_says_why():
    """Through the coordinator itself: its tick keeps the real (in-memory) lease alive while
    it lives; once etcd dropped it, the term ends once, with the reason."""
    clock = FakeClock()
    coord = MemoryCoordinator(MemoryStore(clock))
    lease = coord.grant_lease(6)
    placement = compute_placement(("n0", "n1"), {"n0": [0], "n1": [1]}, 2, round=1)
    ended: list[str] = []
    term = JobCoordinator("n0", "j", coord, Keyspace("/t"), clock, Coordinatorship("n0", 1, 1),
                          lease, 6.0, Tally(1, 1, placement), on_commit=lambda c: None,
                          on_end=ended.append, wake=lambda: None)
    for _ in range(5):  # 10 s of ticks every 2 s outlive the 6 s lease only if kept alive
        clock.advance(2.0)
        term.tick()
    assert ended == [] and not term.ended
    coord.revoke_lease(lease)
    clock.advance(2.0)
    term.tick()
    term.tick()
    assert ended == ["its election lease expired"] and term.ended
