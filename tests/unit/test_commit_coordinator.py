"""The commit protocol with its coordinator, over every order of its events (hypothesis,
stateful): elections, coordinator deaths and depositions, reports delayed, reordered, repeated
or lost, and withdrawals racing reports and commits.

Two nodes, one rank each, two copies of every shard, as in ``test_commit_state.py`` (whose
model slot stores and nodes this reuses, with the real :class:`CommitBook` of each node). Around
them: a model of etcd with the revisions the real guards compare (the election key, bound to a
lease that may expire at any moment; the fence epoch and each node's fence, bumped together by
a withdrawal; the committed record), a network of reports in flight, and on each node that won
an election the real :class:`~elasticd.replication.tally.Tally`, whose writes are carried out
against the model etcd with the real compare rules: a write lands only if every revision it
compares is still current. A deposed coordinator keeps its tally and keeps trying. A node's
report is built the way :meth:`Reporter._report` builds it: the versions with both copies that
its book may still record, the fence revision it learned when its last withdrawal landed.

Checked after every step: every holder the committed version names holds it (unless a restore
abandoned its generation), the committed version never goes back, only the election's holder
ever commits, and every tally's counts equal a recount from scratch.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from elasticd.replication.commit_state import Holder, Verdict
from elasticd.replication.placement import compute_placement
from elasticd.replication.report import Report, placement_digest
from elasticd.replication.tally import AheadWrite, CommitWrite, ReadFences, Tally
from tests.unit.test_commit_state import Node, phase, push_copy
from tests.unit.test_tally import recount

NAMES = ["n0", "n1"]
PLACEMENT = compute_placement(NAMES, {"n0": [0], "n1": [1]}, 2, round=1)
DIGEST = placement_digest(PLACEMENT)


class Etcd:
    """The revisions the commit protocol's guards compare."""

    def __init__(self) -> None:
        self.rev = 1
        self.committed: tuple[int, int] | None = None
        self.committed_rev = 0
        self.election: tuple[int, int, int] | None = None  # (node, term, mod_revision)
        self.epoch = 0
        self.fences: dict[str, int] = {}

    def bump(self) -> int:
        self.rev += 1
        return self.rev


class ProtocolNode(Node):
    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.name = NAMES[rank]
        self.fence: int | None = 0  # the fence revision this node knows (None: read it)
        self.seq = 0
        self.boot = 1
        self.watched: tuple[int, int] | None = None  # (node, term) as its watch last said
        self.tally: Tally | None = None
        self.hopeless: set[tuple[int, int]] = set()
        self.skipped: set[tuple[int, int]] = set()
        self.withdrawing: list[tuple[int, int]] = []  # withdrawals not landed yet
        self.known_commit: tuple[tuple[int, int] | None, int] = (None, 0)


class CoordinatedProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.nodes = [ProtocolNode(0), ProtocolNode(1)]
        self.etcd = Etcd()
        self.now = 0.0
        self.flight: list[tuple[int, int, Report]] = []  # (to node, term, report)
        self.commits: list[tuple[int, int]] = []
        self.terms = 0

    idx = st.integers(0, 1)

    # -- the nodes' own work (as in test_commit_state) -------------------------------------

    def learn(self, node: ProtocolNode) -> None:
        if self.etcd.committed is not None:
            node.perform(node.book.commit(self.etcd.committed))
        node.known_commit = (self.etcd.committed, self.etcd.committed_rev)

    @rule(i=idx)
    def snapshot(self, i):
        node = self.nodes[i]
        node.step += 1
        pending = node.stores[Holder.LOCAL].write(node.rank, (node.generation, node.step))
        if pending is not None:  # skipped: reported as such, and the version in the way followed
            node.skipped.add((node.generation, node.step))
            node.perform(node.book.blocked(pending, self.now))

    @rule(i=idx)
    def push(self, i):
        owner = self.nodes[i]
        # The sink lets a copy go only when the owner's fence record lists it: written when
        # the withdrawal lands, not when the owner decides it.
        published = owner.book.withdrawn - set(owner.withdrawing)
        version = push_copy(owner, self.nodes[1 - i], self.now, self.learn, published)
        if version is not None:
            owner.acked.add(version)

    @rule(i=idx)
    def snapshot_and_push(self, i):
        self.snapshot(i)
        self.push(i)

    @rule(i=idx)
    def learn_commit(self, i):
        self.learn(self.nodes[i])

    @rule()
    def tick(self):
        self.now += 0.4

    # -- reports ---------------------------------------------------------------------------

    @rule(i=idx)
    def send_report(self, i):
        node = self.nodes[i]
        if node.watched is None:
            return
        if node.fence is None:  # Reporter._send_once reads it first
            node.fence = self.etcd.fences.get(node.name, 0)
        book = node.book
        listed = sorted((v for v in node.acked if book.recordable(v) and v[0] >= book.floor),
                        reverse=True)[:4]
        dead = sorted(node.skipped | set(book.withdrawn), reverse=True)[:16]
        node.seq += 1
        report = Report("j", node.name, node.watched[1], DIGEST, node.boot, node.seq,
                        node.fence, book.floor, {node.rank: tuple(listed)}, tuple(dead),
                        tuple(book.awaiting()))
        self.flight.append((node.watched[0], node.watched[1], report))

    @precondition(lambda self: self.flight)
    @rule(data=st.data(), keep=st.booleans())
    def deliver(self, data, keep):
        """Any report in flight arrives (a kept one arrives again later: a repeat)."""
        self.deliver_at(data.draw(st.integers(0, len(self.flight) - 1)), keep)

    @rule(i=idx)
    def report_now(self, i):
        """A report sent and delivered at once (the common case)."""
        self.send_report(i)
        if self.flight and self.flight[-1][2].node == NAMES[i]:
            self.deliver_at(len(self.flight) - 1, keep=False)

    def deliver_at(self, k: int, keep: bool) -> None:
        to, term, report = self.flight[k] if keep else self.flight.pop(k)
        node = self.nodes[to]
        if node.tally is None or node.tally.term != term:
            return
        reply = node.tally.report(report)
        sender = self.nodes[NAMES.index(report.node)]
        if reply.accepted:
            sender.hopeless = set(reply.hopeless)
        elif reply.reason == "fenced":
            sender.fence = None

    @precondition(lambda self: self.flight)
    @rule(data=st.data())
    def lose(self, data):
        self.flight.pop(data.draw(st.integers(0, len(self.flight) - 1)))

    # -- the election ------------------------------------------------------------------------

    @rule(i=idx)
    def campaign(self, i):
        """Node i finds no election key and creates it (bound to a fresh lease)."""
        if self.etcd.election is not None:
            return
        node = self.nodes[i]
        self.terms += 1
        rev = self.etcd.bump()
        self.etcd.election = (i, self.terms, rev)
        committed, committed_rev = node.known_commit  # what its watch brought: may be stale
        node.tally = Tally(self.terms, rev, PLACEMENT, committed=committed,
                           committed_rev=committed_rev, floor=node.book.floor)

    @rule()
    def lease_expires(self):
        """The coordinator's lease expires (it died, froze, or lost etcd): the key goes; the
        coordinator itself may not know yet."""
        if self.etcd.election is not None:
            self.etcd.election = None
            self.etcd.bump()

    @rule(i=idx)
    def watch_election(self, i):
        e = self.etcd.election
        self.nodes[i].watched = None if e is None else (e[0], e[1])

    @rule(i=idx)
    def elect_and_watch(self, i):
        self.campaign(i)
        self.watch_election(0)
        self.watch_election(1)

    @rule(i=idx)
    def coordinator_writes(self, i):
        """Node i's tally (deposed or not) carries out its next write against etcd."""
        node, etcd = self.nodes[i], self.etcd
        t = node.tally
        if t is None:
            return
        write = t.next_write()
        if isinstance(write, ReadFences):
            t.take_fences(etcd.epoch, etcd.fences)
        elif isinstance(write, (CommitWrite, AheadWrite)):
            g = write.guards
            holder = etcd.election
            ok = (holder is not None and holder[2] == g.term and etcd.epoch == g.epoch
                  and (isinstance(write, AheadWrite) or etcd.committed_rev == g.committed))
            if not ok:
                # JobCoordinator._refresh: deposed, or read back what the guards compared.
                if holder is None or holder[2] != t.term_rev:
                    node.tally = None
                    return
                t.learn_committed(etcd.committed, etcd.committed_rev)
                if etcd.epoch != t.epoch_rev:
                    t.want_fences = True
                return
            assert holder[0] == i, "a deposed coordinator wrote"
            rev = etcd.bump()
            if isinstance(write, CommitWrite):
                assert etcd.committed is None or write.version > etcd.committed, \
                    f"commit of {write.version} after {etcd.committed}"
                etcd.committed, etcd.committed_rev = write.version, rev
                self.commits.append(write.version)
            t.wrote(write, rev)

    @rule(i=idx)
    def coordinator_learns_commit(self, i):
        t = self.nodes[i].tally
        if t is not None:
            t.learn_committed(self.etcd.committed, self.etcd.committed_rev)

    @rule(i=idx)
    def coordinator_works(self, i):
        """The coordinator carries out what it can (fences, then commits)."""
        for _ in range(3):
            self.coordinator_writes(i)

    # -- withdrawals, racing the reports -----------------------------------------------------

    @precondition(lambda self: any(n.following for n in self.nodes))
    @rule(i=idx, data=st.data())
    def follow(self, i, data):
        node = self.nodes[i]
        if not node.following:
            return
        version = data.draw(st.sampled_from(sorted(node.following)))
        hopeless = version in node.hopeless or data.draw(st.booleans())
        verdict = node.book.verdict(version, self.now, hopeless=hopeless)
        if verdict is Verdict.WAIT:
            return
        node.following.discard(version)
        if verdict is Verdict.WITHDRAW:
            node.book.withdrawing(version)  # never reported again from here on
            node.withdrawing.append(version)

    @precondition(lambda self: any(n.withdrawing for n in self.nodes))
    @rule(i=idx, landed=st.booleans(), known=st.booleans())
    def withdrawal_ends(self, i, landed, known):
        """The withdrawal's transaction (fence and epoch) lands or not; the node learns the
        outcome, or not (then its copies stay and it reads its fence before reporting)."""
        node = self.nodes[i]
        if not node.withdrawing:
            return
        version = node.withdrawing.pop(0)
        if landed:
            rev = self.etcd.bump()
            self.etcd.epoch = self.etcd.fences[node.name] = rev
        if not known:
            node.book.withdraw_failed(version, self.now)
            node.fence = None
            return
        node.fence = self.etcd.fences.get(node.name, 0)
        self.learn(node)  # the withdrawal reads the commit in force after the fence
        if self.etcd.committed != version:
            node.perform(node.book.withdrawn_landed(version))

    @rule()
    def new_generation(self):
        for node in self.nodes:
            node.generation += 1
            node.perform(node.book.abandon_below(node.generation))
            node.acked = {v for v in node.acked if v[0] >= node.generation}

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def every_named_holder_holds_the_commit(self):
        c = self.etcd.committed
        if c is None or c[0] < max(n.book.floor for n in self.nodes):
            return  # a restore abandoned its generation: no restore reads it any more
        for owner in self.nodes:
            peer = self.nodes[1 - owner.rank]
            assert owner.holds(Holder.LOCAL, owner.rank, c), \
                f"owner of rank {owner.rank} lost committed {c}"
            assert peer.holds(Holder.REPLICA, owner.rank, c), \
                f"holder of rank {owner.rank}'s replica lost committed {c}"

    @invariant()
    def commits_only_go_forward(self):
        assert self.commits == sorted(set(self.commits))

    @invariant()
    def tallies_count_right(self):
        for node in self.nodes:
            t = node.tally
            if t is not None:
                assert t.candidate() == recount(t)["candidate"]


CoordinatedProtocol.TestCase.settings = settings(
    max_examples=1000, stateful_step_count=40, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow])
test_coordinated_protocol = CoordinatedProtocol.TestCase


def test_a_coordinator_deposed_mid_decision_cannot_commit_and_its_successor_can():
    m = CoordinatedProtocol()
    for i in (0, 1):
        m.snapshot(i)
        m.push(i)
    m.campaign(0)
    for i in (0, 1):
        m.watch_election(i)
        m.send_report(i)
    while m.flight:
        to, term, report = m.flight.pop(0)
        m.nodes[to].tally.report(report)
    m.coordinator_writes(0)  # lists the fences
    assert isinstance(m.nodes[0].tally.next_write(), CommitWrite)
    m.lease_expires()  # n0 froze: its lease expired; it wakes up with its decision
    m.campaign(1)
    m.coordinator_writes(0)
    assert m.etcd.committed is None and m.nodes[0].tally is None, "the deposed one wrote"
    for i in (0, 1):
        m.watch_election(i)
        m.send_report(i)
    for to, term, report in m.flight:
        if m.nodes[to].tally is not None and m.nodes[to].tally.term == term:
            m.nodes[to].tally.report(report)
    m.coordinator_writes(1)  # fences
    m.coordinator_writes(1)
    assert m.etcd.committed == (0, 1)
    m.every_named_holder_holds_the_commit()


def test_a_report_made_before_a_withdrawal_never_commits_the_withdrawn_version():
    m = CoordinatedProtocol()
    m.elect_and_watch(0)
    m.coordinator_works(0)  # fences listed
    for i in (0, 1):
        m.snapshot_and_push(i)
    m.send_report(0)  # n0 lists (0, 1): in flight, slow
    m.nodes[0].following = {(0, 1)}
    m.nodes[0].hopeless = {(0, 1)}
    m.follow(0, _Draw((0, 1)))  # n0 withdraws (0, 1) before its report arrives
    m.withdrawal_ends(0, landed=True, known=True)
    assert phase(m.nodes[0].book, (0, 1)).name == "WITHDRAWN"
    m.snapshot_and_push(0)  # n0 reuses the slot of (0, 1) for (0, 2)
    m.snapshot_and_push(0)
    m.deliver_at(0, keep=False)  # the old report arrives
    m.report_now(1)
    m.coordinator_works(0)
    assert m.etcd.committed != (0, 1), "a withdrawn version was committed"
    m.every_named_holder_holds_the_commit()


class _Draw:
    """Stands in for hypothesis' data.draw in a hand-written order."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)
