"""The rendezvous' round decisions (:mod:`elasticd.rendezvous.rounds`), alone: records, when a
round closes, rank order, spares, what counts as waiting (from the closer's summary, made by
:class:`~elasticd.rendezvous.tally.Tally`), the summary's rewrite rule and the election order."""

from __future__ import annotations

import pickle

import pytest

from elasticd.rendezvous.records import (
    SCHEMA,
    NodeRecord,
    RecordError,
    RoundRecord,
    Waiting,
    agent_pid,
    node_id,
)
from elasticd.rendezvous.rounds import (
    ELECTION_STEP,
    check_grow,
    decide_close,
    election_delay,
    grew_at,
    grow_interval,
    joined,
    num_waiting,
    order,
    summary_news,
)
from elasticd.rendezvous.tally import Tally


def nodes(*specs: tuple[str, int, int]) -> dict[str, NodeRecord]:
    """{id: record} from (id, target, creation revision)."""
    return {n: NodeRecord(n, t, revision=r) for n, t, r in specs}


def wait(live, last, max_nodes, gone=(), **kw) -> int:
    """num_waiting as a member sees it: from the summary a closer with ``live`` would write."""
    tally = Tally(last)
    tally.load(live.values(), 0.0)
    return num_waiting(last, tally.waiting(tuple(gone)), max_nodes, gone, **kw)


def test_records_are_versioned_json_and_refuse_anything_else():
    rec = NodeRecord("a", 3, "10.0.0.1")
    assert NodeRecord.decode(rec.encode(), revision=7) == NodeRecord("a", 3, "10.0.0.1", revision=7)
    rnd = RoundRecord(2, ("b", "a"), "b")
    assert RoundRecord.decode(rnd.encode()) == rnd
    assert b'"v":%d' % SCHEMA in rnd.encode()
    for bad in (pickle.dumps({"v": 1}), b"[]", b'{"v": 99, "round": 1, "members": []}',
                b'{"v": 1, "round": "x"}'):
        with pytest.raises(RecordError):
            RoundRecord.decode(bad)
    # Protocol 1's records (elasticd 0.1.0) are refused in one line that names the upgrade.
    with pytest.raises(RecordError, match="protocol 1, this elasticd speaks 2: run the same"):
        NodeRecord.decode(b'{"v": 1, "node": "a", "target": 0}')


def test_first_round_closes_at_max_at_once_and_at_min_only_after_the_last_call():
    two = nodes(("a", 0, 5), ("b", 0, 4))
    assert decide_close(two, None, 2, 2, last_call_over=False).members == ("b", "a")
    waiting = decide_close(two, None, 2, 3, last_call_over=False)
    assert waiting.members is None and waiting.last_call
    assert decide_close(two, None, 2, 3, last_call_over=True).members == ("b", "a")
    assert decide_close(nodes(("a", 0, 5)), None, 2, 3, True).members is None


def test_after_a_failure_the_round_closes_once_every_live_member_joined_without_last_call():
    last = RoundRecord(0, ("a", "b", "c"))
    # c died (its record is gone); a has joined round 1, b still trains.
    live = nodes(("a", 1, 1), ("b", 0, 2))
    d = decide_close(live, last, 1, 3, last_call_over=False)
    assert d.members is None and "still training" in d.wait_for
    live["b"] = NodeRecord("b", 1, revision=2)
    assert decide_close(live, last, 1, 3, last_call_over=False).members == ("a", "b")


def test_survivors_keep_their_ranks_and_the_holes_fill_by_order_then_arrival():
    last = RoundRecord(4, ("c", "a", "d", "b"))
    live = nodes(("a", 5, 9), ("b", 5, 1), ("c", 5, 3), ("z", 0, 20), ("y", 0, 15))
    # d (rank 2) died: the first newcomer takes its rank, every survivor keeps its own.
    assert order(joined(live, last), live, last, 4) == ["c", "a", "y", "b", "z"]
    assert decide_close(live, last, 1, 4, False).members == ("c", "a", "y", "b")
    # Without newcomers the round shrinks: the survivor whose rank is gone takes the hole.
    del live["y"], live["z"]
    assert decide_close(live, last, 1, 4, False).members == ("c", "a", "b")
    # The highest rank lost: everyone keeps rank and order.
    assert order(["c", "a", "d"], live | nodes(("d", 5, 2)), last) == ["c", "a", "d"]


def test_a_spare_replaces_a_failed_member_and_never_closes_a_round_alone():
    last = RoundRecord(0, ("a", "b", "c"))
    spare = ("s", 1, 10)
    # Full round training, spare waiting: no round, even with min=1 and the last call over.
    live = nodes(("a", 0, 1), ("b", 0, 2), ("c", 0, 3), spare)
    assert decide_close(live, last, 1, 3, last_call_over=True).members is None
    assert wait(live, last, 3) == 0
    # c dies; a and b come back: the spare takes the third place.
    live = nodes(("a", 1, 1), ("b", 1, 2), spare)
    assert decide_close(live, last, 3, 3, False).members == ("a", "b", "s")


def test_waiting_counts_rejoining_members_and_newcomers_only_when_there_is_room():
    last = RoundRecord(2, ("a", "b"))
    assert wait(nodes(("a", 2, 1), ("b", 2, 2)), last, 3) == 0
    assert wait(nodes(("a", 2, 1), ("b", 3, 2)), last, 3) == 1  # b re-rendezvous
    assert wait(nodes(("a", 2, 1), ("b", 2, 2), ("n", 0, 3)), last, 3) == 1
    assert wait(nodes(("a", 2, 1), ("b", 2, 2), ("n", 0, 3)), last, 2) == 0  # spare
    # b's record is gone: provisionally alive (no room) until confirmed gone.
    assert wait(nodes(("a", 2, 1), ("n", 0, 3)), last, 2) == 0
    assert wait(nodes(("a", 2, 1), ("n", 0, 3)), last, 2, gone=["b"]) == 1
    assert wait(nodes(("n", 0, 3)), None, 2) == 1


def test_grow_at_failure_lets_a_newcomer_in_only_in_a_dead_members_place():
    last = RoundRecord(2, ("a", "b"))
    live = nodes(("a", 2, 1), ("b", 2, 2), ("n", 0, 3))
    assert wait(live, last, 3, grow="immediate") == 1  # room: grow now
    assert wait(live, last, 3, grow="at-failure") == 0  # wait for a failure
    del live["b"]
    assert wait(live, last, 3, gone=["b"], grow="at-failure") == 1
    # The round after the failure takes it in, up to max.
    live["a"] = NodeRecord("a", 3, revision=1)
    assert decide_close(live, last, 1, 3, last_call_over=False).members == ("a", "n")


@pytest.mark.parametrize("policy, seconds", [
    ("immediate", None), ("at-failure", None), ("interval:30", 1800.0), ("interval:0.5", 30.0),
    ("interval:0", 0.0), (" interval: 2 ", 120.0)])
def test_grow_policies_parse(policy, seconds):
    assert grow_interval(policy) == seconds
    assert check_grow(policy).startswith(policy.strip()[:9])


@pytest.mark.parametrize("policy", ["interval:nan", "interval:-1", "interval:inf", "interval:",
                                    "interval:ten", "interval", "sometimes", "", "Immediate"])
def test_bad_grow_policies_are_refused_in_one_quoted_line(policy):
    with pytest.raises(ValueError) as exc:
        check_grow(policy)
    assert repr(policy) in str(exc.value) and "\n" not in str(exc.value)


def test_a_round_that_grows_the_job_restarts_the_interval_and_the_others_carry_it():
    assert grew_at(("a", "b"), None, 100.0) == 100.0  # the job's first round
    first = RoundRecord(0, ("a", "b"), grew_at=100.0)
    assert grew_at(("a", "b", "c"), first, 200.0) == 200.0  # grew
    assert grew_at(("a",), first, 200.0) == 100.0  # shrank after a failure
    assert grew_at(("a", "c"), first, 200.0) == 100.0  # a spare replaced a dead member
    assert RoundRecord.decode(first.encode()) == first
    # A record from before the field counts as grown long ago.
    old = b'{"v":2,"round":3,"members":["a"],"closed_by":"a"}'
    assert RoundRecord.decode(old).grew_at == 0.0
    with pytest.raises(RecordError):
        RoundRecord.decode(b'{"v":2,"round":3,"members":["a"],"grew_at":NaN}')


def test_grow_interval_admits_a_newcomer_once_min_minutes_passed_and_at_a_committed_step():
    last = RoundRecord(2, ("a", "b"), grew_at=1_000.0)
    live = nodes(("a", 2, 1), ("b", 2, 2), ("n", 0, 3))
    policy = "interval:10"  # 600 s
    # Within the interval: as at-failure, the newcomer waits silently.
    assert wait(live, last, 3, grow=policy, now=1_000.0 + 599.0) == 0
    # Past it, but not at a committed step: still waiting.
    assert wait(live, last, 3, grow=policy, now=1_000.0 + 600.0, at_commit=False) == 0
    # Past it and at a committed step: it is let in (everybody stops once).
    assert wait(live, last, 3, grow=policy, now=1_000.0 + 600.0, at_commit=True) == 1
    # Room is still bounded by max.
    assert wait(live, last, 2, grow=policy, now=10_000.0) == 0
    # Within the interval a dead member's place is taken at once, as with at-failure.
    del live["b"]
    assert wait(live, last, 3, gone=["b"], grow=policy, now=1_001.0,
                       at_commit=False) == 1


def test_agent_pid_reads_back_what_node_id_wrote():
    # An IPv6 address and a host name with underscores stay one key element and parse back.
    for addr in ("10.0.0.1", "fe80::1%eth0", "host_with_underscores"):
        assert agent_pid(node_id(addr, 4242, 3)) == 4242
    assert agent_pid("not-a-node-id") is None
    assert agent_pid(node_id("h", 1, 1).replace("_1_", "_x_")) is None


def test_a_stale_summary_counts_as_nobody_waiting():
    last = RoundRecord(2, ("a", "b"))
    assert num_waiting(last, Waiting(1, rejoining=2, outsiders=1), 3) == 0
    assert num_waiting(last, Waiting(2, rejoining=1, outsiders=1), 3) == 2
    assert num_waiting(last, None, 3) == 0
    # No round although this agent trains: the record is gone (a wipe): everybody rejoins.
    assert num_waiting(None, None, 3) == 1
    assert Waiting.decode(Waiting(2, 1, 0, ("b",)).encode()) == Waiting(2, 1, 0, ("b",))


def test_the_summary_is_rewritten_at_once_only_when_its_meaning_changes():
    assert not summary_news(None, Waiting(3))  # nobody waiting: what no summary says
    assert summary_news(None, Waiting(3, rejoining=1))
    assert not summary_news(Waiting(3, rejoining=1), Waiting(3, rejoining=40))  # counts only
    assert summary_news(Waiting(3, rejoining=40), Waiting(3, rejoining=0))
    assert summary_news(Waiting(3, outsiders=1), Waiting(3, outsiders=1, dead=("x",)))
    assert not summary_news(Waiting(2, rejoining=5), Waiting(3))  # a new round: nobody yet
    assert summary_news(Waiting(2), Waiting(3, outsiders=2))


def test_the_closers_successors_take_turns_in_rank_order():
    last = RoundRecord(4, tuple(f"n{i}" for i in range(40)))
    delays = [election_delay(f"n{i}", last, 0.99) for i in range(40)]
    assert delays[:3] == [0.0, ELECTION_STEP, 2 * ELECTION_STEP]
    assert delays[:16] == sorted(delays[:16]) and len(set(delays[:16])) == 16
    assert min(delays[16:]) > delays[15]  # later ranks and spares after the turns
    assert election_delay("spare", last, 0.0) > delays[15]
    assert election_delay("any", None, 0.5) < 4 * ELECTION_STEP  # a first round: drawn


def test_the_closer_that_went_has_no_turn_the_next_rank_takes_over_at_once():
    # Issue 31: the daemons delete a failed node's closer key; its successor of rank 1 waited
    # a step (50 ms) for the turn of the dead rank 0, in every such re-formation.
    last = RoundRecord(4, ("n0", "n1", "n2", "n3"))
    assert [election_delay(f"n{i}", last, 0.5, went="n0") for i in (1, 2, 3)] == [
        0.0, ELECTION_STEP, 2 * ELECTION_STEP]
    assert [election_delay(f"n{i}", last, 0.5, went="n2") for i in (0, 1, 3)] == [
        0.0, ELECTION_STEP, 2 * ELECTION_STEP]
    # a closer that went and is back (an etcd pause) has its own turn; a stranger moves nobody
    assert election_delay("n0", last, 0.5, went="n0") == 0.0
    assert election_delay("n2", last, 0.5, went="spare") == 2 * ELECTION_STEP
