"""Membership decisions, alone: failure, departure, provisional expiry and its two outcomes."""

from __future__ import annotations

from elasticd.cluster.membership import Membership, NodeRecord, ObservationKind


def rec(node, lease=1, state="up", hb=100.0):
    return NodeRecord(node=node, state=state, address="a", hostname="h", pid=1, incarnation="i",
                      started_at=0.0, heartbeat_at=hb, version="0", lease=lease)


def kinds(obs):
    return [(o.kind, o.node) for o in obs]


def test_join_then_failure_with_detection_time():
    m = Membership("me", provisional_seconds=5)
    assert kinds(m.on_put(rec("a"))) == [(ObservationKind.JOINED, "a")]
    assert m.on_put(rec("a")) == []  # heartbeat rewrite, same lease
    obs = m.on_delete("a", now=10, wall=103.5, cut_off=False)
    assert kinds(obs) == [(ObservationKind.FAILED, "a")]
    assert obs[0].detection_seconds == 3.5
    assert m.alive() == []


def test_leaving_record_is_a_departure():
    m = Membership("me", 5)
    m.on_put(rec("a"))
    m.on_put(rec("a", state="leaving"))  # its last write before it deletes its record
    obs = m.on_delete("a", 0, 0, cut_off=False)
    assert kinds(obs) == [(ObservationKind.DEPARTED, "a")]


def test_provisional_resolved_by_reregistration():
    m = Membership("me", 5)
    m.on_put(rec("a", lease=1))
    assert kinds(m.on_delete("a", 0, 0, cut_off=True)) == [(ObservationKind.PROVISIONAL, "a")]
    assert m.tick(4.9) == []
    assert kinds(m.on_put(rec("a", lease=2))) == [(ObservationKind.REJOINED, "a")]
    assert m.tick(100) == []


def test_provisional_confirmed_after_grace():
    m = Membership("me", 5)
    m.on_put(rec("a"))
    m.on_delete("a", now=0, wall=101, cut_off=True)
    obs = m.tick(5.0)
    assert kinds(obs) == [(ObservationKind.FAILED, "a")]
    assert obs[0].was_provisional


def test_reset_reconciles_missed_events_and_ignores_self():
    m = Membership("me", 5)
    m.on_put(rec("me"))
    m.on_put(rec("a"))
    obs = m.reset([rec("me"), rec("b")], now=0, wall=0, cut_off=False)
    assert sorted(kinds(obs)) == [(ObservationKind.FAILED, "a"), (ObservationKind.JOINED, "b")]
    assert m.on_delete("me", 0, 0, False) == []
