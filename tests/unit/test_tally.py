"""The commit coordinator's counts (:class:`~elasticd.replication.tally.Tally`) against a
recount from scratch after every event, over every order of reports, fence listings, commits
learned and placement changes (hypothesis, stateful); and the rules about which reports count.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from elasticd.replication.placement import compute_placement
from elasticd.replication.report import Report, placement_digest
from elasticd.replication.tally import AheadWrite, CommitWrite, ReadFences, Tally

NODES = ["a", "b", "c"]
PLACEMENTS = [
    compute_placement(NODES, {"a": [0, 1], "b": [2], "c": [3]}, 2, round=1),
    compute_placement(NODES, {"a": [0], "b": [1, 2], "c": [3, 4]}, 2, round=2),
]
versions = st.tuples(st.integers(0, 1), st.integers(0, 5))


def recount(t: Tally) -> dict:
    """What the tally's counts must be, from its usable reports alone."""
    usable = [r for n, r in t.reports.items() if t._usable(r)]
    mentioned = {v for r in usable for v in r.mentioned()
                 if t.committed is None or v > t.committed}
    have, blocked = {}, {}
    for v in mentioned:
        have[v] = sum(v in r.ranks.get(rank, ()) for r in usable for rank in t.owned[r.node])
        lack = 0
        for r in usable:
            for rank in t.owned[r.node]:
                vs = r.ranks.get(rank, ())
                newest = max((*vs, *r.dead), default=None)
                lack += v not in vs and newest is not None and newest > v
        blocked[v] = lack + sum(v in r.dead for r in usable)
    floor = max([t.floor] + [r.floor for r in usable])
    full = [v for v in mentioned if have[v] == t.total and v[0] >= floor]
    return {"have": have, "blocked": blocked, "candidate": max(full, default=None),
            "newest": max((v for v in mentioned if have[v] > 0), default=None),
            "usable": sorted(r.node for r in usable)}


class TallyCounts(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.placement = PLACEMENTS[0]
        self.tally = Tally(7, 10, self.placement)
        self.fences: dict[str, int] = {}
        self.epoch = 0
        self.seq = 0

    @rule(node=st.sampled_from(NODES), data=st.data(), fresh=st.booleans(),
          floor=st.integers(0, 1), other_term=st.booleans(), other_placement=st.booleans())
    def report(self, node, data, fresh, floor, other_term, other_placement):
        placement = PLACEMENTS[other_placement] if other_placement else self.placement
        ranks = {r: tuple(sorted(set(data.draw(st.lists(versions, max_size=4))), reverse=True))
                 for r in placement.ranks.get(node, ())}
        dead = tuple(sorted(set(data.draw(st.lists(versions, max_size=3))), reverse=True))
        fence = self.fences.get(node, 0) if fresh else data.draw(st.integers(0, 30))
        self.seq += 1
        seq = self.seq if data.draw(st.booleans()) else data.draw(st.integers(0, self.seq))
        reply = self.tally.report(Report(
            "j", node, 8 if other_term else 7, placement_digest(placement), 1, seq, fence,
            floor, ranks, dead, tuple(data.draw(st.lists(versions, max_size=3)))))
        if reply.accepted:
            assert reply.hopeless == tuple(v for v in reply.hopeless if self.tally.hopeless(v))

    @rule(node=st.sampled_from(NODES))
    def withdraw(self, node):
        self.epoch += 1
        self.fences[node] = self.epoch

    @rule()
    def list_fences(self):
        self.tally.take_fences(self.epoch, self.fences)

    @rule(v=versions, rev=st.integers(0, 50))
    def learn_committed(self, v, rev):
        old = self.tally.committed
        self.tally.learn_committed(v, rev)
        assert self.tally.committed == max(v, old) if old is not None else v

    @rule(i=st.integers(0, 1))
    def new_placement(self, i):
        self.placement = PLACEMENTS[i]
        self.tally.set_placement(self.placement)

    @rule()
    def write(self):
        w = self.tally.next_write()
        if isinstance(w, CommitWrite):
            assert w.version == self.tally.candidate()
            self.tally.wrote(w, 99)
            assert self.tally.committed == w.version and self.tally.candidate() is None
        elif isinstance(w, AheadWrite):
            self.tally.wrote(w, 99)
            assert self.tally.next_write() is None
        elif isinstance(w, ReadFences):
            assert self.tally.epoch_rev is None or self.tally.want_fences

    @invariant()
    def counts_match_a_recount(self):
        t, want = self.tally, recount(self.tally)
        assert sorted(t.entries) == want["usable"]
        for v in want["have"]:
            assert (t.have[v], t.blocked[v]) == (want["have"][v], want["blocked"][v]), v
            assert t.hopeless(v) == (want["blocked"][v] > 0)
        assert {v for v, n in t.have.items() if n} <= set(want["have"])
        assert {v for v, n in t.blocked.items() if n} <= set(want["blocked"])
        assert t.candidate() == want["candidate"]
        assert t.newest() == want["newest"]


TallyCounts.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow])
test_tally_counts = TallyCounts.TestCase


def test_which_reports_count():
    p = PLACEMENTS[0]
    t = Tally(7, 10, p)

    def report(node, seq, fence=0, term=7, placement=p, boot=1, **ranks):
        return t.report(Report("j", node, term, placement_digest(placement), boot, seq, fence,
                               0, {int(k[1:]): v for k, v in ranks.items()}))

    assert report("a", 1, r0=((0, 1),), r1=((0, 1),)).reason == "fences"  # not listed yet
    assert isinstance(t.next_write(), ReadFences)
    t.take_fences(5, {"b": 5})
    assert report("x", 2).reason == "not an owner in the coordinator's placement"
    assert report("a", 3, term=6).reason == "term"
    assert report("a", 1).reason == "stale"  # seq 1 after 1 from the same boot
    assert report("a", 1, boot=2, r0=((0, 1),), r1=((0, 1),)).accepted  # a restarted node
    assert report("b", 4, fence=0, r2=((0, 1),)).reason == "fenced"  # made before its fence
    assert report("c", 5, placement=PLACEMENTS[1], r3=((0, 1),)).reason == "placement"
    assert t.candidate() is None and t.waiting_for() == ["b", "c"]
    assert report("b", 6, fence=5, r2=((0, 1),)).accepted
    assert report("c", 7, fence=9, r3=((0, 1),)).reason == "fences"  # newer than the listing
    assert isinstance(t.next_write(), ReadFences)
    t.take_fences(9, {"b": 5, "c": 9})
    write = t.next_write()
    assert isinstance(write, CommitWrite) and write.version == (0, 1) and write.placement
    assert (write.guards.term, write.guards.epoch, write.guards.committed) == (10, 9, 0)
