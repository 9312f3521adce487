"""The daemon's view of peer replication (:class:`~elasticd.daemon.replica_view.ReplicaView`):
which rounds it hands the replicator."""

from __future__ import annotations

import types

from elasticd.daemon.replica_view import ReplicaView
from elasticd.replication.placement import compute_placement


class Replicator:
    """The replicator's placement per job, and the rounds it was given."""

    def __init__(self) -> None:
        self.placements: dict = {}
        self.given: list = []
        self.tracker = types.SimpleNamespace(
            view=lambda job: (self.placements.get(job), None))

    def set_membership(self, job, nodes, ranks, round=0):
        self.given.append((job, list(nodes)))
        self.placements[job] = compute_placement(nodes, ranks, 2, round)


def test_a_round_without_this_node_is_given_only_while_the_replicator_places_it():
    """A daemon woken from SIGSTOP, declared dead meanwhile, won the commit election as its
    stale placement's first node before it learned; the round the others went on with does
    not include it and was never given to its replicator, so its term stayed on a placement
    no owner reports on and nothing committed again (CI, the frozen-holder chaos test). Given
    the round without it, the term resigns (Reporter.placement_changed)."""
    jobs = types.SimpleNamespace(job="j", ranks={"n1": [0], "n2": [1], "n3": [2]})
    jobs.round_ranks = lambda: jobs.ranks
    rep = Replicator()
    view = ReplicaView("n2", rep, jobs)  # type: ignore[arg-type]
    assert view.follow_round() == "replica placement for 3 nodes"
    jobs.ranks = {"n1": [0], "n3": [1]}  # the others went on at world 2
    assert view.follow_round() == "replica placement for 2 nodes"
    assert rep.given[-1] == ("j", ["n1", "n3"])
    assert "n2" not in rep.placements["j"].nodes
    jobs.ranks = {"n3": [0], "n1": [1]}  # no longer placed here: further rounds are theirs
    assert view.follow_round() is None and len(rep.given) == 2


def test_a_node_never_placed_is_given_no_round_it_is_not_in():
    jobs = types.SimpleNamespace(job="j", round_ranks=lambda: {"n1": [0], "n3": [1]})
    rep = Replicator()
    assert ReplicaView("n2", rep, jobs).follow_round() is None  # type: ignore[arg-type]
    assert rep.given == []
