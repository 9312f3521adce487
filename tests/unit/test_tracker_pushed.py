"""One call for an acknowledged push of several ranks (:meth:`CommitTracker.on_pushed`): the
same landings, acknowledgements and m-copy versions as one call per rank, under one hold of
the tracker's lock, and the report asked for once, when the node's last rank has its
copies."""

from __future__ import annotations

from elasticd.clock import SystemClock
from elasticd.coordination.keys import Keyspace
from elasticd.replication.background import Background
from elasticd.replication.placement import compute_placement
from elasticd.replication.tracker import CommitTracker
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore

JOB, RANKS = "job", tuple(range(8))


def tracker(background: Background) -> tuple[CommitTracker, list[str]]:
    t = CommitTracker("n1", MemoryCoordinator(MemoryStore()), Keyspace("/t"), SystemClock(),
                      background, lambda job: None, commit_wait=0.0, withdraw_after=60.0)
    t.set_placement(JOB, compute_placement(["n1", "n2"], {"n1": RANKS, "n2": range(8, 16)}, 2,
                                           round=1))
    asked: list[str] = []
    t.reporter.changed = asked.append  # type: ignore[method-assign]
    return t, asked


def state(t: CommitTracker) -> tuple:
    st = t.jobs[JOB]
    return (dict(st.replicated), {r: {v: set(p) for v, p in vs.items()}
                                  for r, vs in st.acked.items()},
            {v: (e.phase, set(e.copies)) for v, e in st.book.entries.items()})


def test_one_call_for_a_push_of_every_rank_leaves_what_the_per_rank_calls_leave():
    background = Background("pushed-test", 2)
    (one, asked_one), (each, asked_each) = tracker(background), tracker(background)
    try:
        for step in (1, 2):
            one.on_pushed(JOB, (0, step), RANKS[:5], "n2")
            one.on_pushed(JOB, (0, step), RANKS[5:], "n2")
            for rank in RANKS:
                each.on_pushed(JOB, (0, step), (rank,), "n2")
        assert state(one) == state(each)
        assert one.jobs[JOB].replicated[3] == [(0, 2), (0, 1)]
        assert asked_one == asked_each == [JOB, JOB]  # once per step: its last rank's copy
    finally:
        for t in (one, each):
            t.close()
        background.close()


def test_a_push_acknowledged_by_a_peer_outside_the_placement_completes_nothing():
    background = Background("pushed-test", 2)
    t, asked = tracker(background)
    try:
        t.on_pushed(JOB, (0, 1), RANKS, "n9")
        assert asked == [] and t.jobs[JOB].replicated == {}
        assert set(t.jobs[JOB].book.entries) == {(0, 1)}  # landed all the same: it stays
    finally:
        t.close()
        background.close()


def test_a_push_of_every_rank_is_one_event_to_the_commit_book_and_one_set_of_actions(
        monkeypatch):
    # Every node, every step: the per-rank calls made 8 events and performed 8 sets of actions
    # (each retention still reaches the store: one per rank).
    from elasticd.replication import tracker as module
    performed: list = []
    real = module.apply_actions
    monkeypatch.setattr(module, "apply_actions",
                        lambda book, job, actions, stores: (performed.append(actions),
                                                            real(book, job, actions, stores)))
    background = Background("pushed-test", 2)
    t, asked = tracker(background)
    try:
        t.on_pushed(JOB, (0, 1), RANKS, "n2")
        assert len(performed) == 1
        assert [r.rank for r in performed[0].retain] == list(RANKS)
        assert performed[0].follow == (0, 1) and asked == [JOB]
    finally:
        t.close()
        background.close()
