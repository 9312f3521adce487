"""The commit coordinator in the replication service, on the in-memory coordinator: what each
node asks of etcd per committed step (nothing but its watch event; the coordinator one
transaction), who coordinates when, and what a report may say."""

from __future__ import annotations

import json
import threading
import os
import time

import pytest

from elasticd.testing.clock import FakeClock
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.replication.api import ReplicationError
from elasticd.replication.placement import compute_placement
from elasticd.replication.report import (
    MalformedReport,
    Reply,
    Report,
    decode_reply,
    decode_report,
    encode_reply,
    encode_report,
    placement_digest,
)
from elasticd.replication.transport import ReplicaClient
from tests.replication_nodes import JOB, SECRET, Cluster, Stepper

THREE = {"n1": [0, 1], "n2": [2, 3], "n3": [4, 5]}


class Counting(MemoryCoordinator):
    """Counts the etcd calls one node makes, by method."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self.calls: dict[str, int] = {}
        for name in ("get", "get_prefix", "put", "transaction", "delete", "delete_prefix",
                     "grant_lease", "keep_alive", "revoke_lease"):
            setattr(self, name, self._counted(name, getattr(self, name)))

    def _counted(self, name, fn):
        def call(*args, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kw)
        return call


@pytest.fixture
def cluster():
    store = MemoryStore()
    c = Cluster(lambda: Counting(store), 3, 2)
    yield c
    c.close()
    assert not os.path.exists(c.base)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def step(cluster: Cluster, n: int, ranks=THREE) -> None:
    for name, rs in ranks.items():
        for rank in rs:
            cluster[name].snapshot(rank, n, world=6)
    cluster.wait_idle()


def coordinator(cluster: Cluster) -> str | None:
    names = [n.name for n in cluster.live() if n.replicator.tracker.reporter.leading(JOB)]
    assert len(names) <= 1, names
    return names[0] if names else None


def test_per_committed_step_nodes_ask_nothing_of_etcd_and_the_coordinator_writes_once(cluster):
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    step(cluster, 1)
    assert coordinator(cluster) == "n1"  # the placement's first node, elected at once
    wait_for(lambda: cluster["n3"].replicator.tracker.view(JOB)[1] is not None)
    for coord in cluster.coords:
        coord.calls.clear()
    revision = cluster.coords[0].store._revision
    for n in range(2, 12):
        step(cluster, n)
    assert cluster["n3"].replicator.tracker.view(JOB)[1].version == (0, 11)
    assert cluster.coords[0].store._revision - revision <= 2 * 10  # commit (+ ahead) per step
    for name, coord in zip(("n1", "n2", "n3"), cluster.coords):
        if name == "n1":
            assert coord.calls.get("transaction", 0) <= 20 and not coord.calls.get("get_prefix")
        else:
            assert coord.calls == {}, f"{name} asked etcd {coord.calls} in 10 steps"
    status = cluster["n2"].replicator.status()["jobs"][JOB]
    assert status["coordinator"]["node"] == "n1" and status["coordinating"] is None
    leading = cluster["n1"].replicator.status()["jobs"][JOB]["coordinating"]
    assert leading["waiting_for"] == [] and leading["commits"] >= 10
    assert cluster["n1"].replicator.stats().commit_coordinator == 1
    assert cluster["n2"].replicator.stats().commit_coordinator == 0


def test_a_dead_coordinator_is_replaced_when_its_lease_expires(cluster):
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    step(cluster, 1)
    assert coordinator(cluster) == "n1"
    killed = time.monotonic()
    cluster.kill("n1")  # nothing revoked: its election lease (1 s) expires
    ranks = {"n2": [0, 1, 2], "n3": [3, 4, 5]}
    cluster.set_membership(["n2", "n3"], ranks, round=2)
    store = cluster.coords[0].store

    def elected():
        store.expire_leases()  # etcd expires leases by itself; the fake when asked
        return coordinator(cluster) == "n2"

    wait_for(elected, 5)
    # its last keep-alive came up to TTL/3 (and a tick) before the kill
    assert time.monotonic() - killed >= 0.5, "elected before the old lease could expire"
    for name, rs in ranks.items():
        for rank in rs:
            cluster[name].snapshot(rank, 5, world=6)
    wait_for(lambda: getattr(cluster["n3"].replicator.tracker.view(JOB)[1], "version",
                             None) == (0, 5), 5)


def test_a_coordinator_outage_does_not_widen_the_snapshot_grid():
    """A dead coordinator's election key stays until its lease expires: meanwhile the
    survivors' reports reach no one and nothing can commit. Their versions passed
    withdraw_after (0.5 s here), but no coordinator answered since, so none is withdrawn:
    each withdrawal doubled the job's snapshot grid as if the nodes had diverged (to 32 steps
    in a 2 s outage on real etcd, before), and the first commit after the election then
    waited for the next step on that grid."""
    leases = FakeClock()  # the store's leases expire only when this clock moves
    store = MemoryStore(leases)
    cluster = Cluster(lambda: MemoryCoordinator(store), 3, 2)
    try:
        cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
        step(cluster, 1)
        assert coordinator(cluster) == "n1"
        cluster.kill("n1")  # nothing revoked: its election lease expires when the clock moves
        two = {"n2": [0, 1, 2], "n3": [3, 4, 5]}
        cluster.set_membership(["n2", "n3"], two, round=2)
        with Stepper(cluster, two, period=0.05) as stepper:
            stepper.step = 1024
            time.sleep(2.0)  # four times withdraw_after
            assert coordinator(cluster) is None
            assert [cluster[n].replicator.snapshot_grid(JOB) for n in two] == [1, 1]
    finally:
        cluster.close()


def test_a_coordinator_that_leaves_the_placement_resigns_at_once(cluster):
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    step(cluster, 1)
    assert coordinator(cluster) == "n1"
    ranks = {"n2": [0, 1, 2], "n3": [3, 4, 5]}
    left = time.monotonic()
    for name in ("n2", "n3", "n1"):  # n1 too learns the round without itself
        cluster[name].replicator.set_membership(JOB, ["n2", "n3"], ranks, 2)
    wait_for(lambda: coordinator(cluster) == "n2", 5)
    assert time.monotonic() - left < 0.9, "waited for the lease instead of resigning"


def test_a_report_naming_another_node_is_refused_and_the_connection_closed(cluster):
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    step(cluster, 1)
    placement = compute_placement(["n1", "n2", "n3"], THREE, 2, 1)
    forged = Report(JOB, "n3", 1, placement_digest(placement), 1, 99, 0, 0, {4: ((0, 9),)})
    client = ReplicaClient.connect(*cluster.addresses["n1"], SECRET, "n2", timeout=5)
    with pytest.raises(ReplicationError):
        client.report(forged)
    client.close()
    assert cluster["n1"].server.snapshot_stats().protocol_errors == 1


def test_reports_and_replies_round_trip_and_malformed_ones_are_refused():
    r = Report("j", "n1", 7, "abc", 1, 2, 3, 0, {0: ((0, 2), (0, 1))}, ((0, 3),), ((0, 2),))
    assert decode_report(encode_report(r)) == r
    reply = Reply(True, "", ((0, 2),), (0, 1))
    assert decode_reply(encode_reply(reply)) == reply
    for bad in (b"[]", b'{"job":"j"}', encode_report(r).replace(b'"seq":2', b'"seq":-2'),
                encode_report(r).replace(b'"0":[', b'"x":['), b"\xff",
                encode_report(r).replace(b'[[0,2],[0,1]]', b'[[0,2],[0,1],[0,0],[1,1],[2,2]]')):
        with pytest.raises(MalformedReport):
            decode_report(bad)


def test_a_reports_bytes_are_unchanged_and_every_version_of_every_rank_is_checked():
    # The coordinator decodes one report per node per step: its checks were made cheaper,
    # not fewer; and the encoding, now of the tuples as they are, writes the same bytes.
    r = Report("j", "n1", 7, "abc", 1, 2, 3, 0, {1: ((0, 2), (0, 1)), 0: ((0, 2),)},
               ((0, 3),), ((0, 2),))
    wire = (b'{"job":"j","node":"n1","term":7,"placement":"abc","boot":1,"seq":2,"fence":3,'
            b'"floor":0,"ranks":{"0":[[0,2]],"1":[[0,2],[0,1]]},"dead":[[0,3]],"ask":[[0,2]]}')
    assert encode_report(r) == wire and decode_report(wire) == r
    for bad in ([0, 1.0], [0, True], [False, 1], [-1, 1], [0, -1], [0], [0, 1, 2], "0,1", {},
                None, [0, None], [0, 1e3]):
        for where in ("rank", "dead", "ask"):
            body = json.loads(wire)
            if where == "rank":  # a later rank than the first, a later version than the first
                body["ranks"]["1"][1] = bad
            else:
                body[where].append(bad)
            with pytest.raises(MalformedReport):
                decode_report(json.dumps(body).encode())
    body = json.loads(wire)
    body["ranks"]["2"] = [[0, 2], [0, 1], [0, 0], [0, 3], [0, 4]]  # more than MAX_VERSIONS
    with pytest.raises(MalformedReport):
        decode_report(json.dumps(body).encode())


def test_a_commit_a_reply_names_first_is_left_to_the_watch_for_its_grace():
    """A reply naming a commit the node's watch has not brought yet: the node reads the
    committed record itself only if the watch is still behind after WATCH_GRACE (reading at
    once cost a range read per node per step on real etcd, where the reply wins the race)."""
    from elasticd.replication.reporter import WATCH_GRACE, JobReports

    j, known = JobReports(), (0, 1)
    j.ahead, j.ahead_since, j.ahead_known = (known[0], known[1] + 5), 100.0, known
    assert not j.watch_lagging(known, 100.0 + WATCH_GRACE / 2)  # still in its grace
    assert j.watch_lagging(known, 100.0 + WATCH_GRACE)  # the watch is late: read it
    assert j.ahead is None and not j.watch_lagging(known, 200.0)  # once
    j.ahead, j.ahead_since = known, 100.0  # the watch brought it meanwhile: nothing to read
    assert not j.watch_lagging(known, 100.0 + WATCH_GRACE) and j.ahead is None


def test_a_watch_that_moved_during_its_grace_is_given_another_and_a_stuck_one_is_read():
    """A watch that brought a newer commit during its grace, though not yet the one the reply
    named, is late, not stuck: reading the prefix over it is one more range read per node at
    the moment etcd is slowest to deliver (every node at once at N = 1,000). It gets another
    grace from where it got to; a watch that brings nothing in a grace is still read."""
    from elasticd.replication.reporter import WATCH_GRACE, JobReports

    j = JobReports()
    j.ahead, j.ahead_since, j.ahead_known = (0, 6), 100.0, (0, 1)
    assert not j.watch_lagging((0, 3), 100.0 + WATCH_GRACE)  # it moved: not read
    assert j.ahead == (0, 6)  # still waited for
    assert not j.watch_lagging((0, 3), 100.0 + 1.5 * WATCH_GRACE)  # its second grace
    assert j.watch_lagging((0, 3), 100.0 + 2 * WATCH_GRACE)  # stuck since: read
    assert j.ahead is None
    j.ahead, j.ahead_since, j.ahead_known = (0, 8), 300.0, None  # the watch never brought any
    assert j.watch_lagging(None, 300.0 + WATCH_GRACE)


def test_the_nodes_reads_of_one_late_commit_spread_over_a_second():
    """Every node of a job learns a commit from its reply in the same few milliseconds; when
    etcd's delivery to every watcher falls behind, each node reads the committed prefix. With
    one grace for all, 1,000 nodes read in the same tick (session 33: 1,187 reads > 100 ms in
    a minute and 291 leases lost beside them). Each node's grace has its own share of
    WATCH_SPREAD, fixed by its name: reads at most ~15 % of the nodes per 0.1-s tick, none
    before WATCH_GRACE, every lagging watch still read within WATCH_GRACE + WATCH_SPREAD."""
    from elasticd.replication.reporter import (
        TICK, WATCH_GRACE, WATCH_SPREAD, JobReports, watch_grace)

    first: dict[int, int] = {}
    for i in range(1000):
        j, grace = JobReports(), watch_grace(f"node-{i:05d}")
        j.ahead, j.ahead_since = (0, 2), 0.0
        tick = next(k for k in range(1, 100) if j.watch_lagging(None, k * TICK, grace))
        first[tick] = first.get(tick, 0) + 1
    assert min(first) * TICK >= WATCH_GRACE - 1e-9
    assert max(first) * TICK <= WATCH_GRACE + WATCH_SPREAD + TICK + 1e-9
    assert max(first.values()) <= 150, first
    assert watch_grace("node-00007") == watch_grace("node-00007")  # a node's own, kept


def test_a_term_ended_reply_reads_the_prefix_once_at_the_nodes_moment_unless_the_watch_moved():
    """A coordinator whose term ended answers "term" to every node still reporting to it. Each
    such reply read the committed prefix at once: every node in the same moment, and again at
    each retry (every 0.1 s) while etcd was slow to answer. Now the reply only marks the
    election record stale; the node's tick reads the prefix once, at its share of
    WATCH_SPREAD, if the watch has brought no other record by then (one that did is not read
    over; a stuck watch still is)."""
    import collections
    import types

    from elasticd.replication.election import Coordinatorship
    from elasticd.replication.reporter import WATCH_GRACE, JobReports, Reporter

    clock, lock = FakeClock(100.0), threading.Lock()
    tracker = types.SimpleNamespace(node_id="node-00003", clock=clock, lock=lock, jobs={},
                                    counters=collections.Counter(), closing=False,
                                    cond=threading.Condition(lock))
    submitted = []
    r = Reporter(tracker, lambda node, report: Reply(True), 2.0,
                 lambda fn, *args: submitted.append(fn), lambda job: None)
    old = Coordinatorship("n1", 1, 5)
    j = r.jobs[JOB] = JobReports(ship=old)
    for _ in range(3):  # the report and two retries, 0.1 s apart
        r._answered(JOB, j, old, Reply(False, "term ended"))
        clock.advance(0.1)
    assert r.reread not in submitted  # old code: three reads at once
    assert j.stale_at == pytest.approx(100.0 + r.grace - WATCH_GRACE)
    assert not j.term_stale(j.stale_at - 0.01)
    assert j.term_stale(j.stale_at) and j.stale_at is None  # still the old record: read
    assert not j.term_stale(1e9)  # once
    r._answered(JOB, j, old, Reply(False, "term"))
    j.ship = Coordinatorship("n2", 2, 9)  # the watch brought the new coordinator meanwhile
    assert not j.term_stale(1e9) and j.stale_at is None


def test_a_job_that_ended_here_is_not_coordinated_again_and_leaves_nothing_due(cluster):
    """The job ended on its coordinator: the term ends and its election key is deleted. That
    deletion's watch event, arriving while the job was being forgotten, made the node campaign
    again and coordinate a job it no longer runs, with a report due that was never sent: a
    SIGTERM then waited out ``wait_idle``'s 5 s (every node, every stop after a job)."""
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    step(cluster, 1)
    assert coordinator(cluster) == "n1"
    n1 = cluster["n1"].replicator
    n1.remove_job(JOB)
    cluster.wait_idle()
    assert n1.tracker.reporter.leading(JOB) is None and JOB not in n1.tracker.reporter.jobs
    assert n1.tracker.reporter.settled()
    assert n1.wait_idle(1.0)


def test_a_report_waiting_on_a_frozen_coordinator_ends_when_its_term_does(cluster):
    """A SIGSTOPped coordinator's kernel still accepts: a report sent to it waited for the
    whole report deadline (5 s), and then once more on a fresh connection, while the next
    coordinator heard nothing from that node (chaos: a world-2 phase committed nothing). The
    report in flight ends when the election key says the term ended, and goes to the new
    coordinator."""
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    step(cluster, 1)
    assert coordinator(cluster) == "n1"
    thaw, arrived = threading.Event(), []

    def frozen(report):
        arrived.append(report.node)
        thaw.wait(30)
        return Reply(False, "term")

    frozen_node = cluster["n1"]
    frozen_node.server.on_report = frozen  # its server still takes connections
    frozen_node.replicator.close(resign=False)  # no more keep-alives: its election lease ends
    try:
        two = {"n2": [0, 1, 2], "n3": [3, 4, 5]}
        for name in ("n2", "n3"):  # a new placement: each reports to n1, still in office
            cluster[name].replicator.set_membership(JOB, ["n2", "n3"], two, 2)
        wait_for(lambda: "n3" in arrived, 5)
        store = cluster.coords[0].store

        def elected():
            store.expire_leases()
            return coordinator(cluster) == "n2"

        wait_for(elected, 5)
        elected_at = time.monotonic()
        step(cluster, 2, two)
        wait_for(lambda: getattr(cluster["n3"].replicator.tracker.view(JOB)[1], "version",
                                 None) == (0, 2), 10)
        # Before: n3's report waited out the 5 s deadline on n1, then was sent to n1 again.
        assert time.monotonic() - elected_at < 2.5
        assert arrived.count("n3") == 1, arrived
    finally:
        thaw.set()
