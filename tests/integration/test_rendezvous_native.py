"""Contract of elasticd's own rendezvous handler: what torch's elastic agent relies on.

Each test runs on the in-memory fake Coordinator and on the real etcd (the ``etcd`` fixture).
Several handlers in one process stand for the agents of several nodes; each has its own
connection, lease and watch. "A node dies" is its handler stopping without closing the
rendezvous: its lease is revoked, as etcd does TTL seconds after kill -9 (one test waits for a
real expiry). The agent calls are those of ``torch/distributed/elastic/agent/server/api.py``:
``next_rendezvous`` (then the store), ``num_nodes_waiting`` while workers train,
``is_closed``/``set_closed``, ``get_run_id``, ``use_agent_store`` and ``shutdown``.
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid

import pytest
from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from elasticd.coordination.api import Unavailable
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace
from elasticd.daemon.rdzv_marks import mark_failed
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.coordination.rendezvous import BACKEND_NAME
from elasticd.rendezvous.failures import mark_key, marked_members
from elasticd.rendezvous.handler import EtcdNativeRendezvousHandler, create_handler
from elasticd.rendezvous.records import NodeRecord, RoundRecord

TIMEOUT = 20.0


class Cluster:
    """Makes handlers ("nodes") of one rendezvous on one backend, and stops them all."""

    def __init__(self, kind: str, server: object | None, prefix: str) -> None:
        self.kind, self.server, self.prefix = kind, server, prefix
        self.store = MemoryStore()
        self.run_id = f"r-{uuid.uuid4().hex[:8]}"
        self.handlers: list[EtcdNativeRendezvousHandler] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(16)

    def connect(self):
        if self.kind == "memory":
            return MemoryCoordinator(self.store)
        return EtcdCoordinator(EtcdSettings(parse_endpoints(self.server.endpoints), timeout=1.0))

    def node(self, min_nodes: int, max_nodes: int, **conf: str) -> EtcdNativeRendezvousHandler:
        conf = {"key_prefix": self.prefix, "join_timeout": "30", "last_call_timeout": "0.5",
                "liveness_ttl": "2", "liveness_confirm": "0.5", **conf}
        params = RendezvousParameters(BACKEND_NAME, "127.0.0.1:1", self.run_id,
                                      min_nodes, max_nodes, local_addr="127.0.0.1", **conf)
        handler = create_handler(params, BACKEND_NAME, coordinator=self.connect())
        self.handlers.append(handler)
        return handler

    def join(self, *handlers):
        """Starts next_rendezvous on each handler in a thread; returns the futures."""
        return [self.pool.submit(h.next_rendezvous) for h in handlers]

    def close(self) -> None:
        for h in self.handlers:
            h.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for h in self.handlers:
            h.coordinator.close()


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
def cluster(request, prefix):
    server = request.getfixturevalue("etcd") if request.param == "etcd" else None
    c = Cluster(request.param, server, prefix)
    try:
        yield c
    finally:
        c.close()


def wait_until(predicate, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.02)


def results(futures):
    return [f.result(timeout=TIMEOUT) for f in futures]


def sees_outsiders(handler, count: int = 1) -> bool:
    """Whether ``handler``'s copy of the closer's summary counts ``count`` outsiders."""
    waiting = handler._control.waiting
    return waiting is not None and waiting.outsiders >= count


def has_record(handler, of) -> bool:
    """Whether ``of``'s join record is in etcd, read through ``handler``'s connection."""
    return handler.coordinator.get(of._join.key) is not None


def test_two_nodes_meet_share_a_store_and_learn_the_workers_bootstrap_address(cluster):
    a, b = cluster.node(2, 2), cluster.node(2, 2)
    assert a.get_backend() == BACKEND_NAME and a.get_run_id() == cluster.run_id
    assert a.use_agent_store is False and a.me != b.me
    ia, ib = results(cluster.join(a, b))
    assert sorted([ia.rank, ib.rank]) == [0, 1] and ia.world_size == ib.world_size == 2
    ia.store.set("k", b"from-a")
    assert ib.store.get("k") == b"from-a"
    assert ia.bootstrap_store_info == ib.bootstrap_store_info
    assert ia.bootstrap_store_info.master_addr == "127.0.0.1"
    assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0
    assert not a.is_closed()


def test_set_closed_reaches_every_node_and_refuses_new_rounds(cluster):
    a, b = cluster.node(1, 2), cluster.node(1, 2)
    results(cluster.join(a, b))
    a.set_closed()
    wait_until(b.is_closed, "b sees the rendezvous closed")
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()
    late = cluster.node(1, 2)
    assert late.is_closed()
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()


def test_a_newcomer_is_waiting_and_the_regrown_round_keeps_the_survivors_ranks(cluster):
    a, b = cluster.node(2, 3), cluster.node(2, 3)
    first = {h.me: i.rank for h, i in zip((a, b), results(cluster.join(a, b)))}
    c = cluster.node(2, 3)
    pending = cluster.join(c)
    wait_until(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1,
               "members see the newcomer waiting")
    infos = results(cluster.join(a, b) + pending)
    ranks = {h.me: i.rank for h, i in zip((a, b, c), infos)}
    assert [i.world_size for i in infos] == [3, 3, 3]
    assert ranks[c.me] == 2 and {ranks[a.me], ranks[b.me]} == {0, 1}
    assert (ranks[a.me] < ranks[b.me]) == (first[a.me] < first[b.me])
    assert a.num_nodes_waiting() == 0


def test_a_spare_waits_silently_then_replaces_a_dead_member(cluster):
    nodes = [cluster.node(2, 2) for _ in range(3)]
    futures = cluster.join(*nodes)
    done, pending = concurrent.futures.wait(futures, timeout=TIMEOUT,
                                            return_when=concurrent.futures.FIRST_COMPLETED)
    wait_until(lambda: sum(f.done() for f in futures) == 2, "two nodes form the round")
    members = [h for h, f in zip(nodes, futures) if f.done()]
    [spare] = [h for h, f in zip(nodes, futures) if not f.done()]
    for h in members:
        assert h.num_nodes_waiting() == 0  # a full round's spare is no reason to restart
    by_rank = sorted(members, key=lambda h: futures[nodes.index(h)].result().rank)
    by_rank[0].stop()  # rank 0 dies
    survivor = by_rank[1]
    info = results(cluster.join(survivor))[0]
    assert info.rank == 1 and info.world_size == 2  # the survivor keeps its rank ...
    spare_info = futures[nodes.index(spare)].result(timeout=TIMEOUT)
    assert spare_info.rank == 0 and spare_info.world_size == 2  # ... the spare takes rank 0


def test_after_a_failure_the_round_closes_once_every_live_node_joined_without_last_call(
        cluster):
    # Below max, a job's first round would wait out the 60 s last call (longer than this
    # test's timeouts); after a failure the survivors are all there is.
    nodes = [cluster.node(1, 3, last_call_timeout="60") for _ in range(3)]
    results(cluster.join(*nodes))  # max reached: closes at once
    nodes[1].stop()
    infos = results(cluster.join(nodes[0], nodes[2]))
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}


def test_a_spare_joining_during_a_failure_neither_hangs_nor_kills_the_job(cluster):
    nodes = [cluster.node(2, 3) for _ in range(3)]
    results(cluster.join(*nodes))
    nodes[2].stop()  # a member dies ...
    late = cluster.node(2, 3)
    # ... and the survivors come back while a new node arrives.
    futures = cluster.join(nodes[0], nodes[1], late)
    done, _ = concurrent.futures.wait(futures[:2], timeout=TIMEOUT)
    assert len(done) == 2
    infos = [f.result() for f in futures[:2]]
    # The new node made that round (its answer may come a moment after the others': CI once
    # took it for a miss and waited for a waiting node that never came), or missed it and
    # waits, with room.
    wait_until(lambda: futures[2].done() or nodes[0].num_nodes_waiting() == 1,
               "the late node is in the round or waiting")
    if not futures[2].done():
        infos = results(cluster.join(nodes[0], nodes[1]))
    infos.append(futures[2].result(timeout=TIMEOUT))
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}


def test_a_member_that_restarts_alone_makes_the_others_re_rendezvous(cluster):
    a, b = cluster.node(2, 2), cluster.node(2, 2)
    results(cluster.join(a, b))
    pending = cluster.join(a)  # a's workers failed: it re-rendezvous, b's still run
    wait_until(lambda: b.num_nodes_waiting() == 1, "b sees a waiting")
    infos = results(cluster.join(b) + pending)
    assert sorted(i.rank for i in infos) == [0, 1]


def test_a_member_fenced_after_the_round_closed_ends_the_others_rank_assignment_at_once(
        cluster):
    # CI: a SIGSTOPped daemon's agent joined a round, then fenced itself before writing
    # torch's rank assignment (its agent was rank 0); the others waited the store's 60 s.
    a, b, c = cluster.node(2, 3), cluster.node(2, 3), cluster.node(2, 3)
    infos = dict(zip((a, b, c), results(cluster.join(a, b, c))))
    rank0 = next(h for h, i in infos.items() if i.rank == 0)
    waiter = next(h for h in (a, b, c) if h is not rank0)
    rank0.stop()  # the fence revokes the agent's lease: its record goes
    started = time.monotonic()
    with pytest.raises(DistStoreError, match="left the rendezvous"):
        infos[waiter].store.get("torchelastic/assigned_ranks/1")
    took = time.monotonic() - started
    assert took < 10, took  # confirm (0.5 s) and a poll, not the store's 60 s timeout
    # the survivors then meet in a new round without it
    rest = [h for h in (a, b, c) if h is not rank0]
    assert [i.world_size for i in results(cluster.join(*rest))] == [2, 2]


def test_the_join_gate_runs_before_the_node_record_is_written(cluster):
    a = cluster.node(1, 1)
    seen = []
    a.join_gate = lambda: seen.append(has_record(a, a))
    results(cluster.join(a))
    assert seen == [False]
    # and the round's moments say so, in order (the in-process timeline reports them)
    m = a.moments
    assert m["called"] <= m["gated"] <= m["joined"] <= m["returned"]


def test_shutdown_removes_the_node_and_closes_unless_failing_and_restartable(cluster):
    a, b = cluster.node(1, 2), cluster.node(1, 2, close_on_failure="false")
    results(cluster.join(a, b))
    try:
        raise RuntimeError("the agent fails")
    except RuntimeError:
        assert b.shutdown() is True
    wait_until(lambda: not has_record(a, b), "b's record is gone")
    assert not a.is_closed()
    assert a.shutdown() is True
    watcher = cluster.node(1, 2)
    assert watcher.is_closed()


def test_join_timeout_and_a_foreign_round_record_are_reported(cluster):
    lonely = cluster.node(2, 2, join_timeout="1")
    with pytest.raises(RendezvousTimeoutError, match="join_timeout"):
        lonely.next_rendezvous()
    lonely.stop()
    bad = cluster.node(1, 1)
    coord = cluster.connect()
    try:
        coord.put(bad._control.round_key, b"\x80\x04pickle")
        with pytest.raises(RendezvousStateError, match="not JSON"):
            bad.next_rendezvous()
    finally:
        coord.close()


@pytest.mark.etcd
def test_a_killed_node_leaves_when_its_lease_expires(etcd, prefix):
    cluster = Cluster("etcd", etcd, prefix)
    try:
        a, b = cluster.node(1, 2), cluster.node(1, 2)
        results(cluster.join(a, b))
        b._keeper.stop(revoke=False)  # kill -9: no more keep-alives, nothing revoked
        b._control_watch.stop()
        wait_until(lambda: a.gone_members() == [b.me], "b counted as gone after its TTL")
        info = results(cluster.join(a))[0]
        assert info.world_size == 1
    finally:
        cluster.close()


def test_a_member_whose_node_the_daemons_recorded_failed_is_gone_without_liveness_confirm(
        cluster):
    # Issue 31 (docs/in-process-design.md 4.2). liveness_confirm is 60 s: before the rule
    # only its end made the dead member gone, far past this test's timeouts.
    keys = Keyspace(cluster.prefix)
    a, b, c = (cluster.node(1, 3, liveness_confirm="60") for _ in range(3))
    for h, name in ((a, "na"), (b, "nb"), (c, "nc")):
        h.daemon_of = lambda name=name: (name, 0xb0 + len(name))
    results(cluster.join(a, b, c))
    assert NodeRecord.decode(a.coordinator.get(b._join.key).value).daemon == "nb"
    # b dies (kill -9: no revoke). A failure of another lease of its node (an old one) is no
    # news about this record: it stays, and b is not gone.
    b._keeper.stop(revoke=False)
    b._control_watch.stop()
    b._duty.stop()  # dead: if it was the closer, it closes nothing more
    mark_failed(a.coordinator, keys, cluster.run_id, "nb", 0x1, "na", None, 0.0)
    assert has_record(a, b) and a.gone_members() == []
    # The daemons record b's node failed before its rendezvous lease expires: its record is
    # deleted with the mark, and it is gone at once, for every member.
    assert mark_failed(a.coordinator, keys, cluster.run_id, "nb", 0xb2, "na", None, 0.0) == 1
    assert not has_record(a, b)
    wait_until(lambda: a.gone_members() == c.gone_members() == [b.me], "b gone for a and c")
    infos = results(cluster.join(a, c))
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    # c merely silent (its record gone, no mark): not gone while liveness_confirm runs
    c.stop()
    time.sleep(1.0)
    assert a.gone_members() == []


def test_a_join_record_names_the_lease_its_daemons_record_holds_when_written(cluster):
    # Issue 31: the agent names its daemon's lease as its watch on the daemon's record last
    # saw it (no read per join); the write compares that lease with the record's. A view gone
    # stale (the daemon re-granted its lease) is read and replaced, so that the daemons' mark
    # of the lease the daemon holds still dooms the record.
    keys = Keyspace(cluster.prefix)
    a, b = (cluster.node(1, 2, liveness_confirm="60") for _ in range(2))
    old, new = a.coordinator.grant_lease(30), a.coordinator.grant_lease(30)
    daemon = keys.node("nb")
    a.coordinator.put(daemon, b"{}", lease=old)
    b.daemon_of, b.daemon_key = (lambda: ("nb", old)), daemon
    reads, get = [], b.coordinator.get
    b.coordinator.get = lambda key, *args, **kw: reads.append(key) or get(key, *args, **kw)

    def named() -> int:
        return NodeRecord.decode(a.coordinator.get(b._join.key).value).daemon_lease

    results(cluster.join(a, b))
    assert named() == old and daemon not in reads  # the view holds: no read
    a.coordinator.put(daemon, b"{}", lease=new)  # re-registered; b's view is stale
    results(cluster.join(a, b))
    assert named() == new and reads.count(daemon) == 1
    assert mark_failed(a.coordinator, keys, cluster.run_id, "nb", new, "na", None, 0.0) == 1
    assert not has_record(a, b)
    a.coordinator.revoke_lease(old)
    a.coordinator.revoke_lease(new)


def test_when_the_failed_member_was_the_closer_its_key_goes_with_its_record(cluster):
    # The closer's key is bound to its agent's lease (30 s here): before, nobody closed the
    # survivors' round until that lease expired.
    nodes = [cluster.node(1, 3, liveness_confirm="60", liveness_ttl="30") for _ in range(3)]
    for i, h in enumerate(nodes):
        h.daemon_of = lambda i=i: (f"n{i}", 0xc0 + i)
    results(cluster.join(*nodes))
    wait_until(lambda: nodes[0]._control.closer_node() is not None, "a closer")
    [closer] = [h for h in nodes if h.me == nodes[0]._control.closer_node()]
    rest = [h for h in nodes if h is not closer]
    closer._keeper.stop(revoke=False)  # kill -9
    closer._control_watch.stop()
    closer._duty.stop()
    futures = cluster.join(*rest)  # their workers' group broke: they rejoin at once
    i = nodes.index(closer)
    assert mark_failed(rest[0].coordinator, Keyspace(cluster.prefix), cluster.run_id, f"n{i}",
                       0xc0 + i, "x", None, 0.0) == 1
    infos = results(futures)
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    assert rest[0]._control.closer_node() in {h.me for h in rest}


def test_a_member_recorded_failed_after_its_record_expired_is_gone_at_the_mark(etcd, prefix):
    # The other order: the rendezvous lease expired first (the two leases are not kept alive
    # in step), the daemons' record comes later; the closer looks for the mark meanwhile.
    cluster = Cluster("etcd", etcd, prefix)
    try:
        a, b = (cluster.node(1, 2, liveness_confirm="60") for _ in range(2))
        results(cluster.join(a, b))
        wait_until(lambda: a._control.closer_node() is not None, "a closer")
        if a._control.closer_node() == b.me:  # b: the one that is not the closer (a closer
            a, b = b, a                       # that died with its record: the test before)
        a.daemon_of, b.daemon_of = (lambda: ("na", 0xa1)), (lambda: ("nb", 0xb1))
        results(cluster.join(a, b))  # records naming the daemons
        b._keeper.stop(revoke=False)
        b._control_watch.stop()
        b._duty.stop()
        wait_until(lambda: not has_record(a, b), "b's record expired (TTL 2 s)")
        time.sleep(0.3)
        assert a.gone_members() == []  # absent, unmarked: liveness_confirm still runs
        assert mark_failed(a.coordinator, Keyspace(prefix), cluster.run_id, "nb", 0xb1, "na",
                           None, 0.0) == 0
        wait_until(lambda: a.gone_members() == [b.me], "b gone once marked")
        assert results(cluster.join(a))[0].world_size == 1
    finally:
        cluster.close()


def test_the_closer_reads_no_mark_while_members_are_absent_it_follows_them(cluster):
    # After an etcd pause past the TTL every member's record is absent at once: a read of
    # each member's mark every 20 ms would be N reads per poll against the etcd just back
    # (before issue 31's sixth pass, one listing of the marks per poll). The closer follows
    # the marks by a watch instead (listed once, when it was elected): no read at all.
    nodes = [cluster.node(1, 5, liveness_confirm="60") for _ in range(5)]
    for i, h in enumerate(nodes):
        h.daemon_of = lambda i=i: (f"n{i}", 0xd0 + i)
    results(cluster.join(*nodes))
    wait_until(lambda: nodes[0]._control.closer_node() is not None, "a closer")
    [closer] = [h for h in nodes if h.me == nodes[0]._control.closer_node()]
    marks = closer._control.native + b"failed/"
    reads = {"one": 0, "listing": 0}
    get, get_prefix = closer.coordinator.get, closer.coordinator.get_prefix

    def counted_get(key, *args, **kwargs):
        reads["one"] += key.startswith(marks)
        return get(key, *args, **kwargs)

    def counted_get_prefix(key, *args, **kwargs):
        reads["listing"] += key == marks
        return get_prefix(key, *args, **kwargs)

    closer.coordinator.get, closer.coordinator.get_prefix = counted_get, counted_get_prefix
    for h in nodes:
        if h is not closer:  # silent, no mark: absent while liveness_confirm runs
            h._keeper.stop(revoke=True)
            h._control_watch.stop()
            h._duty.stop()

    def absent() -> int:
        with closer._election.closer.nodes.counts() as tally:
            return len(tally.absent_since)

    wait_until(lambda: absent() == 4, "the closer sees the four absent")
    time.sleep(0.3)  # fifteen polls of the old closer
    assert reads == {"one": 0, "listing": 0} and closer.gone_members() == []


class CountedCoordinator:
    """One daemon's connection: every range read it sends is counted in ``reads``."""

    def __init__(self, coord, reads: list[bytes]) -> None:
        self._coord, self._reads = coord, reads

    def get(self, key, *args, **kwargs):
        self._reads.append(key)
        return self._coord.get(key, *args, **kwargs)

    def get_prefix(self, prefix, *args, **kwargs):
        self._reads.append(prefix)
        return self._coord.get_prefix(prefix, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._coord, name)


def test_one_failure_costs_one_listing_of_the_join_records_not_one_per_survivor(cluster):
    # 50 nodes: every survivor's daemon records the failure and tells the rendezvous. Before,
    # each listed the whole native/ directory (49 listings of 50 records: quadratic in N);
    # now the survivor whose create of the mark wins lists and deletes, the others only try
    # the create.
    n, keys = 50, Keyspace(cluster.prefix)
    native = keys.rendezvous(cluster.run_id).prefix + b"native/"
    coord = cluster.connect()
    try:
        for i in range(n):
            rec = NodeRecord(f"agent{i}", 0, "127.0.0.1", 1, daemon=f"n{i}",
                             daemon_lease=0xe00 + i)
            coord.put(native + b"nodes/" + rec.node.encode(), rec.encode())
        reads: list[bytes] = []
        before = coord.revision()
        survivors = [CountedCoordinator(coord, reads) for _ in range(n - 1)]
        deleted = list(cluster.pool.map(
            lambda i: mark_failed(survivors[i], keys, cluster.run_id, "n7", 0xe07, f"n{i}",
                                  None, 0.0), range(n - 1)))
        assert sorted(deleted) == [0] * (n - 2) + [1]
        assert len(reads) == 1  # one listing for the whole cluster
        # and two writes (the mark, then the mark naming the member with the deletes), not a
        # rewrite of the mark per survivor: each one an event to every daemon's jobs/ watch
        assert coord.revision() - before == 2
        assert coord.get(native + b"nodes/agent7") is None
        assert len(coord.get_prefix(native + b"nodes/")[0]) == n - 1
        mark = coord.get(mark_key(native, "n7", 0xe07))
        assert marked_members(mark.value) == {"agent7"}
    finally:
        coord.close()


def test_a_failed_closers_key_goes_in_the_deletes_transaction_unless_another_took_it(cluster):
    # The successor's election waits for the dead closer's key to go: a write sooner than
    # when it went in a transaction of its own (3 writes per such failure before, 2 now).
    keys = Keyspace(cluster.prefix)
    native = keys.rendezvous(cluster.run_id).prefix + b"native/"
    coord = cluster.connect()
    try:
        for i in range(3):
            rec = NodeRecord(f"agent{i}", 0, "127.0.0.1", 1, daemon=f"n{i}",
                             daemon_lease=0xf00 + i)
            coord.put(native + b"nodes/" + rec.node.encode(), rec.encode())
        coord.put(native + b"round.closer", b"agent1")
        before = coord.revision()
        assert mark_failed(coord, keys, cluster.run_id, "n1", 0xf01, "n0", None, 0.0) == 1
        assert coord.revision() - before == 2  # the mark, then one transaction
        assert coord.get(native + b"round.closer") is None
        assert coord.get(native + b"nodes/agent1") is None

        class TakenMeanwhile(CountedCoordinator):
            def get_prefix(self, prefix, *args, **kwargs):
                out = super().get_prefix(prefix, *args, **kwargs)
                self._coord.put(native + b"round.closer", b"agent2")  # a successor's key
                return out

        coord.put(native + b"round.closer", b"agent0")
        assert mark_failed(TakenMeanwhile(coord, []), keys, cluster.run_id, "n0", 0xf00, "n2",
                           None, 0.0) == 1
        assert coord.get(native + b"round.closer").value == b"agent2"
        assert coord.get(native + b"nodes/agent0") is None
    finally:
        coord.close()


def test_the_round_re_forms_at_the_mark_alone_when_its_winner_dies_before_its_deletes(
        cluster):
    # The winner's create went through, then it died (its lease expires with its mark): no
    # other survivor deletes the failed node's record. The closer drops the record at the
    # mark, as the deletes would have (before, the round waited for the record to go with
    # its agent's lease: 30 s here, past this test's timeouts). b is not the closer: a dead
    # closer's key, which the winner would have deleted too, holds every round until it
    # expires (test_when_the_failed_member_was_the_closer_its_key_goes_with_its_record).
    keys = Keyspace(cluster.prefix)
    nodes = [cluster.node(1, 3, liveness_ttl="30") for _ in range(3)]
    results(cluster.join(*nodes))
    wait_until(lambda: closer_of(nodes) is not None, "a closer")
    a = closer_of(nodes)
    b, c = (h for h in nodes if h is not a)
    for h, name in ((a, "na"), (b, "nb"), (c, "nc")):
        h.daemon_of = lambda name=name: (name, 0xb0 + len(name))
    results(cluster.join(a, b, c))  # records naming the daemons
    b._keeper.stop(revoke=False)  # kill -9
    b._control_watch.stop()
    b._duty.stop()
    futures = cluster.join(a, c)  # their group broke: they rejoin at once
    winner = cluster.connect()
    try:
        winner_lease = winner.grant_lease(2)  # never kept alive: the winner is dead

        def dies_here(prefix, *args, **kwargs):
            raise Unavailable("the winner died before it listed")

        winner.get_prefix = dies_here
        with pytest.raises(Unavailable):
            mark_failed(winner, keys, cluster.run_id, "nb", 0xb2, "na", winner_lease, 0.0)
        assert mark_failed(c.coordinator, keys, cluster.run_id, "nb", 0xb2, "nc", None,
                           0.0) == 0  # lost the create: the winner's job
        assert has_record(a, b)
        infos = results(futures)
        assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    finally:
        winner.close()


def test_with_grow_at_failure_a_newcomer_waits_silently_and_enters_at_the_next_failure(
        cluster):
    a, b, c = (cluster.node(1, 3, grow="at-failure") for _ in range(3))
    results(cluster.join(a, b, c))  # max reached: round 0 closes with all three
    c.stop()  # c dies: the survivors re-form at world 2 (a failure, no newcomer yet)
    results(cluster.join(a, b))
    d = cluster.node(1, 3, grow="at-failure")
    pending = cluster.join(d)
    wait_until(lambda: sees_outsiders(a) and sees_outsiders(b),
               "the members see the newcomer waiting outside")
    assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0  # no stop to let it in
    assert not pending[0].done()
    b.stop()  # the next failure: the newcomer enters the round that forms for it anyway
    wait_until(lambda: a.num_nodes_waiting() == 1, "a sees b gone and the newcomer waiting")
    infos = results(cluster.join(a) + pending)
    assert [i.world_size for i in infos] == [2, 2]
    assert sorted(i.rank for i in infos) == [0, 1]


def test_with_grow_interval_a_newcomer_enters_only_after_the_interval_at_a_committed_step(
        cluster):
    grow = "interval:0.03"  # 1.8 s
    a, b = cluster.node(1, 4, grow=grow), cluster.node(1, 4, grow=grow)
    committed = {"now": False}
    for h in (a, b):
        h.commit_gate = lambda: committed["now"]
    results(cluster.join(a, b))
    closed_at = time.monotonic()
    c = cluster.node(1, 4, grow=grow)
    pending = cluster.join(c)
    wait_until(lambda: sees_outsiders(a) and sees_outsiders(b),
               "the members see the newcomer waiting outside")
    assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0  # within the interval
    assert time.monotonic() - closed_at < 1.8, "the check above came too late to mean much"
    time.sleep(max(0.0, closed_at + 1.9 - time.monotonic()))
    assert a.num_nodes_waiting() == 0  # the interval is over, but not at a committed step
    committed["now"] = True
    assert a.num_nodes_waiting() == b.num_nodes_waiting() == 1
    infos = results(cluster.join(a, b) + pending)
    assert [i.world_size for i in infos] == [3, 3, 3]
    # That round grew the job: the interval starts again for the next newcomer.
    d = cluster.node(1, 4, grow=grow)
    pending = cluster.join(d)
    wait_until(lambda: sees_outsiders(a), "a sees the next newcomer")
    assert a.num_nodes_waiting() == 0
    wait_until(lambda: a.num_nodes_waiting() == 1, "the next interval ends")
    results(cluster.join(a, b, c) + pending)


def closer_of(handlers):
    """The handler holding the closer's key (None: nobody yet)."""
    return next((h for h in handlers if h._election.closer is not None), None)


def test_only_the_closer_follows_the_node_records_the_others_see_a_few_events_a_round(
        cluster):
    nodes = [cluster.node(10, 10) for _ in range(10)]
    results(cluster.join(*nodes))
    leader = closer_of(nodes)
    assert leader is not None and sum(h._election.closer is not None for h in nodes) == 1
    others = [h for h in nodes if h is not leader]
    before = [h._control_watch.events for h in others]
    closer_before = leader._election.closer.nodes.events
    # the others only the control keys: a re-rendezvous of all ten costs each one
    # summary (someone rejoins) and the round record, not ten events.
    infos = results(cluster.join(*nodes))
    assert {i.world_size for i in infos} == {10}
    wait_until(lambda: all(h._control.round.round == 1 for h in nodes), "all see round 1")
    # the closer saw every rejoin ...
    assert leader._election.closer.nodes.events - closer_before >= 10
    assert all(h._control_watch.events - b <= 4 for h, b in zip(others, before)), \
        [h._control_watch.events - b for h, b in zip(others, before)]
    assert [h._election.closer for h in others] == [None] * len(others)


def test_a_dead_closer_is_replaced_and_the_round_re_forms_without_it(cluster):
    nodes = [cluster.node(1, 4) for _ in range(4)]
    infos = dict(zip(nodes, results(cluster.join(*nodes))))
    leader = closer_of(nodes)
    leader.stop()  # its lease goes, and its election key with it
    rest = [h for h in nodes if h is not leader]
    got = results(cluster.join(*rest))
    assert sorted(i.rank for i in got) == [0, 1, 2] and {i.world_size for i in got} == {3}
    successor = closer_of(rest)
    assert successor is not None
    # The turns go by rank: the lowest surviving rank took the key.
    assert infos[successor].rank == min(infos[h].rank for h in rest)


def test_a_deposed_closer_cannot_write_the_round(cluster):
    a, b = cluster.node(1, 2), cluster.node(1, 2)
    results(cluster.join(a, b))
    leader = closer_of((a, b))
    stale = leader._election.closer
    coord = cluster.connect()
    try:
        # The closer's lease expired and someone else holds the key now (both handlers stop
        # first: their elections would race this test's create).
        a.stop()
        b.stop()
        assert coord.create(leader._control.closer_key, b"someone-else")
        ok, _ = stale._guarded(leader._control.round_key, None,
                               RoundRecord(7, ("x",)).encode())
        assert not ok
        assert RoundRecord.decode(coord.get(leader._control.round_key).value).round == 0
    finally:
        coord.close()


def test_an_agent_of_the_old_protocol_is_refused_with_the_upgrade_named(cluster, caplog):
    a = cluster.node(1, 2)
    coord = cluster.connect()
    try:
        # An elasticd 0.1.0 agent's join record (protocol 1) is not counted ...
        old = a._control.nodes_prefix + b"old-agent"
        coord.put(old, b'{"v":1,"node":"old-agent","target":0,"addr":"h"}')
        with caplog.at_level("WARNING", logger="elasticd.rendezvous.handler"):
            info = results(cluster.join(a))[0]
        assert info.world_size == 1
        assert any("protocol 1, this elasticd speaks 2: run the same elasticd release"
                   in r.getMessage() for r in caplog.records)
        # ... and a round an old agent closed stops a new one with the same one line.
        coord.put(a._control.round_key, b'{"v":1,"round":0,"members":["old-agent"]}')
        late = cluster.node(1, 2)
        with pytest.raises(RendezvousStateError, match="protocol 1.*upgrade every node"):
            late.next_rendezvous()
    finally:
        coord.close()


def test_after_etcd_lost_its_data_the_members_write_the_round_back_and_nobody_restarts(prefix):
    # Memory only: the real etcd restarted empty under real agents is the chaos test
    # (tests/chaos/test_etcd_wipe.py: one worker group from the first step to the last).
    cluster = Cluster("memory", None, prefix)
    try:
        a, b = cluster.node(2, 2), cluster.node(2, 2)
        results(cluster.join(a, b))
        pending = cluster.join(a)  # a re-rendezvous once: the round in force is round 1
        wait_until(lambda: b.num_nodes_waiting() == 1, "b sees a waiting")
        results(cluster.join(b) + pending)
        before = a._control.round
        assert before.round == 1
        seen: list[int] = []
        stop = time.monotonic() + 2 * 2 + 1.0  # past the distrust window (2 x TTL)

        def sample() -> None:  # what torch's monitor loop would read, from the wipe on
            while time.monotonic() < stop:
                seen.extend((a.num_nodes_waiting(), b.num_nodes_waiting()))
                time.sleep(0.005)

        sampler = cluster.pool.submit(sample)
        cluster.store.wipe()
        sampler.result(timeout=TIMEOUT)
        # torch's agent restarts its workers for any count above 0.
        assert seen and max(seen) == 0, f"num_nodes_waiting answered {max(seen)} after the wipe"
        stored = RoundRecord.decode(a.coordinator.get(a._control.round_key).value)
        assert (stored.round, stored.members) == (before.round, before.members)
        wait_until(lambda: has_record(a, a) and has_record(a, b),
                   "both node records re-written under new leases")
        assert b._control.round is not None and b._control.round.round == before.round
    finally:
        cluster.close()
