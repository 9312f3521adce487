"""The commit state machine over every order of its events (hypothesis, stateful).

Two nodes, one rank each, two copies of every shard (each node holds its own rank's snapshots
and the other's replicas). A model of etcd (the nodes' records, the committed version, the
fence a withdrawal passes atomically) and a model of the double-buffered slots (the store's
reuse rule: never the latest, unless the other slot must stay) stand around the real
:class:`CommitBook` of each node, whose actions are performed by the tracker's own
:func:`apply_actions`. Hypothesis interleaves snapshots, pushes, record writes, commit
decisions, commits learned late, time, followers' verdicts (withdrawals included) and new
generations, a coordinator's death and the next one's election (no commit between them), and
a rank's new owner holding its commit only among its replicas (a placement after a kill), and
checks after each step:

* every holder the committed version names holds it (the race: a commit decided in etcd after
  the fact, from records, while a holder reuses its slots), unless a restore abandoned its
  generation;
* the committed version keeps its copies until a newer commit, through new generations too
  (a second failure before the new generation's first commit restores it): every holder it
  names holds it, once every node read it when the generation opened (as
  :meth:`Replicator.start_generation` does; a node whose read failed may lose its copies, but
  the first invariant still holds for the new generation's commits);
* what the stores retain is exactly what the books say (the store only pins what it is told);
* nothing decided is remembered or retained: no entry or withdrawn version at or below the
  commit a node learned, none below its generation floor (the leaks fixed before: followed
  versions kept after their commit, withdrawn versions never forgotten, replicas of an
  abandoned generation kept by the sink's store);

* no version is withdrawn on time while no coordinator is in office (the withdrawals that
  widened the snapshot grid during a coordinator's outage), unless ``patience`` passed;

and at the end, that a commit newer than everything leaves only itself retained, no follower
waiting, and that a version blocking a snapshot is withdrawn once ``withdraw_after`` passed and
a coordinator answered.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from elasticd.replication.commit_state import CommitBook, Holder, Phase, Verdict
from elasticd.replication.tracker import apply_actions

JOB = "j"
WITHDRAW_AFTER = 1.0
PATIENCE = 3.0


def phase(book: CommitBook, version: tuple[int, int]) -> Phase:
    """Where ``version`` stands in ``book`` (a version never seen counts as abandoned)."""
    if (entry := book.entries.get(version)) is not None:
        return entry.phase
    return (Phase.COMMITTED if version == book.committed else
            Phase.WITHDRAWN if version in book.withdrawn else Phase.ABANDONED)


class ModelStore:
    """Two slots per rank with the reuse rule of :meth:`SlotStore.reserve`, and its
    retention interface."""

    def __init__(self) -> None:
        self.slots: dict[int, list[tuple[int, int]]] = {}  # oldest first, at most two
        self.per_rank: dict[int, set[tuple[int, int]]] = {}
        self.everywhere: set[tuple[int, int]] = set()

    def retain(self, job, rank, version) -> bool:
        if rank is None:
            self.everywhere.add(version)
            return True
        if version not in self.slots.get(rank, ()):
            return False
        self.per_rank.setdefault(rank, set()).add(version)
        return True

    def release_retained(self, job, rank, version) -> None:
        if rank is None:
            self.everywhere.discard(version)
        else:
            self.per_rank.get(rank, set()).discard(version)

    def _stays(self, rank, version) -> bool:
        return version in self.per_rank.get(rank, ()) or version in self.everywhere

    def write(self, rank: int, version) -> tuple[int, int] | None:
        """Writes ``version``; None, or the pending version that refused it (CommitPending)."""
        held = self.slots.setdefault(rank, [])
        if len(held) < 2:
            held.append(version)
            return None
        older, latest = held
        for victim, kept in ((older, latest), (latest, older)):
            if not self._stays(rank, victim):
                held[:] = [kept, version]
                self.per_rank.get(rank, set()).discard(victim)
                return None
        return min((v for v in held if v not in self.everywhere),
                   default=min(self.everywhere, default=(0, 0)))

    def retained(self) -> dict[int, set[tuple[int, int]]]:
        return {r: set(vs) for r, vs in self.per_rank.items() if vs}


class Node:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.book = CommitBook(WITHDRAW_AFTER, PATIENCE)
        self.stores = {Holder.LOCAL: ModelStore(), Holder.REPLICA: ModelStore()}
        self.heard_at = float("-inf")  # when a coordinator in office last answered it
        self.generation, self.step = 0, 0
        self.acked: set[tuple[int, int]] = set()  # own versions with both copies
        self.record: set[tuple[int, int]] = set()  # what etcd holds for this node
        self.following: set[tuple[int, int]] = set()

    def perform(self, actions) -> None:
        apply_actions(self.book, JOB, actions, self.stores)
        if actions.follow is not None:
            self.following.add(actions.follow)

    def holds(self, holder: Holder, rank: int, version) -> bool:
        return version in self.stores[holder].slots.get(rank, ())


def push_copy(owner: Node, peer: Node, now: float, learn, published) -> tuple[int, int] | None:
    """The owner's newest snapshot, pinned while sent, lands at the peer (its sink's rules),
    then the owner retains its own copy (still pinned). ``learn(peer)``: the sink asks etcd
    for the commit; ``published``: the versions the owner's etcd record lists as withdrawn.
    Returns the version both hold, or None when the push was refused."""
    local = owner.stores[Holder.LOCAL].slots.get(owner.rank)
    if not local:
        return None
    version = local[-1]
    older = owner.book.holding_back(owner.rank, version)
    if older is not None:  # the pusher sends nothing past an undecided copy: it blocks
        owner.perform(owner.book.blocked(older, now))
        return None
    if version[0] < peer.book.floor:
        return None  # the sink refuses abandoned generations
    replicas = peer.stores[Holder.REPLICA]
    if version in replicas.slots.get(owner.rank, ()):
        pass  # EXISTS: the peer holds it already, the push counts
    elif replicas.slots.get(owner.rank) and version < replicas.slots[owner.rank][-1]:
        return None  # STALE
    else:
        pending = replicas.write(owner.rank, version)
        if pending is not None:
            if version <= pending:
                return None
            learn(peer)  # the sink asks etcd for the commit first
            pending = replicas.write(owner.rank, version)
        if pending is not None:
            if version <= pending:
                return None
            # ShmSink._resolved: with two undecided copies in the way, only one the
            # owner's record lists as withdrawn may go (published with the withdrawal).
            undecided = sorted(v for v in replicas.slots[owner.rank]
                               if v < version and v not in replicas.everywhere)
            if len(undecided) > 1:
                dead = {v for v in undecided if v in published}
                if not dead:
                    return None  # refused: the owner retries
                pending = max(dead)
            peer.perform(peer.book.superseded(Holder.REPLICA, owner.rank, pending))
            if replicas.write(owner.rank, version) is not None:
                return None
        peer.perform(peer.book.landed_ranks(Holder.REPLICA, (owner.rank,), version, now))
    # The tracker's call for an acknowledged push (its ranks in one event, here the one rank)
    owner.perform(owner.book.landed_ranks(Holder.LOCAL, [owner.rank], version, now))
    return version


class CommitProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.nodes = [Node(0), Node(1)]
        self.now = 0.0
        self.committed: tuple[int, int] | None = None  # in etcd
        # Every node knew the commit in etcd at each new generation since it was committed.
        self.known_at_floors = True
        self.term, self.in_office = 1, True  # the coordinator's

    nodes_idx = st.integers(0, 1)

    def learn(self, node: Node) -> None:
        if self.committed is not None:
            node.perform(node.book.commit(self.committed))

    @rule(i=nodes_idx, times=st.integers(1, 2))
    def snapshot(self, i, times):
        """Snapshots whose pushes the lanes skip (newest wins)."""
        node = self.nodes[i]
        for _ in range(times):
            node.step += 1
            pending = node.stores[Holder.LOCAL].write(node.rank, (node.generation, node.step))
            if pending is not None:  # skipped: the version in the way is followed as blocking
                node.perform(node.book.blocked(pending, self.now))

    @rule(i=nodes_idx)
    def snapshot_and_push(self, i):
        self.snapshot(i, 1)
        self.push(i)

    @rule(i=nodes_idx)
    def push(self, i):
        """The owner's newest snapshot, pinned while sent, lands at the peer, then the owner
        retains its own copy (still pinned), and counts both copies."""
        owner = self.nodes[i]
        version = push_copy(owner, self.nodes[1 - i], self.now, self.learn,
                            owner.book.withdrawn)
        if version is None:
            return
        owner.acked.add(version)
        # Both copies counted: the owner writes its record.
        ok = {v for v in owner.acked if owner.book.recordable(v) and v[0] >= owner.book.floor}
        owner.record = set(sorted(ok, reverse=True)[:4])

    @precondition(lambda self: self.in_office)
    @rule(i=nodes_idx)
    def commit(self, i):
        """The coordinator decides and records a commit from the records (with the fences
        unchanged: atomic here)."""
        common = {v for v in self.nodes[0].record & self.nodes[1].record
                  if v[0] >= self.nodes[i].book.floor}
        if common and (self.committed is None or max(common) > self.committed):
            self.committed = max(common)
            self.known_at_floors = True

    @rule(i=nodes_idx)
    def learn_commit(self, i):
        self.learn(self.nodes[i])

    @rule()
    def tick(self):
        self.now += 0.4

    @precondition(lambda self: self.in_office)
    @rule()
    def coordinator_dies(self):
        """Its election key waits out its lease: reports reach no one, nothing commits."""
        self.in_office = False

    @precondition(lambda self: not self.in_office)
    @rule()
    def elect(self):
        self.term, self.in_office = self.term + 1, True

    def hear(self, node: Node) -> None:
        node.book.heard(self.term, self.now)
        node.heard_at = self.now

    @precondition(lambda self: any(
        n.book.committed == self.committed is not None and n.holds(Holder.LOCAL, n.rank,
                                                                   self.committed)
        and self.committed[0] >= n.book.floor
        and not any((Holder.LOCAL, n.rank) in e.copies for e in n.book.entries.values())
        for n in self.nodes))
    @rule(i=nodes_idx)
    def new_owner(self, i):
        """Node i's rank gets an owner that holds its commit only among its replicas, as the
        holder of a killed node's ranks does once it owns them: its local slots of the rank
        are free (nothing undecided of it was there)."""
        node = self.nodes[i]
        if not (node.book.committed == self.committed is not None
                and node.holds(Holder.LOCAL, node.rank, self.committed)
                and self.committed[0] >= node.book.floor
                and not any((Holder.LOCAL, node.rank) in e.copies
                            for e in node.book.entries.values())):
            return
        del node.stores[Holder.LOCAL].slots[node.rank]
        node.stores[Holder.REPLICA].slots[node.rank] = [self.committed]

    @precondition(lambda self: any(n.following for n in self.nodes))
    @rule(i=nodes_idx, data=st.data())
    def follow(self, i, data):
        node = self.nodes[i]
        if not node.following:
            return
        version = data.draw(st.sampled_from(sorted(node.following)))
        # Only a coordinator in office answers the follower's question (hopeless or not).
        answered = self.in_office and data.draw(st.booleans())
        if answered:
            self.hear(node)
        self.follow_verdict(node, version, hopeless=answered and data.draw(st.booleans()))

    def follow_verdict(self, node: Node, version, hopeless: bool) -> None:
        due = node.book.deadline(version)
        verdict = node.book.verdict(version, self.now, hopeless=hopeless)
        if verdict is Verdict.WITHDRAW and not hopeless:
            assert node.heard_at >= due or self.now >= due + PATIENCE, \
                f"{version} withdrawn on time with no coordinator's word since {due}"
        if verdict is Verdict.WAIT:
            return
        node.following.discard(version)
        if verdict is not Verdict.WITHDRAW:
            return
        node.book.withdrawing(version)
        node.record.discard(version)  # with the fence: no commit decided before lands after
        self.learn(node)  # the withdrawal reads the commit in force after the fence
        if self.committed != version:  # else committed just before: it is the kept copy
            node.perform(node.book.withdrawn_landed(version))

    @rule(unread=st.sampled_from([None, 0, 1]))
    def new_generation(self, unread=None):
        """A restore opened the next generation on every node, each reading the commit in
        etcd first (``unread``: a node whose read failed)."""
        for node in self.nodes:
            if node.rank != unread:
                self.learn(node)
            self.known_at_floors &= node.book.committed == self.committed
            node.generation += 1
            node.perform(node.book.abandon_below(node.generation, unsure=node.rank == unread))
            node.acked = {v for v in node.acked if v[0] >= node.generation}
            node.record = {v for v in node.record if v[0] >= node.generation}

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def every_named_holder_holds_the_commit(self):
        if self.committed is None or self.committed[0] < self.nodes[0].generation:
            return  # a restore abandoned its generation: no restore reads it any more
        for owner in self.nodes:
            peer = self.nodes[1 - owner.rank]
            assert (owner.holds(Holder.LOCAL, owner.rank, self.committed)
                    or owner.holds(Holder.REPLICA, owner.rank, self.committed)), \
                f"owner of rank {owner.rank} lost committed {self.committed}"
            assert peer.holds(Holder.REPLICA, owner.rank, self.committed), \
                f"holder of rank {owner.rank}'s replica lost committed {self.committed}"

    @invariant()
    def the_committed_version_keeps_its_copies_until_a_newer_commit(self):
        if self.committed is None or not self.known_at_floors:
            return
        for owner in self.nodes:
            peer = self.nodes[1 - owner.rank]
            assert (owner.holds(Holder.LOCAL, owner.rank, self.committed)
                    or owner.holds(Holder.REPLICA, owner.rank, self.committed)), \
                f"owner of rank {owner.rank} lost committed {self.committed} " \
                f"(generation {owner.generation})"
            assert peer.holds(Holder.REPLICA, owner.rank, self.committed), \
                f"holder of rank {owner.rank}'s replica lost committed {self.committed} " \
                f"(generation {peer.generation})"

    def the_stores_retain_what_the_books_say(self):
        for node in self.nodes:
            for holder, store in node.stores.items():
                want: dict[int, set] = {}
                for version, entry in node.book.entries.items():
                    for h, rank in entry.copies:
                        if h is holder:
                            want.setdefault(rank, set()).add(version)
                assert store.retained() == want
                c = node.book.committed
                assert store.everywhere == ({c} if c else set())

    @invariant()
    def nothing_decided_is_remembered(self):
        for node in self.nodes:
            c, floor = node.book.committed, node.book.floor
            for version, entry in node.book.entries.items():
                assert c is None or version > c, f"{version} remembered after commit {c}"
                assert version[0] >= floor, f"{version} remembered below floor {floor}"
                assert entry.phase in (Phase.ACKED, Phase.PROTECTED)
                assert entry.copies or entry.following, f"{version}: an empty entry"
            assert c is None or all(v > c for v in node.book.withdrawn)

    def teardown(self):
        if not self.in_office:
            self.elect()
        for node in self.nodes:
            self.hear(node)  # a new term restarts the waits
        self.now += WITHDRAW_AFTER + 1
        for node in self.nodes:
            # A snapshot blocked long enough is withdrawn, once a coordinator answered:
            # nothing waits on a commit forever.
            self.hear(node)
            for version, entry in node.book.entries.items():
                if entry.blocked:
                    assert node.book.verdict(version, self.now) is Verdict.WITHDRAW
            final = (99, 0)
            node.perform(node.book.commit(final))
            assert not node.book.entries and not node.book.withdrawn
            for store in node.stores.values():
                assert store.retained() == {} and store.everywhere == {final}
            for version in node.following:  # every follower ends
                assert node.book.verdict(version, self.now) in (Verdict.KEEP, Verdict.REUSE)


# Derandomized: the same 500 orders on every run, so that CI's verdict does not depend on the
# draw (it found the sink's race, below, in about one run in three before the fix).
CommitProtocol.TestCase.settings = settings(
    max_examples=500, stateful_step_count=30, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow])
test_commit_protocol = CommitProtocol.TestCase


class NewOwnerProtocol(CommitProtocol):
    """The same, from a rank's hand-over: commit (0, 1) learned everywhere, then node 0's rank
    owned by a node that holds it only among its replicas (the orders that start so are too
    rare among the first machine's to be drawn)."""

    @initialize()
    def hand_over(self):
        self.snapshot_and_push(0)
        self.snapshot_and_push(1)
        self.commit(0)
        self.learn_commit(0)
        self.learn_commit(1)
        self.new_owner(0)
        assert not self.nodes[0].stores[Holder.LOCAL].slots


NewOwnerProtocol.TestCase.settings = CommitProtocol.TestCase.settings
test_a_new_owner_protocol = NewOwnerProtocol.TestCase


def test_a_withdrawn_version_is_never_recorded_again_until_a_commit_passes_it():
    book = CommitBook(WITHDRAW_AFTER)
    assert book.landed_ranks(Holder.LOCAL, (0,), (0, 2), now=0.0).follow == (0, 2)
    book.withdrawing((0, 2))
    assert not book.recordable((0, 2))
    actions = book.withdrawn_landed((0, 2))
    assert [(r.rank, r.version) for r in actions.release] == [(0, (0, 2))]
    assert phase(book, (0, 2)) is Phase.WITHDRAWN
    assert book.landed_ranks(Holder.REPLICA, (1,), (0, 2), now=1.0).retain == [], \
        "a withdrawn version can never commit: nothing of it is retained"
    book.commit((0, 3))
    assert book.withdrawn == set() and phase(book, (0, 3)) is Phase.COMMITTED


def test_a_node_that_missed_the_kept_commit_holds_its_pushes_back():
    # Found by the machine above (when a floor let the old commit go everywhere): n2 learned
    # commit (0, 1), n1 did not (here: its read at the new generation failed); a restore opened
    # generation 1. n2 retains (0, 1) for every rank, so one slot of rank 0's replicas is left;
    # n1, retaining nothing old, took (1, 3) and sent (1, 4): n2 let (1, 3) go for (1, 4) (its
    # owner "must have decided it"), and (1, 3) then committed naming n2 as its holder. After a
    # floor n1 holds (1, 4) back behind (1, 3) instead.
    state = CommitProtocol()
    state.snapshot_and_push(0)
    state.snapshot_and_push(1)
    state.snapshot_and_push(1)
    state.commit(0)
    state.learn_commit(1)
    state.snapshot_and_push(0)
    state.new_generation(unread=0)
    for i in (0, 0, 1):
        state.snapshot_and_push(i)
    state.commit(0)
    assert state.committed == (1, 3)
    state.every_named_holder_holds_the_commit()
    state.the_stores_retain_what_the_books_say()


def test_the_commit_stays_restorable_until_the_new_generation_commits():
    # The CI failure of test_sigstop_daemon_without_standby_restores_the_committed_step: (0, 1)
    # committed and learned everywhere; a restore opened generation 1, which snapshotted and
    # sent but committed nothing (its coordinator frozen); the floor let (0, 1) go, the new
    # snapshots took its slots, and the next restore found no copy of (0, 1): step 0.
    state = CommitProtocol()
    state.snapshot_and_push(0)
    state.snapshot_and_push(1)
    state.commit(0)
    state.learn_commit(0)
    state.learn_commit(1)
    state.new_generation()
    state.coordinator_dies()
    for i in (0, 1, 0, 1, 0, 1):
        state.snapshot_and_push(i)
    assert state.committed == (0, 1)
    state.the_committed_version_keeps_its_copies_until_a_newer_commit()
    state.the_stores_retain_what_the_books_say()
    # Its first commit lets (0, 1) go, and keeps the new one.
    state.elect()
    state.commit(0)
    assert state.committed[0] == 1
    for node in state.nodes:
        state.learn(node)
    state.every_named_holder_holds_the_commit()
    state.the_stores_retain_what_the_books_say()


def test_a_sink_lets_go_only_of_the_copy_its_owner_withdrew():
    # The order the search found (before the fix the sink let go of (0,1)): node 0 has
    # (0,1) and (0,2) acknowledged; it withdraws (0,2) (node 1's record shows it cannot
    # commit) while (0,1) stays undecided and listed; node 0 snapshots (0,3) into (0,2)'s
    # slot and pushes it; node 1's replica slots hold (0,1) and (0,2), both retained: the
    # sink must let go of (0,2), which node 0's record lists as withdrawn, and keep (0,1),
    # which a commit from the records names node 1 as holding.
    m = CommitProtocol()
    m.snapshot_and_push(0)
    m.snapshot_and_push(0)
    m.follow_verdict(m.nodes[0], (0, 1), False)
    m.follow_verdict(m.nodes[0], (0, 2), True)
    m.snapshot_and_push(0)
    m.snapshot_and_push(1)
    m.commit(0)
    m.every_named_holder_holds_the_commit()


def test_a_new_owner_sends_nothing_past_its_undecided_copy():
    # The wrong commit of issue 29's first fix, on the model: node 0 takes over its rank
    # holding commit (0, 1) only among its replicas, so its local slots are free; (0, 2) is
    # acknowledged by node 1, whose replica slots then hold (0, 1) and (0, 2); the coordinator
    # is dead, so (0, 2) stays undecided while node 0 snapshots (0, 3) into its free slot.
    # Sent, (0, 3) made node 1 let (0, 2) go ("its owner decided it"), and (0, 2) was then
    # committed naming node 1. Held back, it blocks instead: (0, 2) is followed and decided.
    m = CommitProtocol()
    m.snapshot_and_push(0)
    m.snapshot_and_push(1)
    m.commit(0)
    m.learn_commit(0)
    m.learn_commit(1)
    m.new_owner(0)
    m.coordinator_dies()
    m.snapshot_and_push(0)
    m.snapshot_and_push(1)
    m.snapshot_and_push(0)
    m.elect()
    m.commit(0)
    assert m.committed == (0, 2)
    m.every_named_holder_holds_the_commit()
    assert m.nodes[0].book.entries[(0, 2)].blocked, "the held-back push follows (0, 2)"


def test_a_blocking_version_is_withdrawn_on_time_only_on_a_coordinators_word():
    book = CommitBook(WITHDRAW_AFTER, PATIENCE)
    book.heard(7, 0.0)
    book.landed_ranks(Holder.LOCAL, (0,), (0, 2), now=0.0)
    book.blocked((0, 2), now=0.1)
    assert book.verdict((0, 2), 0.5) is Verdict.WAIT
    # Past the deadline, the coordinator heard last before it: dead, or not asked yet.
    assert book.verdict((0, 2), 1.5) is Verdict.WAIT
    book.heard(7, 1.6)
    assert book.verdict((0, 2), 1.6) is Verdict.WITHDRAW
    # A new term restarts the wait: the new coordinator gets withdraw_after to commit it.
    book.heard(8, 5.0)
    assert book.deadline((0, 2)) == 5.0 + WITHDRAW_AFTER
    assert book.verdict((0, 2), 5.5) is Verdict.WAIT
    assert book.verdict((0, 2), 6.1) is Verdict.WAIT  # no answer since
    # Silent for patience past the deadline: a partition, not an election: withdrawn.
    assert book.verdict((0, 2), 6.0 + PATIENCE) is Verdict.WITHDRAW
    assert book.verdict((0, 2), 0.0, hopeless=True) is Verdict.WITHDRAW


def test_a_push_waits_for_an_older_undecided_local_copy_of_its_rank_only():
    book = CommitBook(WITHDRAW_AFTER)
    book.commit((0, 1))
    book.landed_ranks(Holder.LOCAL, (0,), (0, 2), now=0.0)
    book.landed_ranks(Holder.REPLICA, (1,), (0, 2), now=0.0)
    assert book.holding_back(0, (0, 3)) == (0, 2)
    assert book.holding_back(0, (0, 2)) is None  # itself, to the next peer
    assert book.holding_back(1, (0, 3)) is None  # another rank's, a replica
    book.commit((0, 2))
    assert book.holding_back(0, (0, 3)) is None


def test_a_push_is_held_back_only_where_a_holder_may_pin_a_commit_beside_the_copy():
    # Before the generation's first commit no holder pins one, so none lets an undecided copy
    # go for a newer one (two undecided copies: only a withdrawn one goes): nothing to hold.
    book = CommitBook(WITHDRAW_AFTER)
    book.landed_ranks(Holder.LOCAL, (0,), (0, 1), now=0.0)
    assert book.holding_back(0, (0, 2)) is None
    # A rank's new owner that has not learned the commit its replica slots hold yet.
    book.landed_ranks(Holder.REPLICA, (0,), (0, 0), now=0.0)
    assert book.holding_back(0, (0, 2)) == (0, 1)
    book.commit((0, 0))
    assert book.holding_back(0, (0, 2)) == (0, 1)
    # A new generation: the old commit stays pinned until the new one commits, on holders
    # too (some of which may have learned it where this owner did not): held back.
    book.abandon_below(1)
    book.landed_ranks(Holder.LOCAL, (0,), (1, 1), now=0.0)
    assert book.holding_back(0, (1, 2)) == (1, 1)
    # No commit in force when the floor opened (the read said so): none pinned anywhere.
    fresh = CommitBook(WITHDRAW_AFTER)
    fresh.abandon_below(1)
    fresh.landed_ranks(Holder.LOCAL, (0,), (1, 1), now=0.0)
    assert fresh.holding_back(0, (1, 2)) is None
    # The read failed: a holder may pin a commit this node never learned.
    fresh.abandon_below(2, unsure=True)
    fresh.landed_ranks(Holder.LOCAL, (0,), (2, 1), now=0.0)
    assert fresh.holding_back(0, (2, 2)) == (2, 1)


def hopeless(m: CommitProtocol, node: Node, version) -> bool:
    """The coordinator's rule: another owner's record lists a newer version without it."""
    other = m.nodes[1 - node.rank]
    return any(v > version for v in other.record) and version not in other.record


# (1, 3): node 0's two slots hold steps 1 and 2, undecided, at step 3, so it skips steps 3
# and 4; once node 1 sends step 4 they are hopeless, withdrawn, and step 5 commits.
@pytest.mark.parametrize("late,unsent,first", [(1, 1, 2), (0, 1, 2), (1, 3, 5)])
def test_a_jobs_first_commit_lands_soon_after_every_node_sends(late, unsent, first):
    # The chaos run that reverted issue 29's first fix: a job's first step came before one
    # node knew the placement, so its first snapshot was never sent, while the other node's
    # was acknowledged. Holding every newer push back behind that undecided copy, each node
    # waited on a version the other never had: each was withdrawn in turn (widening the
    # snapshot grid each time) and nothing committed in the 12 steps before the kill.
    m = CommitProtocol()
    for step in range(1, unsent + 5):
        for node in m.nodes:
            m.snapshot(node.rank, 1)
            if step > unsent or node.rank != late:
                m.push(node.rank)
        m.commit(0)
        for node in m.nodes:
            m.learn(node)
            for version in sorted(node.following):
                m.hear(node)
                m.follow_verdict(node, version, hopeless(m, node, version))
        m.tick()
        m.every_named_holder_holds_the_commit()
        m.the_stores_retain_what_the_books_say()
        if m.committed is not None:
            break
    assert m.committed == (0, first), f"first commit {m.committed} by step {step}"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["landed", "commit", "withdraw", "abandon"]),
                          st.lists(st.integers(0, 5), max_size=8),
                          st.tuples(st.integers(0, 2), st.integers(0, 4))), max_size=12))
def test_the_landing_of_several_ranks_at_once_is_each_ranks_landing_merged(events):
    # One event per node per version (CommitTracker.on_pushed), where the per-rank calls made
    # one per rank: the same entries, copies, cadence and followers, and the same actions.
    one, each = CommitBook(WITHDRAW_AFTER), CommitBook(WITHDRAW_AFTER)
    for now, (kind, ranks, version) in enumerate(events):
        if kind == "landed":
            merged = one.landed_ranks(Holder.LOCAL, ranks, version, float(now))
            per = [each.landed_ranks(Holder.LOCAL, (r,), version, float(now)) for r in ranks]
            assert merged.retain == [r for a in per for r in a.retain]
            assert merged.follow == next((a.follow for a in per if a.follow), None)
            assert merged.release == []
        elif kind == "commit":
            assert one.commit(version) == each.commit(version)
        elif kind == "withdraw":
            one.withdrawing(version), each.withdrawing(version)
            assert one.withdrawn_landed(version) == each.withdrawn_landed(version)
        else:
            assert one.abandon_below(version[0]) == each.abandon_below(version[0])
        assert {v: (e.phase, e.copies, e.since, e.following) for v, e in one.entries.items()} \
            == {v: (e.phase, e.copies, e.since, e.following) for v, e in each.entries.items()}
        assert (one.newest_local, one.cadence) == (each.newest_local, each.cadence)
