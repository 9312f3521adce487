"""The committed step across generations, on real slot stores, sinks and replica servers (the
in-memory coordinator): a restore opens a new generation, and until that generation commits,
the commit it restored is still the job's committed step, the one a second failure restores.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from elasticd.replication.api import STALE, Descriptor, Refused
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


THREE = {"n1": [0, 1], "n2": [2, 3], "n3": [4, 5]}


def test_the_kept_commit_is_handed_over_below_the_floor():
    # Seen in a one-host run: a restore opened generation 1, and the kept commit's re-
    # replication and drain were refused by every sink ("stale: generation 0 of fsdp was
    # abandoned"), so a holder that died or left was not replaced until generation 1 committed.
    store = MemoryStore()
    with contextlib.closing(Cluster(lambda: MemoryCoordinator(store), 3, 2)) as cluster:
        cluster.set_membership(["n1", "n2", "n3"], THREE, round=1)
        data = {rank: cluster[name].snapshot(rank, 2, world=6)
                for name, ranks in THREE.items() for rank in ranks}
        cluster.wait_idle()
        assert read_committed(cluster.coords[0], cluster.keys, JOB).version == (0, 2)
        for node in cluster.live():
            node.replicator.start_generation(JOB, 1)
        newer = cluster["n2"].snapshot(2, 3, generation=1, world=6, notify=False)
        report = cluster["n1"].replicator.drain(timeout=20)[JOB]
        assert report["complete"] and report["version"] == [0, 2], report
        assert sorted(report["pushed"]) == [(0, "n3"), (1, "n3"), (4, "n2"), (5, "n2")]
        record = read_committed(cluster.coords[0], cluster.keys, JOB)
        assert all("n1" not in hs and len(hs) == 2 for hs in record.holders.values()), record
        assert cluster["n3"].sink.held(JOB, 0).version == (0, 2)
        # Any other copy below the floor is still refused: it can never commit.
        with pytest.raises(Refused) as refused:
            cluster["n3"].sink.allocate(Descriptor(JOB, 2, 0, 1, 4096, 512))
        assert refused.value.reason == STALE
        cluster.kill("n1")
        for rank in (0, 1, 4, 5):
            got = bytearray(1 << 20)
            holder = cluster["n2"] if rank in (0, 1) else cluster["n3"]
            d = holder.replicator.fetch(JOB, rank, (0, 2), got).descriptor
            assert bytes(got[: d.total_bytes]) == data[rank], rank
        # n2's newer copy of generation 1 did not take the place of its kept commit.
        assert newer != data[2] and (0, 2) in cluster["n2"].local.versions(JOB, 2)
    assert not os.path.exists(cluster.base)
