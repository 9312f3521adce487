"""The persistent tier under peer replication: every node flushes the committed steps, so the
steps complete on disk even when the nodes' own snapshots differ.

Several nodes write one step's ranks into a shared directory and the step is complete only once
every rank is there. Decided on each node's own completed snapshots, the nodes of a loaded job
picked different steps (a snapshot skipped while both slots waited for a commit moved that
node's flush to the next step it took; a busy writer skipped it), and CI saw a job whose tier
held no complete step at all when it was needed (tests/chaos/test_corrupt_replica.py). Here
three nodes' checkpoint services, each with its own slots and persister on one shared tier,
snapshot different steps as the CI run's nodes did, and one node's writer is busy when the
commit comes.
"""

from __future__ import annotations

import shutil
import threading
import uuid

import pytest

from elasticd.metrics import CheckpointSink, Metrics
from elasticd.persistence.persister import Persister
from elasticd.persistence.tier import Tier
from elasticd.replication.tracker import CommitFeed
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.testing.transport import InProcessTransport
from elasticd.store.api import Replication
from tests.unit.test_persistence import View, snapshot
from tests.unit.test_store_service import write_snapshot


class Commits(Replication):
    """The node's replication as the checkpoint service sees it: its snapshots are committed,
    and the test says when (the real tracker's retention: the committed copy stays in this
    node's slots until the next commit)."""

    def __init__(self, store: SlotStore) -> None:
        self.store, self.feed, self.committed = store, CommitFeed(), None

    def add_commit_listener(self, listener):
        self.feed.listeners.append(listener)

    def follows_commits(self, job):
        return True

    def on_local_snapshot(self, job, rank, version):
        pass

    def commit(self, job, version):
        self.store.retain(job, None, version)
        if self.committed is not None:
            self.store.release_retained(job, None, self.committed)
        self.committed = version
        self.feed.tell(job, version, self.feed.claim(True))


def busy(metrics: Metrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("elasticd_persist_writer_busy_total",
                                             {"outcome": outcome})


@pytest.fixture
def cluster(tmp_path):
    """Three nodes (one rank each of a world of 3) flushing into one tier every 10 steps."""
    roots = [f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}" for _ in range(3)]
    stores: list[SlotStore] = []
    persisters: list[Persister] = []
    try:  # from the first store made: a set-up that fails must not leave it in /dev/shm
        for root in roots:  # one at a time: each made is in the list the cleanup closes
            stores.append(SlotStore(root))
        for i in (1, 2, 3):
            persisters.append(Persister(str(tmp_path / "persist"), keep=5, every_steps=10,
                                        node_id=f"n{i}"))
        reps, metrics = [Commits(store) for store in stores], [Metrics() for _ in range(3)]
        services = [CheckpointService(store, f"n{i + 1}", persist, replicator=rep,
                                      metrics_sink=CheckpointSink(m))
                    for i, (store, persist, rep, m) in enumerate(zip(stores, persisters, reps,
                                                                      metrics))]
        yield ([InProcessTransport(s.handlers()) for s in services], persisters, reps, stores,
               metrics)
    finally:
        for p in persisters:
            p.close()
        for store in stores:
            store.close()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def test_nodes_that_snapshotted_different_steps_persist_the_committed_one(cluster,
                                                                          monkeypatch):
    transports, persisters, reps, stores, metrics = cluster

    def snap(node, step):
        done, _ = write_snapshot(transports[node], "job", node, step, world=3, local_world=1)
        assert done["step"] == step

    def commit(version):
        for rep in reps:
            rep.commit("job", version)

    # n3's writer is busy (a slow disk) from before step 10 until after the commit of 16.
    gate, real = threading.Event(), persisters[2].tier.write_rank
    monkeypatch.setattr(persisters[2].tier, "write_rank",
                        lambda header, buf, uid=None: (gate.wait(10), real(header, buf, uid))[1])
    write_snapshot(transports[2], "other", 0, 1, world=1)
    assert persisters[2].submit("other", [stores[2].latest("other", 0, pin=True)])
    try:
        for node in range(3):
            snap(node, 8)
        commit((0, 8))
        # As in the CI run: n1 took 9 and 12 (its 10 skipped), n2 and n3 took 10; then all 16.
        for node, steps in ((0, (9, 12)), (1, (10,)), (2, (10,))):
            for step in steps:
                snap(node, step)
        persisters[0].flush(10)
        persisters[1].flush(10)
        for node in range(3):
            snap(node, 16)
        commit((0, 16))
        persisters[0].flush(10)
        persisters[1].flush(10)
        assert not Tier(persisters[0].root).complete_steps("job")  # n3 has not written yet
    finally:
        gate.set()
    assert persisters[2].flush(10)
    tier = Tier(persisters[0].root)
    assert [m.version() for m in tier.complete_steps("job")] == [(0, 16)]
    assert sorted(tier.manifest("job", (0, 16)).ranks) == [0, 1, 2]
    assert [busy(m, "waited") for m in metrics] == [0, 0, 1]  # n3 waited for its writer
    assert all(busy(m, "skipped") == 0 for m in metrics)


def test_a_step_offered_while_the_writer_is_busy_waits_for_it_when_it_can_be_taken_again(
        tmp_path, monkeypatch):
    persister = Persister(str(tmp_path), keep=5)
    gate, real = threading.Event(), persister.tier.write_rank
    monkeypatch.setattr(persister.tier, "write_rank",
                        lambda header, buf, uid=None: (gate.wait(10), real(header, buf, uid))[1])
    taken = []

    def views(step):
        return [View(*snapshot(rank=r, step=step)) for r in (0, 1)]

    def again(step):
        return lambda: taken.append(step) or views(step)

    try:
        assert persister.submit("job", views(2)) is True
        busy = views(3)
        assert persister.submit("job", busy, retry=again(3)) is False
        assert [v.released for v in busy] == [1, 1]  # not pinned while it waits
        assert persister.submit("job", views(4), retry=again(4)) is False  # replaces step 3
        assert persister.submit("gone", views(5), retry=lambda: None) is False
        assert persister.submit("job", views(6)) is False  # no way to take it again: skipped
    finally:
        gate.set()
    assert persister.flush(10)
    assert taken == [4]
    assert [m.version() for m in persister.tier.complete_steps("job")] == [(0, 4), (0, 2)]
    assert not persister.tier.complete_steps("gone")  # its copies went while it waited
    persister.close()


def test_commits_are_told_in_the_order_learned_and_a_failing_listener_stops_nothing():
    feed, told = CommitFeed(), []

    def broken(job, version):
        raise RuntimeError("listener bug")

    feed.listeners.append(broken)
    feed.listeners.append(lambda job, version: told.append(version))
    assert feed.claim(False) is False
    feed.tell("job", (0, 1), False)  # not newer: nobody is told
    first = feed.claim(True)
    later = threading.Thread(target=lambda: feed.tell("job", (0, 3), feed.claim(True)))
    later.start()
    later.join(0.2)
    assert later.is_alive()  # the commit learned second waits for the first to be told
    feed.tell("job", (0, 2), first)
    later.join(5)
    assert told == [(0, 2), (0, 3)]


def test_the_tracker_tells_each_newer_live_commit_it_learns():
    from elasticd.clock import SystemClock
    from elasticd.coordination.keys import Keyspace
    from elasticd.replication.background import Background
    from elasticd.replication.commit import Committed
    from elasticd.replication.tracker import CommitTracker
    from elasticd.testing.coordination import MemoryCoordinator

    background = Background("test-tracker", 1)
    tracker = CommitTracker("n1", MemoryCoordinator(), Keyspace("/t"), SystemClock(), background,
                            on_advance=lambda job: None)
    told = []
    tracker.commits.listeners.append(lambda job, version: told.append((job, version)))
    with tracker.lock:
        tracker.state("job")

    def learn(generation, step, holders=("n1", "n2")):
        tracker.learn("job", Committed(generation, step, (0,), {0: holders}))

    learn(0, 4)
    learn(0, 4, holders=("n1", "n3"))  # the same step, re-replicated: not a new commit
    learn(0, 2)  # older: ignored
    learn(0, 8)
    tracker.start_generation("job", 2)
    learn(1, 9)  # a generation below the floor: abandoned, never flushed
    learn(2, 3)
    assert told == [("job", (0, 4)), ("job", (0, 8)), ("job", (2, 3))]
    tracker.close()
    background.close()


def test_real_replicators_commits_reach_each_nodes_persister_and_a_busy_one_waits(tmp_path):
    """The wiring, with real replicators (in-memory etcd, real transport): each node's service
    hears its tracker's commits and flushes them; a node whose writer is busy when the commit
    comes writes it afterwards, so the step completes (the old rule skipped it there)."""
    from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
    from tests.replication_nodes import JOB, Cluster

    store = MemoryStore()
    cluster = Cluster(lambda: MemoryCoordinator(store), 3, 2)
    names = ["n1", "n2", "n3"]
    persisters = [Persister(str(tmp_path / "persist"), keep=5, every_steps=10, node_id=n)
                  for n in names]
    metrics = Metrics()
    services = [CheckpointService(cluster[n].local, n, p, replicator=cluster[n].replicator,
                                  metrics_sink=CheckpointSink(metrics))
                for n, p in zip(names, persisters)]
    transports = [InProcessTransport(s.handlers()) for s in services]
    gate, real = threading.Event(), persisters[2].tier.write_rank
    persisters[2].tier.write_rank = lambda header, buf, uid=None: (gate.wait(10),
                                                                   real(header, buf, uid))[1]
    try:
        cluster.set_membership(names, {n: [i] for i, n in enumerate(names)}, round=1)
        assert all(cluster[n].replicator.follows_commits(JOB) for n in names)
        write_snapshot(transports[2], "other", 0, 1, world=1)  # n3's writer: busy from here
        assert persisters[2].submit("other", [cluster["n3"].local.latest("other", 0, pin=True)])
        for step in (4, 8, 12):
            for i, t in enumerate(transports):
                write_snapshot(t, JOB, i, step, world=3, local_world=1)
            cluster.wait_idle()
        assert cluster["n1"].replicator.stats().committed_step == 12
        persisters[0].flush(10)
        persisters[1].flush(10)
        assert not Tier(persisters[0].root).complete_steps(JOB)  # n3 has not written yet
        gate.set()
        assert persisters[2].flush(10)
        assert [m.version() for m in Tier(persisters[0].root).complete_steps(JOB)] == [(0, 12)]
        assert busy(metrics, "waited") == 1  # n3's (the other nodes' writers were free)
    finally:
        gate.set()
        for p in persisters:
            p.close()
        cluster.close()
