"""When the commit tracker hands a commit to ``on_advance`` (the replicator's collection of
replicas the placement no longer gives this node): at the first commit past a placement change,
then only when what the collection reads changed since (the commit's holders, a replica of a rank
the placement does not give this node), not at every commit of every node."""

from __future__ import annotations

from elasticd.clock import SystemClock
from elasticd.coordination.keys import Keyspace
from elasticd.replication.background import Background
from elasticd.replication.commit import commit_of
from elasticd.replication.commit_state import Holder
from elasticd.replication.placement import compute_placement
from elasticd.replication.tracker import CommitTracker
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore

JOB = "job"


def test_a_commit_is_handed_to_on_advance_only_when_what_it_reads_changed():
    background, advanced = Background("advance-test", 2), []
    t = CommitTracker("n1", MemoryCoordinator(MemoryStore()), Keyspace("/t"), SystemClock(),
                      background, advanced.append, commit_wait=0.0, withdraw_after=60.0)
    nodes = ["n1", "n2", "n3"]
    placement = compute_placement(nodes, {n: [k] for k, n in enumerate(nodes)}, 2, round=1)
    try:
        t.set_placement(JOB, placement)
        held = {r for o in placement.held_by("n1") for r in placement.ranks[o]}

        def commit(step: int) -> None:
            t.learn(JOB, commit_of((0, step), placement, "n2", 0.0))
            assert background.wait_idle(10)

        commit(1)
        commit(2)
        commit(3)
        assert advanced == [JOB]  # the first commit under the placement; then nothing changed
        t.on_landed(JOB, next(iter(held)), (0, 4), Holder.REPLICA)  # a replica it holds
        commit(4)
        assert advanced == [JOB]
        stray = next(r for r in range(3) if r not in held)
        t.on_landed(JOB, stray, (0, 5), Holder.REPLICA)  # e.g. a push under an old placement
        commit(5)
        assert advanced == [JOB, JOB]
        commit(6)
        assert advanced == [JOB, JOB]
        t.set_placement(JOB, compute_placement(nodes[:2], {"n1": [0, 2], "n2": [1]}, 2,
                                               round=2))
        commit(7)
        assert advanced == [JOB, JOB, JOB]  # the first commit past the change
    finally:
        t.close()
        background.close()
