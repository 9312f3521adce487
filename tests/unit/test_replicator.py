"""The replication service end to end on one host: simulated nodes (own shared-memory
directories, own replica server on 127.0.0.1, own Replicator) on the in-memory coordinator.

Killing a node deletes its directories, so a shard fetched afterwards can only have come over
the replication transport; the tests also count the bytes the fetching side received.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from elasticd.store.shm import CommitPending, SlotBusy
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.replication.commit import (
    KEEP_SKIPPED,
    commit_of,
    commit_txn,
    decode_committed,
    read_committed,
)
from elasticd.replication.election import campaign
from elasticd.replication.fences import encode_fence, read_fence, read_fences, withdraw
from elasticd.replication.placement import compute_placement, decode_placement
from elasticd.replication.report import Report, placement_digest
from elasticd.replication.tally import CommitWrite, Tally
from elasticd.recovery.replicator import ShardLost
from elasticd.replication.shm_sink import ShmSink
from tests.replication_nodes import JOB, Cluster
from tests.store_retained import retained, retained_by_any_rank

THREE = {"n1": [0, 1], "n2": [2, 3], "n3": [4, 5]}
FOUR = {"n1": [0, 1], "n2": [2, 3], "n3": [4, 5], "n4": [6, 7]}


@pytest.fixture
def make_cluster():
    clusters: list[Cluster] = []

    def make(n: int, m: int = 2, **kw) -> Cluster:
        store = MemoryStore()
        cluster = Cluster(lambda: MemoryCoordinator(store), n, m, **kw)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()
        assert not os.path.exists(cluster.base)
    leftover = [t.name for t in threading.enumerate()
                if t.name.startswith(("replica-", "replicator-"))]
    assert not leftover, leftover


def snapshot_all(cluster: Cluster, ranks: dict[str, list[int]], step: int,
                 generation: int = 0) -> dict[int, bytes]:
    world = sum(len(r) for r in ranks.values())
    out = {}
    for name, rs in ranks.items():
        for rank in rs:
            out[rank] = cluster[name].snapshot(rank, step, generation, world)
    return out


def committed(cluster: Cluster):
    return read_committed(cluster.coords[0], cluster.keys, JOB)


def into_buffer(size: int = 1 << 20) -> bytearray:
    return bytearray(size)


def test_placement_is_published_once_by_compare_and_set(make_cluster):
    cluster = make_cluster(3)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    kv = cluster.coords[0].get(cluster.keys.replication(JOB).placement)
    assert kv.version == 1, "exactly one node wrote the placement"
    placement = decode_placement(kv.value)
    assert placement.holders["n2"] == ("n2", "n3") and placement.round == 1
    cluster.set_membership(["n1", "n2"], {"n1": [0, 1], "n2": [2, 3]}, round=2)
    kv = cluster.coords[0].get(cluster.keys.replication(JOB).placement)
    assert kv.version == 2 and decode_placement(kv.value).nodes == ("n1", "n2")


def test_push_commit_then_restore_a_dead_nodes_shards_from_a_peer(make_cluster):
    cluster = make_cluster(3)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    originals = snapshot_all(cluster, THREE, step=1)
    cluster.wait_idle()
    record = committed(cluster)
    assert record is not None and record.version == (0, 1)
    assert record.ranks == (0, 1, 2, 3, 4, 5)
    assert record.holders[2] == ("n2", "n3") and record.holders[5] == ("n3", "n1")
    for node in cluster.live():
        assert node.replicator.stats().committed_step == 1
        assert node.replicator.stats().sync_lag_steps == 0
    # n1 runs ahead on one rank: nothing newer can commit, and its lag says so.
    cluster["n1"].snapshot(0, 2)
    cluster.wait_idle()
    assert committed(cluster).version == (0, 1)
    assert cluster["n1"].replicator.stats().sync_lag_steps == 1

    cluster.kill("n2")
    n1 = cluster["n1"].replicator
    for rank in (2, 3):
        buf = into_buffer()
        before = n1.stats().fetch_bytes_total
        result = n1.fetch(JOB, rank, (0, 1), buf)
        assert result.holder == "n3"
        assert bytes(buf[: result.descriptor.total_bytes]) == originals[rank]
        assert result.wire_bytes >= len(originals[rank])
        assert n1.stats().fetch_bytes_total - before == result.wire_bytes
        assert result.attempts[0][0] == "n2"  # the dead owner was tried first and skipped
    # A holder's own memory needs no transport.
    own = cluster["n3"].replicator.fetch(JOB, 2, (0, 1), into_buffer())
    assert own.holder == "n3" and own.wire_bytes == 0


def test_a_corrupt_copy_is_refused_and_another_holder_used(make_cluster):
    cluster = make_cluster(3)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    originals = snapshot_all(cluster, THREE, step=1)
    cluster.wait_idle()
    # Rank 2's copies: n2's own snapshot (served by its replica server) and n3's replica.
    owner_view = cluster["n2"].local.latest(JOB, 2)
    offset = owner_view.header.layout.entries[0].offset + 1000
    with open(owner_view.path, "r+b") as f:  # a bit flip in the owner's memory
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    n1 = cluster["n1"].replicator
    buf = into_buffer()
    result = n1.fetch(JOB, 2, (0, 1), buf)
    assert result.holder == "n3"
    assert result.attempts[0][0] == "n2" and result.attempts[0][1].startswith("corrupt")
    assert bytes(buf[: result.descriptor.total_bytes]) == originals[2]
    assert n1.stats().fetch_failures_total["corrupt"] == 1

    replica = cluster["n3"].sink.store.latest(JOB, 2)
    with open(replica.path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff\xff")
    with pytest.raises(ShardLost) as info:
        n1.fetch(JOB, 2, (0, 1), into_buffer())
    reasons = dict(info.value.attempts)
    assert reasons["n2"].startswith("corrupt") and reasons["n3"].startswith("corrupt")


def test_both_nodes_of_a_group_dead_reports_the_shard_lost(make_cluster):
    cluster = make_cluster(4)
    names = ["n1", "n2", "n3", "n4"]
    cluster.set_membership(names, FOUR, round=1)
    originals = snapshot_all(cluster, FOUR, step=3)
    cluster.wait_idle()
    assert committed(cluster).version == (0, 3)
    assert committed(cluster).holders[0] == ("n1", "n2")
    cluster.kill("n1")
    cluster.kill("n2")
    n3 = cluster["n3"].replicator
    for rank in (0, 1, 2, 3):
        with pytest.raises(ShardLost) as info:
            n3.fetch(JOB, rank, (0, 3), into_buffer())
        assert {h for h, _ in info.value.attempts} == {"n1", "n2"}
    assert n3.stats().fetch_failures_total["lost"] == 4
    # The other group's shards are still there (n3 holds n4's in its own memory).
    buf = into_buffer()
    result = n3.fetch(JOB, 6, (0, 3), buf)
    assert result.holder == "n3" and bytes(buf[: result.descriptor.total_bytes]) == originals[6]


def payload_blocks(view) -> list[int]:
    """The snapshot offsets of a held copy's payload blocks."""
    lay = view.header.layout
    return [lay.block_range(i)[0] for i in range(lay.num_blocks)]


def test_replicas_keep_their_block_tags_and_fetches_are_checked_by_them(make_cluster):
    """The tags a push brought stay with the replica: a fetch of it is served pretagged (the
    holder sends each block as it lies, with the tag its owner made at the seal) and checked
    by the fetcher against those tags alone, as each block lands."""
    cluster = make_cluster(3)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    originals = snapshot_all(cluster, THREE, step=4)
    cluster.wait_idle()
    owner = cluster["n2"].local.latest(JOB, 2)
    replica = cluster["n3"].sink.store.latest(JOB, 2)
    assert replica.tags is not None and sorted(replica.tags.tags) == payload_blocks(replica)
    assert (replica.tags.salt, replica.tags.tags) == (owner.tags.salt, owner.tags.tags)
    cluster.kill("n2")
    buf = into_buffer()
    result = cluster["n1"].replicator.fetch(JOB, 2, (0, 4), buf)
    d = result.descriptor
    assert result.holder == "n3" and bytes(buf[: d.total_bytes]) == originals[2]
    assert result.tag_checked_bytes == d.total_bytes - replica.header.layout.data_offset


def test_a_replica_pushed_on_carries_its_owners_block_tags(make_cluster):
    """Re-replication after a node died: the survivor that held the dead node's ranks pushes
    them on with the tags their owner sealed them with, and the new holder keeps those."""
    cluster = make_cluster(3)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    snapshot_all(cluster, THREE, step=4)
    cluster.wait_idle()
    sealed = {r: cluster["n3"].local.latest(JOB, r).tags for r in (4, 5)}
    cluster.kill("n3")
    cluster.set_membership(["n1", "n2"], {"n1": [0, 1], "n2": [2, 3]}, round=2)
    cluster.wait_idle()
    for rank in (4, 5):
        moved = cluster["n2"].sink.store.latest(JOB, rank, verify=True)
        assert moved.tags is not None, rank
        assert (moved.tags.salt, moved.tags.tags) == (sealed[rank].salt, sealed[rank].tags)


def test_a_fetch_whose_served_block_tag_does_not_match_its_bytes_is_refused_and_counted(
        make_cluster):
    """A holder whose kept tag for a block is not that block's (its bytes still match their
    checksums): the fetcher refuses the copy as corrupt and counts it; the check that refused
    it is the block tag's, the only one made on a pretagged fetch."""
    cluster = make_cluster(3)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    snapshot_all(cluster, THREE, step=1)
    cluster.wait_idle()
    cluster.kill("n2")  # rank 2's copies: n3's replica alone now
    held = cluster["n3"].sink.store.latest(JOB, 2)
    first, second = payload_blocks(held)[:2]
    tags = held.tags.tags
    tags[first] = (tags[first][0], tags[second][1])  # the next block's tag, same length
    n1 = cluster["n1"].replicator
    with pytest.raises(ShardLost) as info:
        n1.fetch(JOB, 2, (0, 1), into_buffer())
    reason = dict(info.value.attempts)["n3"]
    assert reason.startswith("corrupt") and "block tag" in reason, reason
    assert n1.stats().fetch_failures_total["corrupt"] == 1
    cluster["n3"].sink.store.latest(JOB, 2, verify=True)  # its bytes still match the checksums


class SlowSink(ShmSink):
    """Holds every transfer of rank 0 until ``gate`` opens: a peer that cannot keep up."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.started = threading.Event()

    def allocate(self, d):
        if d.owner_rank == 0:
            self.started.set()
            self.gate.wait(15)
        return super().allocate(d)


def test_a_slow_peer_makes_intermediate_steps_skipped_not_queued(make_cluster):
    cluster = make_cluster(2, sink_cls=SlowSink)
    ranks = {"n1": [0, 1], "n2": [2, 3]}
    cluster.set_membership(["n1", "n2"], ranks, round=1)
    n1, n2 = cluster["n1"], cluster["n2"]
    n1.snapshot(0, 1, world=4)
    assert n2.sink.started.wait(5)  # the push of rank 0 is stuck at the peer
    for step in range(1, 6):  # rank 1 snapshots five times meanwhile
        n1.snapshot(1, step, world=4)
    backlog = n1.replicator.status()["backlog"]
    assert backlog == {"n2": 1}, "one pending push per shard, whatever the peer's speed"
    # The stuck push pins the slot it sends, so the owner's next-but-one snapshot of rank 0
    # is skipped by the store rather than tearing the bytes in flight.
    n1.snapshot(0, 2, world=4)
    with pytest.raises(SlotBusy):
        n1.snapshot(0, 3, world=4)
    n2.sink.gate.set()
    cluster.wait_idle()
    assert n1.replicator.stats().replication_skipped_total == 4
    assert n2.sink.held(JOB, 1).version == (0, 5)
    assert n2.sink.held(JOB, 0).version == (0, 2)
    pushes = n1.replicator.stats().replication_pushes_total
    assert pushes == 3, "rank 0 twice, rank 1 once (its newest step)"


def test_stale_duplicate_and_abandoned_pushes_never_replace_a_newer_copy(make_cluster):
    cluster = make_cluster(2)
    ranks = {"n1": [0], "n2": [1]}
    cluster.set_membership(["n1", "n2"], ranks, round=1)
    n1, n2 = cluster["n1"], cluster["n2"]
    data5 = n1.snapshot(0, 5, world=2)
    n2.snapshot(1, 5, world=2)  # committed: n1 sends nothing past an undecided (0, 5)
    cluster.wait_idle()
    assert n2.sink.held(JOB, 0).version == (0, 5)
    # The same version again (a retried push) and an older one are not taken.
    n1.replicator.on_local_snapshot(JOB, 0, (0, 5))
    n1.replicator.on_local_snapshot(JOB, 0, (0, 4))
    n2.sink.set_floor(JOB, 1)
    n1.snapshot(0, 6, world=2)  # a step of the abandoned generation 0
    cluster.wait_idle()
    assert n2.sink.held(JOB, 0).version == (0, 5)
    assert n1.replicator.stats().replication_failures_total == {"stale": 1}
    got = bytearray(1 << 20)
    d = n2.replicator.fetch(JOB, 0, (0, 5), got).descriptor
    assert bytes(got[: d.total_bytes]) == data5
    # The new generation wins even at a lower step.
    n1.replicator.start_generation(JOB, 1)
    n1.snapshot(0, 3, generation=1, world=2)
    n1.replicator.on_local_snapshot(JOB, 0, (0, 7))  # late notice from the old timeline
    cluster.wait_idle()
    assert n2.sink.held(JOB, 0).version == (1, 3)


def test_the_commit_record_never_goes_backwards_and_ignores_abandoned_generations(make_cluster):
    cluster = make_cluster(2)
    ranks = {"n1": [0], "n2": [1]}
    cluster.set_membership(["n1", "n2"], ranks, round=1)
    n1, n2 = cluster["n1"], cluster["n2"]
    for step in (1, 2):
        n1.snapshot(0, step, world=2)
        n2.snapshot(1, step, world=2)
        cluster.wait_idle()
        assert committed(cluster).version == (0, step)
    revisions = []
    cluster.coords[0].watch_prefix(cluster.keys.replication(JOB).committed,
                                   lambda ev: revisions.extend(ev), 0)
    # A fallback: generation 1 restarts at step 1, below the committed step 2.
    for node in (n1, n2):
        node.replicator.start_generation(JOB, 1)
    n1.snapshot(0, 1, generation=1, world=2)
    n2.snapshot(1, 1, generation=1, world=2)
    cluster.wait_idle()
    assert committed(cluster).version == (1, 1)
    values = [decode_committed(e.kv.value).version for e in revisions
              if e.kv.key == cluster.keys.replication(JOB).committed]
    assert values == sorted(values), f"commit went backwards: {values}"
    # n1's own view follows its watch of the record (wait_idle does not wait for that): its
    # lag is 0 once it learned (1, 1), the commit of the generation it snapshots now.
    wait_for(lambda: n1.replicator.stats().sync_lag_steps == 0)


def book(node):
    """The node's commit book of the job (what it retains and follows)."""
    return node.replicator.tracker.jobs[JOB].book


def awaiting_commit(node) -> list[list[int]]:
    """Acknowledged versions the node follows until committed or withdrawn (its status)."""
    return node.replicator.status()["jobs"].get(JOB, {}).get("awaiting_commit", [])


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def snapshot_as_service(node, rank: int, step: int, world: int = 2) -> bool:
    """What the checkpoint service does with a snapshot: skip it when the store says a commit
    is pending, and have the replicator resolve the copy in the way. True when it was taken."""
    try:
        node.snapshot(rank, step, world=world)
        return True
    except CommitPending as exc:
        node.replicator.on_commit_pending(JOB, exc.version)
        return False


def assert_every_named_holder_holds_the_commit(cluster: Cluster) -> None:
    c = committed(cluster)
    for rank in c.ranks:
        for name in c.holders[rank]:
            node = cluster[name]
            held = (node.local.latest(JOB, rank, version=c.version)
                    or node.sink.store.latest(JOB, rank, version=c.version))
            assert held is not None, f"{name} is named a holder of rank {rank} {c.version} " \
                f"but holds {node.local.versions(JOB, rank) or node.sink.versions(JOB, rank)}"


def step_2_of_n1_pending(make_cluster, **kw):
    """Two nodes, one rank each; step 1 committed; n1's step 2 acknowledged by n2, n2's own
    step 2 not taken yet (late: its daemon paused, say)."""
    cluster = make_cluster(2, **kw)
    cluster.set_membership(["n1", "n2"], {"n1": [0], "n2": [1]}, round=1)
    n1, n2 = cluster["n1"], cluster["n2"]
    n1.snapshot(0, 1, world=2)
    n2.snapshot(1, 1, world=2)
    cluster.wait_idle()
    assert committed(cluster).version == (0, 1)
    n1.snapshot(0, 2, world=2)
    cluster.wait_idle()
    return cluster, n1, n2


def test_a_step_is_never_committed_naming_a_holder_that_overwrote_it(make_cluster):
    # The race this guards (seen in a chaos run: a restore fell back to step 0): step 2 of
    # rank 0 is acknowledged by n2, then overwritten on n1 by step 3 while step 1 stays as the
    # committed copy; n2's rank 1 catches up with step 2, which commits naming n1 as a holder
    # of rank 0, whose copy is gone. Now n1 skips step 3 instead, withdraws step 2 after
    # withdraw_after, and only then reuses its slot; step 2 can no longer commit.
    cluster, n1, n2 = step_2_of_n1_pending(make_cluster)  # withdraw_after 0.5 s
    assert not snapshot_as_service(n1, 0, 3), "both slots hold copies that must stay"
    assert n1.local.versions(JOB, 0) == [(0, 2), (0, 1)]
    # withdraw_after passes: step 2 is withdrawn from n1's record, its slot may be reused.
    wait_for(lambda: not awaiting_commit(n1))
    assert n1.replicator.stats().withdrawals_total == 1
    assert snapshot_as_service(n1, 0, 3)
    cluster.wait_idle()
    # n2's replica of rank 0 step 2 was superseded by step 3 (its owner withdrew step 2).
    assert n2.sink.versions(JOB, 0) == [(0, 3), (0, 1)]
    n2.snapshot(1, 2, world=2)  # late: step 2 of rank 1 reaches its two copies
    cluster.wait_idle()
    assert committed(cluster).version == (0, 1), "a withdrawn step was committed"
    assert_every_named_holder_holds_the_commit(cluster)
    # n2's acknowledged step 2 can never commit either (n1's record lists step 3, not 2): n2
    # withdraws it at once, so its step 3 is not skipped. Nothing waits on that slot, so the
    # timeout cannot be what withdrew it (an unblocked version is never withdrawn on time).
    wait_for(lambda: not awaiting_commit(n2))
    assert n2.replicator.stats().withdrawals_total == 1
    assert snapshot_as_service(n2, 1, 3)
    cluster.wait_idle()
    assert committed(cluster).version == (0, 3)
    assert_every_named_holder_holds_the_commit(cluster)


def test_an_acknowledged_step_committed_while_its_owner_waits_is_kept(make_cluster):
    cluster, n1, n2 = step_2_of_n1_pending(make_cluster, withdraw_after=10.0)
    assert not snapshot_as_service(n1, 0, 3)  # step 2 waits for its commit, for 10 s
    n2.snapshot(1, 2, world=2)
    cluster.wait_idle()
    assert committed(cluster).version == (0, 2)
    wait_for(lambda: not awaiting_commit(n1))
    assert n1.replicator.stats().withdrawals_total == 0
    assert_every_named_holder_holds_the_commit(cluster)
    assert snapshot_as_service(n1, 0, 3)  # the slot of step 1, no longer committed, is reused
    assert n1.local.versions(JOB, 0) == [(0, 3), (0, 2)]


def withdrawal_fences_a_stale_commit(coord, keys: Keyspace, job: str = "j") -> None:
    """The coordinator decided step 2 from both nodes' reports, then n1 withdrew step 2: the
    coordinator's commit transaction must fail, n1's report from before its fence must no
    longer count, and a fresh decision from n1's next report commits step 1. A deposed
    coordinator's transaction fails too."""
    placement = compute_placement(["n1", "n2"], {"n1": [0], "n2": [1]}, 2, 1)
    lease = coord.grant_lease(30)
    term_rev = campaign(coord, keys, job, "n1", 7, lease, 0.0)
    assert term_rev and campaign(coord, keys, job, "n2", 8, lease, 0.0) is None
    tally = Tally(7, term_rev, placement)
    tally.take_fences(*read_fences(coord, keys, job))
    seq = iter(range(1, 100))

    def report(node, rank, fence, *versions):
        return Report(job, node, 7, placement_digest(placement), 1, next(seq), fence, 0,
                      {rank: tuple(versions)})

    def commit(write):
        c = commit_of(write.version, placement, "n1", 1.0)
        g = write.guards
        return coord.transaction(*commit_txn(keys, job, c, (g.term, g.epoch, g.committed),
                                             placement if write.placement else None))

    assert tally.report(report("n1", 0, 0, (0, 2), (0, 1))).accepted
    assert tally.report(report("n2", 1, 0, (0, 2), (0, 1))).accepted
    stale = tally.next_write()
    assert isinstance(stale, CommitWrite) and stale.version == (0, 2)
    fence, now = withdraw(coord, keys, job, "n1", [(0, 2)], 1.0)
    assert now is None and read_fence(coord, keys, job, "n1") == (fence, ((0, 2),))
    assert not commit(stale)[0], "a commit decided before the withdrawal landed after it"
    tally.take_fences(*read_fences(coord, keys, job))
    assert not isinstance(tally.next_write(), CommitWrite), \
        "n1's report from before its fence still counts"
    assert tally.report(report("n1", 0, 0, (0, 2), (0, 1))).reason == "fenced"
    assert tally.report(report("n1", 0, fence, (0, 1))).accepted
    write = tally.next_write()
    assert write.version == (0, 1)
    ok, revision = commit(write)
    assert ok
    tally.wrote(write, revision)
    assert read_committed(coord, keys, job, [placement]).version == (0, 1)
    # A withdrawal right after a commit of the same step: its read says it is committed.
    tally.report(report("n1", 0, fence, (0, 3), (0, 1)))
    tally.report(report("n2", 1, 0, (0, 3), (0, 1)))
    write = tally.next_write()
    assert write.version == (0, 3) and commit(write)[0]
    fence, now = withdraw(coord, keys, job, "n1", [(0, 3), (0, 2)], 2.0)
    assert now.version == (0, 3) and now.holders[0] == ("n1", "n2")
    # Deposed (the election lease expired): nothing it decided lands any more.
    tally.take_fences(*read_fences(coord, keys, job))
    tally.report(report("n1", 0, fence, (0, 4)))
    tally.report(report("n2", 1, 0, (0, 4)))
    write = tally.next_write()
    assert write.version == (0, 4)
    coord.revoke_lease(lease)
    assert not commit(write)[0], "a deposed coordinator wrote"
    assert read_committed(coord, keys, job, [placement]).version == (0, 3)


def test_a_withdrawal_fences_a_commit_decided_from_the_older_record():
    coord = MemoryCoordinator(MemoryStore())
    try:
        withdrawal_fences_a_stale_commit(coord, Keyspace("/t"))
    finally:
        coord.close()


def test_rereplication_restores_m_copies_after_a_node_dies(make_cluster):
    cluster = make_cluster(3)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    originals = snapshot_all(cluster, THREE, step=4)
    cluster.wait_idle()
    cluster.kill("n3")
    survivors = {"n1": [0, 1], "n2": [2, 3]}
    cluster.set_membership(["n1", "n2"], survivors, round=2)
    cluster.wait_idle()
    record = committed(cluster)
    assert record.version == (0, 4)
    for rank in range(6):
        assert len(set(record.holders[rank]) & {"n1", "n2"}) == 2, record.holders
    assert cluster["n1"].replicator.stats().under_replicated_shards == 0
    # n3's shards were held by n1 only; n2 now has them, byte-identical, in its replica store.
    for rank in (4, 5):
        view = cluster["n2"].sink.store.latest(JOB, rank, verify=True)
        assert bytes(view.buffer) == originals[rank]
    assert cluster["n1"].replicator.stats().rereplications_total == 2
    assert cluster["n2"].replicator.stats().rereplications_total == 2


def test_drain_hands_every_copy_over_before_leaving(make_cluster):
    cluster = make_cluster(3)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    originals = snapshot_all(cluster, THREE, step=2)
    cluster.wait_idle()
    report = cluster["n1"].replicator.drain(timeout=20)
    assert report[JOB]["complete"] and report[JOB]["version"] == [0, 2]
    assert sorted(report[JOB]["pushed"]) == [(0, "n3"), (1, "n3"), (4, "n2"), (5, "n2")]
    record = committed(cluster)
    for rank in range(6):
        holders = record.holders[rank]
        assert "n1" not in holders and len(holders) == 2, record.holders
    cluster.kill("n1")
    n2 = cluster["n2"].replicator
    for rank in (0, 1, 4, 5):
        buf = into_buffer()
        result = n2.fetch(JOB, rank, (0, 2), buf)
        assert bytes(buf[: result.descriptor.total_bytes]) == originals[rank]


def test_replicas_no_longer_wanted_are_freed_after_the_next_commit(make_cluster):
    cluster = make_cluster(4)
    names = ["n1", "n2", "n3", "n4"]
    cluster.set_membership(names, FOUR, round=1)
    snapshot_all(cluster, FOUR, step=1)
    cluster.wait_idle()
    assert {d.owner_rank for d in cluster["n2"].sink.holdings()} == {0, 1}
    # n2 leaves cleanly (after a drain); the new round regroups [n1, n3] and ranks move.
    cluster["n2"].replicator.drain(timeout=20)
    cluster.kill("n2")
    ranks = {"n1": [0, 1], "n3": [2, 3], "n4": [4, 5]}
    cluster.set_membership(["n1", "n3", "n4"], ranks, round=2)
    cluster.wait_idle()
    snapshot_all(cluster, ranks, step=2)
    cluster.wait_idle()
    assert committed(cluster).version == (0, 2)
    time.sleep(0.1)
    cluster.wait_idle()
    held = {d.owner_rank for d in cluster["n3"].sink.holdings()}
    wanted = {0, 1}  # ring n1 -> n3 -> n4 -> n1: n3 holds n1's ranks of the new round
    assert held == wanted, held


def test_a_dead_owners_shard_is_fetched_into_the_local_store_of_its_new_host(make_cluster):
    cluster = make_cluster(3)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    originals = snapshot_all(cluster, THREE, step=6)
    cluster.wait_idle()
    cluster.kill("n3")
    # Rank 4 now runs on n2 (which never held it): the daemon pulls it into its local slots,
    # where the worker's usual local restore finds it.
    result = cluster["n2"].replicator.fetch_to_local(JOB, 4, (0, 6))
    assert result.holder == "n1" and result.wire_bytes >= len(originals[4])
    view = cluster["n2"].local.latest(JOB, 4, verify=True)
    assert view.header.version() == (0, 6) and bytes(view.buffer) == originals[4]


def test_a_node_new_to_the_job_fetches_from_the_committed_records_holders(make_cluster):
    """A standby that was in no round of the job (no placement, no cached commit) takes over
    a dead node's rank: it finds the holders in etcd's committed record."""
    cluster = make_cluster(4)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    originals = snapshot_all(cluster, THREE, step=3)
    cluster.wait_idle()
    assert committed(cluster).version == (0, 3)
    cluster.kill("n2")
    result = cluster["n4"].replicator.fetch_to_local(JOB, 2, (0, 3))
    assert result.holder == "n3" and result.wire_bytes >= len(originals[2])
    view = cluster["n4"].local.latest(JOB, 2, verify=True)
    assert view.header.version() == (0, 3) and bytes(view.buffer) == originals[2]


def test_the_daemon_side_of_replication_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, elasticd.recovery.replicator, elasticd.replication.shm_sink, "
            "elasticd.recovery.fetch; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_peer_gone_from_the_address_book_loses_its_pooled_connection():
    # A frozen peer's socket stays open: reusing it for a fetch waited for the whole timeout.
    from elasticd.replication.lanes import Connections, NoAddress

    class Pooled:
        closed = False

        def close(self):
            self.closed = True

    book = {"n2": ("127.0.0.1", 1)}
    conns = Connections("n1", b"s" * 32, book.get)
    pooled = Pooled()
    conns._clients["n2"] = pooled
    assert conns.get("n2") == (pooled, True)
    del book["n2"]  # declared dead: the membership forgot it
    with pytest.raises(NoAddress, match="n2"):
        conns.get("n2")
    assert pooled.closed and "n2" not in conns._clients


def test_followed_versions_are_forgotten_once_committed(make_cluster):
    # Every acknowledged version is followed until committed or withdrawn. One that nothing
    # waits on and that commits only after withdraw_after (0.5 s) stops being followed
    # undecided; its commit must still clear what was kept about it (a run lasts weeks).
    cluster = make_cluster(2)
    cluster.set_membership(["n1", "n2"], {"n1": [0], "n2": [1]}, round=1)
    n1, n2 = cluster["n1"], cluster["n2"]
    n1.snapshot(0, 1, world=2)
    cluster.wait_idle()
    assert awaiting_commit(n1) == [[0, 1]]
    wait_for(lambda: not awaiting_commit(n1))  # withdraw_after passes
    assert book(n1).entries, "followed undecided: still remembered"
    n2.snapshot(1, 1, world=2)
    cluster.wait_idle()
    assert committed(cluster).version == (0, 1)
    for node in (n1, n2):
        wait_for(lambda: not awaiting_commit(node))
        assert not book(node).entries, "a committed version is still remembered"
        assert retained(node.local, JOB) == {(0, 1)}, "only the commit stays retained"
        assert not retained_by_any_rank(node.local)


def test_only_the_owners_fence_says_a_copy_can_never_be_committed(make_cluster):
    # A sink with two undecided copies of a rank lets go of one only when the rank's owner
    # lists it as withdrawn in its fence record; another node's record (stale or hostile)
    # does not count, and nor does an owner's record that does not list it.
    cluster = make_cluster(3)
    cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
    coord, tracker = cluster.coords[0], cluster["n3"].replicator.tracker
    for node, withdrawn in (("n1", ((0, 7),)), ("n2", ((0, 8),))):
        coord.put(cluster.keys.replication(JOB).fence(node), encode_fence(node, withdrawn))
    coord.put(cluster.keys.replication(JOB).fence("n3"), encode_fence("n1", [(0, 9)]))  # lies
    assert tracker.never_committed(JOB, 0, [(0, 7), (0, 8)]) == {(0, 7)}  # rank 0: n1's
    assert tracker.never_committed(JOB, 2, [(0, 7), (0, 8)]) == {(0, 8)}  # rank 2: n2's
    assert tracker.never_committed(JOB, 4, [(0, 7), (0, 9)]) == set()  # n3's names n1
    assert tracker.never_committed(JOB, 9, [(0, 7)]) == set()  # no owner in the placement


def test_a_withdrawal_stays_in_the_owners_fence_however_many_steps_it_skips_after(
        make_cluster):
    # Chaos run: an owner withdrew a version, then skipped a snapshot every step while its
    # other copy waited; the skips pushed the withdrawal out of its record (8 entries), and the
    # peer holding both undecided copies refused every later copy of the rank: no commit for 50
    # steps, then a restore from step 0.
    cluster = make_cluster(2)
    cluster.set_membership(["n1", "n2"], {"n1": [0], "n2": [1]}, round=1)
    n1, n2 = cluster["n1"], cluster["n2"]
    n1.snapshot(0, 1, world=2)  # acknowledged by n2, never committed (rank 1 has no step 1)
    cluster.wait_idle()
    n1.replicator.on_commit_pending(JOB, (0, 1), skipped=(0, 2))
    wait_for(lambda: n1.replicator.tracker.counters["withdrawals"] == 1)
    for step in range(3, 3 + 2 * KEEP_SKIPPED):
        n1.replicator.tracker.on_skipped(JOB, (0, step))
    assert read_fence(cluster.coords[0], cluster.keys, JOB, "n1")[1] == ((0, 1),)
    assert n2.replicator.tracker.never_committed(JOB, 0, [(0, 1)]) == {(0, 1)}
    # the withdrawal widened the job's snapshot grid, and every node follows it
    wait_for(lambda: n1.replicator.snapshot_grid(JOB) == n2.replicator.snapshot_grid(JOB) == 2)
