"""The node's safety rules alone (elasticd/daemon/node_rules.py): no daemon, no etcd, no clock.

Each rule has a test of its own; the fence rules are also run over every order of their events
(hypothesis, stateful), against what must hold whatever the order.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from elasticd.daemon import node_rules
from elasticd.daemon.node_rules import FenceBook, FenceOrder, Recover, RecordWrite

PROVISIONAL = 3.0
WINDOW = PROVISIONAL + node_rules.SUSPECT_SLACK


# -- fencing: declared dead -------------------------------------------------------------------

def test_a_lost_lease_declared_failed_by_peers_fences():
    book = FenceBook()
    book.lease_lost(0xA, now=10.0, provisional_seconds=PROVISIONAL)
    assert book.judge([], now=11.0) is None and not book.fenced
    order = book.judge([0xA], now=12.0)
    assert order == FenceOrder("declared dead by peers (lease a expired)", 0xA)
    assert book.fenced and book.suspects == {}


def test_a_lost_lease_nobody_declared_is_dropped_after_its_window():
    book = FenceBook()
    book.lease_lost(0xA, now=10.0, provisional_seconds=PROVISIONAL)
    assert book.judge([], now=10.0 + WINDOW) is None and 0xA in book.suspects  # not yet past
    assert book.judge([], now=10.0 + WINDOW + 0.1) is None and book.suspects == {}
    assert book.judge([0xA], now=20.0) is None and not book.fenced  # too late: not ours


def test_a_failed_event_against_a_lease_never_lost_is_not_ours():
    book = FenceBook()
    assert book.judge([0xB], now=1.0) is None and not book.fenced


# -- fencing: outage grace --------------------------------------------------------------------

def test_an_outage_fences_only_past_its_grace():
    book = FenceBook()
    assert book.outage(30.0, grace=30.0) is None
    assert book.outage(30.1, grace=30.0) == FenceOrder("etcd unreachable for more than 30 s")
    assert FenceBook().outage(31, grace=30.0, kind="refuses our requests") == FenceOrder(
        "etcd refuses our requests for more than 30 s")


def test_a_grace_of_zero_keeps_workers_through_any_outage():
    assert FenceBook().outage(1e9, grace=0.0) is None


def test_the_outage_sentence_counts_down_then_says_fenced():
    assert node_rules.describe_outage(12.0, 30.0, fenced=False) == (
        "etcd unreachable for 12.0 s; keeping workers running for 18.0 s more; retrying")
    assert node_rules.describe_outage(40.0, 30.0, fenced=False).endswith("0.0 s more; retrying")
    assert node_rules.describe_outage(40.0, 30.0, fenced=True) == (
        "etcd unreachable for 40.0 s; fenced (workers stopped) after the 30 s grace; retrying")


# -- one fence at a time; registering lifts it ---------------------------------------------------

def test_a_fenced_node_does_not_fence_again_until_it_registered():
    book = FenceBook()
    assert book.fence("first") == FenceOrder("first")
    assert book.fence("second") is None and book.outage(99, grace=1) is None
    assert book.fenced_for == "first"
    assert book.registered() is True and not book.fenced
    assert book.fenced_for == "first"  # the last fence's reason stays for /status
    assert book.registered() is False
    assert book.fence("third") == FenceOrder("third")


# -- data loss --------------------------------------------------------------------------------

def test_a_data_loss_forgets_the_suspects():
    book = FenceBook()
    book.lease_lost(0xA, now=0.0, provisional_seconds=PROVISIONAL)
    book.data_lost()
    assert book.judge([0xA], now=1.0) is None and not book.fenced


def test_the_data_loss_plan_republishes_specs_before_relisting_and_records_once():
    plan = node_rules.data_loss_plan(first=True, registered=True, replicates=True)
    assert plan == (Recover.REPUBLISH_SPECS, Recover.RESET_WATCHES, Recover.FORGET_SUSPECTS,
                    Recover.RELIST_NODES, Recover.REWRITE_RECORD, Recover.REPUBLISH_REPLICAS,
                    Recover.RECORD_EVENT)
    # Another node saw it first; no lease to write a record with; no replicas.
    assert node_rules.data_loss_plan(first=False, registered=False, replicates=False) == (
        Recover.REPUBLISH_SPECS, Recover.RESET_WATCHES, Recover.FORGET_SUSPECTS,
        Recover.RELIST_NODES)


def test_the_incarnation_is_read_once_a_cycle_unless_asked_again():
    assert node_rules.look_for_data_loss(looked_at_cycle=-1, cycle=0, again=False)
    assert not node_rules.look_for_data_loss(looked_at_cycle=4, cycle=4, again=False)
    assert node_rules.look_for_data_loss(looked_at_cycle=4, cycle=4, again=True)


# -- the record and the sentence ----------------------------------------------------------------

def test_the_record_is_registered_rewritten_or_left_alone():
    rw = node_rules.record_write
    assert rw(False, False, False, 0.0, 0.0) is RecordWrite.REGISTER
    assert rw(False, True, False, 0.0, 0.0) is RecordWrite.NONE  # leaving: never again
    assert rw(True, False, True, 0.0, 0.0) is RecordWrite.REWRITE  # gone while the lease lives
    assert rw(True, False, False, 0.0, 1e6) is RecordWrite.NONE  # liveness is the lease
    assert rw(True, False, False, 5.0, 4.9) is RecordWrite.NONE
    assert rw(True, False, False, 5.0, 5.0) is RecordWrite.REWRITE  # a heartbeat asked for


def test_a_new_sentence_is_published_at_most_once_a_second():
    pub = node_rules.publish_sentence
    assert pub("b", "a", True, True, 1.0)
    assert not pub("b", "a", True, True, 0.9)
    assert not pub("a", "a", True, True, 9.0)
    assert not pub("b", "a", False, True, 9.0) and not pub("b", "a", True, False, 9.0)


def test_the_cycle_sentence():
    s = node_rules.cycle_sentence
    assert s("n1", 3, [], None, []) == "no action: I am n1, 3 nodes alive"
    assert s("n1", 3, [], "j", ["n2"]) == "running job j: I am n1, 3 nodes alive"
    assert s("n1", 2, [], None, ["n3", "n2"]) == (
        "waiting for n2, n3 to re-register after an etcd outage before recording a failure; "
        "I am n1, 2 nodes alive")
    assert s("n1", 3, ["a", "b"], "j", []) == "a; b (3 nodes alive)"


# -- the fence rules over every order of events -------------------------------------------------

class FenceOrders(RuleBasedStateMachine):
    """Leases lost, failures declared by peers, time, outages, registrations and data losses in
    any order: a fence is ordered at most once per registration, only for a reason the rules
    name, and never missed when a lost lease was declared failed within its window."""

    def __init__(self) -> None:
        super().__init__()
        self.book = FenceBook()
        self.now = 0.0
        self.lost: dict[int, float] = {}  # lease -> when lost (since the last data loss)
        self.declared: set[int] = set()
        self.orders_since_registered = 0
        self.next_lease = 1

    @rule()
    def lose_lease(self):
        lease, self.next_lease = self.next_lease, self.next_lease + 1
        self.book.lease_lost(lease, self.now, PROVISIONAL)
        self.lost[lease] = self.now

    @rule(data=st.data())
    def peers_declare(self, data):
        leases = sorted(self.lost) or [999]
        self.declared.add(data.draw(st.sampled_from(leases)))

    @rule(dt=st.sampled_from([0.1, 1.0, WINDOW / 2, WINDOW + 0.5]))
    def time_passes(self, dt):
        self.now += dt

    @rule()
    def check(self):
        # What must fence: a declared lease still within its window (looked at in time).
        due = [lease for lease in self.book.suspects
               if lease in self.declared and self.now <= self.lost[lease] + WINDOW]
        was = self.book.fenced
        order = self.book.judge(self.declared & set(self.book.suspects), self.now)
        if due and not was:
            assert order is not None and order.lease in self.declared
        if order is not None:
            assert not was and order.lease in self.declared and order.lease in self.lost
            self.orders_since_registered += 1
        assert all(until >= self.now for until in self.book.suspects.values())

    @rule(seconds=st.sampled_from([0.0, 5.0, 30.0, 31.0]), grace=st.sampled_from([0.0, 30.0]))
    def outage(self, seconds, grace):
        was = self.book.fenced
        order = self.book.outage(seconds, grace)
        if grace and seconds > grace:
            assert self.book.fenced and (order is not None) == (not was)
        else:
            assert order is None and self.book.fenced == was
        if order is not None:
            self.orders_since_registered += 1

    @rule()
    def register(self):
        self.book.registered()
        assert not self.book.fenced
        self.orders_since_registered = 0

    @rule()
    def data_lost(self):
        self.book.data_lost()
        self.lost.clear()
        self.declared.clear()

    @invariant()
    def one_fence_per_registration(self):
        assert self.orders_since_registered <= 1
        assert self.book.fenced == (self.orders_since_registered == 1)

    @invariant()
    def suspects_are_lost_leases(self):
        assert set(self.book.suspects) <= set(self.lost)


FenceOrders.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_fence_rules_over_every_order_of_events = FenceOrders.TestCase

