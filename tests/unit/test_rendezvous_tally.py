"""The closer's incremental counts (:mod:`elasticd.rendezvous.tally`) against the same counts
recomputed from scratch after every event, over any order of joins, rejoins, expiries and
round changes (hypothesis): the closer may ask the round decision only when the counts say so,
so a count that drifts would stall a round or split a job."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.rendezvous.records import NodeRecord, RoundRecord
from elasticd.rendezvous.rounds import decide_close, joined, next_round
from elasticd.rendezvous.tally import Tally

IDS = [f"n{i}" for i in range(6)]

ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(IDS), st.integers(0, 4)),
    st.tuples(st.just("delete"), st.sampled_from(IDS), st.just(0)),
    st.tuples(st.just("round"), st.lists(st.sampled_from(IDS), unique=True, max_size=5),
              st.integers(0, 3)),
    # a failure mark of a node's daemon lease (1 or 2): its writer deletes what it dooms
    st.tuples(st.just("mark"), st.sampled_from(IDS), st.integers(1, 2)),
), max_size=40)


def recount(nodes: dict[str, NodeRecord], last: RoundRecord | None) -> tuple[int, int, int]:
    members = set(last.members) if last else set()
    live_members = [m for m in members if m in nodes]
    training = [m for m in live_members if nodes[m].target < next_round(last)]
    return len(live_members), len(training), len(joined(nodes, last))


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 4), st.integers(1, 6))
def test_counts_match_a_recount_after_every_event(ops, min_nodes, extra):
    max_nodes = min_nodes + extra - 1
    tally, nodes, last = Tally(), {}, None
    absent: dict[str, float] = {}
    revision = 0
    for now, (kind, arg, n) in enumerate(ops):
        if kind == "put":
            revision += 1
            rec = NodeRecord(arg, n, revision=nodes[arg].revision if arg in nodes else revision,
                             daemon="d" + arg, daemon_lease=1 + n % 2, written=revision)
            nodes[arg] = rec
            tally.put(rec, float(now))
            absent.pop(arg, None)
        elif kind == "mark":  # counted as its writer's delete of the record, if it names it
            revision += 1
            tally.mark("d" + arg, n, revision, [], float(now))
            if arg in nodes and nodes[arg].daemon_lease == n:
                nodes.pop(arg)
                if last is not None and arg in last.members:
                    absent.setdefault(arg, float(now))
        elif kind == "delete":
            nodes.pop(arg, None)
            tally.delete(arg, float(now))
            if last is not None and arg in last.members:
                absent.setdefault(arg, float(now))
        else:
            last = RoundRecord(n, tuple(arg))
            tally.new_round(last, float(now))
            absent = {m: absent.get(m, float(now)) for m in last.members if m not in nodes}
        live_members, training, candidates = recount(nodes, last)
        assert (tally.live_members, tally.training, tally.candidates) == (
            live_members, training, candidates)
        assert tally.outsiders == len(nodes) - live_members
        assert tally.absent_since == absent
        for over in (False, True):
            decision = decide_close(nodes, last, min_nodes, max_nodes, over)
            if decision.members is not None or decision.last_call:
                assert tally.may_close(min_nodes)  # never stalls a closable round
        if not tally.may_close(min_nodes):
            assert decide_close(nodes, last, min_nodes, max_nodes, True).members is None


def test_a_member_is_dead_only_after_confirm_and_only_when_trusted():
    last = RoundRecord(0, ("a", "b"))
    tally = Tally(last, now=0.0)
    tally.load([NodeRecord("a", 0, revision=1), NodeRecord("b", 0, revision=2)], 0.0)
    tally.delete("b", 10.0)
    assert tally.dead(10.5, 1.0, trusted=True) == ()
    assert tally.next_confirm(10.5, 1.0) == 11.0
    assert tally.dead(11.0, 1.0, trusted=True) == ("b",)
    assert tally.dead(11.0, 1.0, trusted=False) == ()
    tally.put(NodeRecord("b", 0, revision=3), 11.5)  # re-registered: alive again
    assert tally.dead(20.0, 1.0, trusted=True) == () and tally.next_confirm(20.0, 1.0) is None
    assert tally.waiting(()).round == 0


def test_a_member_recorded_failed_by_the_daemons_is_dead_at_once_a_silent_one_waits():
    # Issue 31, docs/in-process-design.md 4.2: a member whose last record named a daemon and
    # its lease is dead as soon as the daemons' failure mark of that lease is known; one
    # without a daemon (plain torchrun), or not marked, still waits for the confirmation.
    last = RoundRecord(0, ("a", "b", "c"))
    tally = Tally(last, now=0.0)
    tally.load([NodeRecord("a", 0, revision=1, daemon="n1", daemon_lease=0x11, written=1),
                NodeRecord("b", 0, revision=2, daemon="n2", daemon_lease=0x22, written=2),
                NodeRecord("c", 0, revision=3, written=3)], 0.0)
    tally.delete("b", 10.0)  # the record expired first: the mark comes after it
    tally.delete("c", 10.0)
    assert tally.dead(10.1, 1.0, trusted=True) == ()
    tally.mark("n2", 0x21, 9, [], 10.1)  # another lease of b's node: an older life
    assert tally.dead(10.1, 1.0, trusted=True) == ()
    tally.mark("n2", 0x22, 10, [], 10.1)
    assert tally.dead(10.1, 1.0, trusted=True) == ("b",)  # no confirmation
    assert tally.dead(10.1, 1.0, trusted=False) == ()  # never while in doubt
    assert tally.next_confirm(10.1, 1.0) == 11.0  # c's, b's is not waited for
    assert tally.dead(11.0, 1.0, trusted=True) == ("b", "c")
    # a member that comes back (a record written after the mark) is alive again, mark or not
    tally.put(NodeRecord("b", 1, revision=11, daemon="n2", daemon_lease=0x22, written=11), 12.0)
    assert tally.dead(12.0, 1.0, trusted=True) == ("c",)
    # the next round forgets what it knew of the old one's members
    tally.new_round(RoundRecord(1, ("a", "b")), 13.0)
    assert tally.failed == set() and tally.gone_records == {}


def test_a_mark_drops_the_records_written_before_it_at_once_as_its_writers_deletes_will():
    # The mark comes first, its writer's deletes of the records a listing and a write later:
    # the records it dooms count as deleted from the mark on, so the round closes then.
    last = RoundRecord(0, ("a", "b", "c"))
    tally = Tally(last, now=0.0)
    tally.load([NodeRecord("a", 1, revision=1, daemon="n1", daemon_lease=0x11, written=7),
                NodeRecord("b", 0, revision=2, daemon="n2", daemon_lease=0x22, written=5),
                NodeRecord("c", 1, revision=3, daemon="n3", daemon_lease=0x33, written=8)], 0.0)
    assert not tally.may_close(2)  # b still trains
    tally.mark("n2", 0x22, 9, [], 1.0)
    assert "b" not in tally.nodes and tally.may_close(2)
    assert tally.dead(1.0, 60.0, trusted=True) == ("b",)
    assert decide_close(tally.nodes, last, 2, 3, False).members == ("a", "c")
    # its writer's delete, when it comes, changes nothing; an old write of the record seen
    # late (the two watches are two streams) is doomed too, a new one is not
    tally.delete("b", 1.1)
    tally.put(NodeRecord("b", 0, revision=2, daemon="n2", daemon_lease=0x22, written=6), 1.2)
    assert "b" not in tally.nodes and tally.dead(1.2, 60.0, trusted=True) == ("b",)
    tally.put(NodeRecord("b", 1, revision=12, daemon="n2", daemon_lease=0x22, written=12), 1.3)
    assert "b" in tally.nodes and tally.dead(1.3, 60.0, trusted=True) == ()
    # a listing (a re-list, a closer newly elected) drops what the marks doom, as events do
    fresh = Tally(last, now=0.0)
    fresh.load_marks([("n2", 0x22, 9, ["b"])])
    fresh.load([NodeRecord("a", 1, written=7), NodeRecord("b", 0, daemon="n2",
                                                           daemon_lease=0x22, written=5)], 0.0)
    assert sorted(fresh.nodes) == ["a"] and fresh.dead(0.0, 60.0, trusted=True) == ("b",)
    # a mark gone (its writer's lease) is forgotten; what it did stays done
    tally.unmark("n2", 0x22)
    assert tally.marks == {}


def test_a_closer_that_never_saw_a_members_record_finds_it_by_the_marks_member_lists():
    from elasticd.rendezvous.failures import marked_members

    tally = Tally(RoundRecord(0, ("a", "b")), now=0.0)
    tally.load([NodeRecord("a", 0, revision=1)], 0.0)  # b went before this closer listed
    assert tally.dead(0.1, 1.0, trusted=True) == ()
    marks = [b'{"v":2,"members":["b"]}', b'{"members":"b"}', b"not json", b'{"members":[1]}']
    named = set().union(*map(marked_members, marks))
    assert named == {"b"}  # the unreadable ones name nobody
    tally.mark("n2", 0x22, 5, named, 0.1)
    assert tally.dead(0.1, 1.0, trusted=True) == ("b",)
