"""The committed step across generations, on real slot stores, sinks and replica servers (the
in-memory coordinator): a restore opens a new generation, and until that generation commits,
the commit it restored is still the job's committed step, the one a second failure restores.
"""

from __future__ import annotations

import contextlib
import os

from elasticd.replication.commit import read_committed
from elasticd.store.shm import CommitPending
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from tests.replication_nodes import JOB, Cluster

RANKS = {"n1": [0], "n2": [1]}


def test_a_generation_that_commits_nothing_keeps_every_copy_of_the_commit():
    store = MemoryStore()
    with contextlib.closing(Cluster(lambda: MemoryCoordinator(store), 2, 2)) as cluster:
        a_generation_that_commits_nothing(cluster)
    assert not os.path.exists(cluster.base)


def a_generation_that_commits_nothing(cluster: Cluster) -> None:
    # The CI failure of test_sigstop_daemon_without_standby_restores_the_committed_step: (0, 2)
    # committed; a restore of it opened generation 1, whose nodes snapshotted different steps
    # (its coordinator frozen, there) so nothing of it committed; the floor had let (0, 2) go
    # everywhere, the new snapshots took its slots, and the next restore found no intact copy
    # of it: every rank restored step 0.
    cluster.set_membership(["n1", "n2"], RANKS, round=1)
    n1, n2 = cluster["n1"], cluster["n2"]
    data = {}
    for step in (1, 2):
        data[0] = n1.snapshot(0, step, world=2)
        data[1] = n2.snapshot(1, step, world=2)
        cluster.wait_idle()
    assert read_committed(cluster.coords[0], cluster.keys, JOB).version == (0, 2)
    for node in (n1, n2):
        node.replicator.start_generation(JOB, 1)
    for step in range(3, 13):
        node, rank = (n1, 0) if step % 2 else (n2, 1)
        try:
            node.snapshot(rank, step, generation=1, world=2)
        except CommitPending as exc:  # skipped, as the checkpoint service does
            node.replicator.on_commit_pending(JOB, exc.version, (1, step))
        cluster.wait_idle()
    assert read_committed(cluster.coords[0], cluster.keys, JOB).version == (0, 2), \
        "nothing of generation 1 can commit: no step is common to both nodes"
    assert n1.sink.held(JOB, 1) is not None and n2.sink.held(JOB, 0) is not None
    # Every holder the record names still has its copy: the owner's, and the peer's replica.
    for owner, peer, rank in ((n1, n2, 0), (n2, n1, 1)):
        assert (0, 2) in owner.local.versions(JOB, rank), f"{owner.name} lost its rank {rank}"
        assert (0, 2) in peer.sink.store.versions(JOB, rank), \
            f"{peer.name} lost its replica of rank {rank}"
        got = bytearray(1 << 20)
        d = peer.replicator.fetch(JOB, rank, (0, 2), got).descriptor  # what a restore reads
        assert d.version == (0, 2)
        assert bytes(got[: d.total_bytes]) == data[rank]
