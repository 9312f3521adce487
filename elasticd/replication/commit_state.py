"""The commit protocol of one job on one node, as pure decisions: which copies stay.

A step is committed in etcd from the nodes' records of acknowledged copies
(:mod:`elasticd.replication.commit`), after the fact: by the time a node learns of a commit,
every copy the record names must still be there. So a copy that may be committed is *retained*
(its slot is not reused) from the moment it lands, and let go only once the protocol decided
its version. Each version of the job on this node moves through :class:`Phase`::

    ACKED --(copy retained)--> PROTECTED --+--> COMMITTED  (the job's committed copy)
                                           +--> WITHDRAWN  (taken back from this node's record)
                                           +--> ABANDONED  (a newer commit, or a generation
                                                            below the floor: can never commit)

:class:`CommitBook` takes the events (a copy landed, a local snapshot is blocked, a commit was
learned, a generation abandoned, a withdrawal landed) and answers with :class:`Actions`: the
retentions to place or let go, the version to start following. It does no I/O, takes no lock
and reads no clock (the caller passes ``now``); the caller performs the actions, under the same
lock as the event, so that no other event's actions interleave.

Invariants (tested over every order of events in ``tests/unit/test_commit_state.py``):

* Every holder a committed version names holds it: a copy is retained from its landing (before
  any record names it) until its version is committed (it is then retained, job-wide, as the
  committed copy until a newer commit), abandoned, or withdrawn, and a withdrawal is acted on
  only after it landed in etcd behind a fence no commit decided from the older record passes.
* The committed version keeps its copies until a newer commit: a generation floor lets go of
  every undecided version below it but not of the commit (until the new generation's first
  commit it is the job's committed step, the one a second failure restores).
* Nothing is retained for good: once a commit at or above a version is learned, or a floor above
  its generation (the commit excepted), or its withdrawal, neither a retention of it nor any
  bookkeeping about it is left (undecided versions are the only entries, and the committed
  copy the only job-wide retention).
* A version once withdrawn here is never recorded again (:meth:`CommitBook.recordable`).
* An owner sends no copy of a rank newer than an undecided version whose local copy of that rank
  it retains (:meth:`CommitBook.holding_back`): a holder whose slots hold the commit and an
  undecided copy lets the undecided one go when a newer copy arrives
  (:class:`~elasticd.replication.shm_sink.ShmSink`), trusting that the owner decided it first;
  only once a commit is known, or a generation floor opened while the commit in force could
  not be read (before that no holder pins a commit beside an undecided copy; then a holder may
  pin the commit kept through the floor that this owner never learned). Why, and what holding
  back everywhere cost: docs/replication.md, "The commit invariant".

Withdrawals on time wait for the coordinator's word (:meth:`CommitBook.verdict`): a version that
blocks a snapshot is withdrawn ``withdraw_after`` after its landing only once a coordinator
answered this node after that deadline (or ``patience`` later, when none does), and a new
coordinator's term restarts the wait (why: the same section of docs/replication.md).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Sequence

from elasticd.replication.api import Version


class Phase(enum.Enum):
    """Where a version stands on this node (ACKED: a copy landed, its retention asked for;
    PROTECTED: a copy is retained, the version may be committed)."""

    ACKED, PROTECTED, COMMITTED, WITHDRAWN, ABANDONED = range(5)


class Holder(enum.Enum):
    """Which of this node's slot stores a copy is in: its own ranks', or peers' replicas."""

    LOCAL, REPLICA = "local", "replica"

    # Hashed by identity, in C (members are singletons; Enum's own __hash__ is Python code):
    # every landing puts (holder, rank) pairs in a set, 8 ranks per node per step.
    __hash__ = object.__hash__


class Verdict(enum.Enum):
    """What the follower of an acknowledged local version does next: KEEP (committed: it is the
    committed copy), REUSE (withdrawn, abandoned or older than the commit), WAIT (for the commit,
    until :meth:`CommitBook.deadline`), IDLE (undecided, but nothing waits for its slot: stop
    following until something does), WITHDRAW (take it back from this node's record)."""

    KEEP, REUSE, WAIT, IDLE, WITHDRAW = range(5)


@dataclasses.dataclass(frozen=True)
class Retention:
    """One copy (or, with ``rank`` None, every rank's copy) of a version that must stay."""

    holder: Holder
    rank: int | None
    version: Version


@dataclasses.dataclass
class Actions:
    """What the caller performs for an event: ``retain`` first, then ``release`` (so that a
    copy is never unretained between two commits), then starts following ``follow``."""

    retain: list[Retention] = dataclasses.field(default_factory=list)
    release: list[Retention] = dataclasses.field(default_factory=list)
    follow: Version | None = None


@dataclasses.dataclass
class _Entry:
    """An undecided version: its copies here, when it was first acknowledged, whether a local
    snapshot waits for its slot, whether a follower runs."""

    phase: Phase
    since: float
    copies: set[tuple[Holder, int]] = dataclasses.field(default_factory=set)
    blocked: bool = False
    following: bool = False


class CommitBook:
    """The commit state of one job on one node.

    Args:
        withdraw_after: seconds an acknowledged local version that blocks a snapshot may wait
            for its commit before it is withdrawn.
        patience: seconds past that deadline after which it is withdrawn even though no
            coordinator answered this node since (a partition, not an election).
    """

    def __init__(self, withdraw_after: float, patience: float = float("inf")) -> None:
        self.withdraw_after, self.patience = withdraw_after, patience
        self.term: int | None = None  # the coordinator's term last heard
        self.term_since = float("-inf")  # when this node first heard that term
        self.heard_at = float("-inf")  # when a coordinator last answered this node
        self.committed: Version | None = None
        self.floor = 0
        #: The last floor opened without knowing whether a commit is in force (its read failed).
        self.unsure = False
        self.entries: dict[Version, _Entry] = {}
        self.withdrawn: set[Version] = set()
        #: The newest local version landed, when, and the seconds since the one before it
        #: (this node's snapshot cadence: when a rank's next snapshot wants a slot).
        self.newest_local: tuple[Version, float] | None = None
        self.cadence: float | None = None

    def _decided(self, version: Version) -> bool:
        return (version[0] < self.floor or version in self.withdrawn
                or (self.committed is not None and version <= self.committed))

    def recordable(self, version: Version) -> bool:
        """Whether ``version`` may still be put in this node's record (never once withdrawn)."""
        return version not in self.withdrawn

    def holding_back(self, rank: int, version: Version) -> Version | None:
        """The undecided version whose local copy of ``rank`` must be decided before
        ``version`` (a newer snapshot of it) goes to a peer, or None (see the module doc).
        Only once a commit is known here, or a replica of ``rank`` waits here (its owner's
        slots may then hold no commit the holder's pin), or the last floor opened
        :attr:`unsure` (a holder may pin the commit kept through it, :meth:`abandon_below`,
        that this node never learned): before that a holder pins no commit beside the
        undecided copy, so it lets none go."""
        pinned = self.committed is not None or self.unsure
        if not (pinned or any((Holder.REPLICA, rank) in e.copies for e in self.entries.values())):
            return None
        return min((v for v, e in self.entries.items()
                    if v < version and (Holder.LOCAL, rank) in e.copies), default=None)

    def awaiting(self) -> list[Version]:
        """Local versions followed until committed or withdrawn."""
        return sorted(v for v, e in self.entries.items() if e.following)

    # -- events ----------------------------------------------------------------------------

    def landed_ranks(self, holder: Holder, ranks: Sequence[int], version: Version,
                     now: float) -> Actions:
        """Copies of ``ranks`` of one ``version`` that may be committed are here: local
        snapshots a peer acknowledged (or the owner's only copy, with ``m = 1``; a push of a
        node's ranks: one call per node per version, not per rank), or a peer's replica
        received. Retain them, and follow a local version."""
        if not ranks or self._decided(version):
            return Actions()  # older than the commit or abandoned; the commit itself is retained
        entry = self.entries.setdefault(version, _Entry(Phase.ACKED, now))
        entry.copies.update([(holder, rank) for rank in ranks])
        if holder is Holder.LOCAL:
            self._cadence(version, now)
        follow = holder is Holder.LOCAL and not entry.following
        entry.following = entry.following or follow
        return Actions(retain=[Retention(holder, rank, version) for rank in ranks],
                       follow=version if follow else None)

    def _cadence(self, version: Version, now: float) -> None:
        last = self.newest_local
        if last is None or version > last[0]:
            if last is not None and last[0][0] == version[0]:
                self.cadence = now - last[1]
            self.newest_local = (version, now)

    def retained(self, holder: Holder, rank: int, version: Version, held: bool) -> None:
        """The store placed the retention asked by :meth:`landed_ranks` (``held``), or found
        the copy gone already (it then does not count)."""
        if (entry := self.entries.get(version)) is not None and held:
            entry.phase = Phase.PROTECTED
        elif entry is not None:
            entry.copies.discard((holder, rank))

    def blocked(self, version: Version, now: float) -> Actions:
        """A local snapshot was skipped because ``version`` holds the slot it needs."""
        if self._decided(version):
            return Actions()
        entry = self.entries.setdefault(version, _Entry(Phase.ACKED, now))
        entry.blocked = True
        follow = not entry.following
        entry.following = True
        return Actions(follow=version if follow else None)

    def commit(self, version: Version) -> Actions:
        """A commit of ``version`` was learned: it is retained job-wide (any rank, either
        holder), the previous commit and every version at or below it let go."""
        if self.committed is not None and version <= self.committed:
            return Actions()
        # Of an abandoned generation too (learned late): until a newer commit it is the job's
        # committed step, the one a restore reads (see abandon_below).
        actions = Actions(retain=[Retention(h, None, version) for h in Holder])
        if self.committed is not None:
            actions.release += [Retention(h, None, self.committed) for h in Holder]
        self.committed = version
        self.withdrawn = {v for v in self.withdrawn if v > version}
        return self._drop(lambda v: v <= version, actions)

    def abandon_below(self, generation: int, unsure: bool = False) -> Actions:
        """A restore opened ``generation``: undecided copies of older generations can never
        commit, and go. The committed copy stays, retained until a newer commit: until the new
        generation's first commit it is still the job's committed step, the one a second
        failure restores (letting it go here, a node that came back before a world-2 phase
        committed anything made the job restore step 0 instead of the committed step 15).

        Holders and owners count the kept commit alike because the caller learns the committed
        record before it opens the floor; ``unsure``: it could not read it, so a holder may
        pin a commit this node never learned (one slot fewer for this node's undecided
        versions than it assumes): this node then holds its newer copies back behind an
        undecided one (:meth:`holding_back`), so that no holder lets go of an undecided copy
        for a newer one before its owner decided it."""
        if generation <= self.floor:
            return Actions()
        self.floor, self.unsure = generation, unsure
        return self._drop(lambda v: v[0] < generation, Actions())

    def superseded(self, holder: Holder, rank: int, version: Version) -> Actions:
        """A newer copy of ``rank`` arrived while ``version`` still held a slot: its owner
        decided it (committed, which this node's learning then says, or withdrew it)."""
        entry = self.entries.get(version)
        if entry is None or (holder, rank) not in entry.copies:
            return Actions()
        entry.copies.discard((holder, rank))
        if not entry.copies and not entry.following:
            del self.entries[version]
        return Actions(release=[Retention(holder, rank, version)])

    def withdrawing(self, version: Version) -> None:
        """This node is about to take ``version`` back from its record: from now on it is
        never recorded again (its copies stay until :meth:`withdrawn_landed`)."""
        self.withdrawn.add(version)

    def withdrawn_landed(self, version: Version) -> Actions:
        """The withdrawal landed and found ``version`` not committed: no commit of it can land
        any more, so every copy of it goes."""
        return self._drop(lambda v: v == version, Actions())

    def withdraw_failed(self, version: Version, now: float) -> None:
        """Whether the withdrawal landed is unknown: the copies stay, and the version is
        followed again only when a snapshot is blocked by it again."""
        if (entry := self.entries.get(version)) is not None:
            entry.following = entry.blocked = False
            entry.since = now

    def heard(self, term: int, now: float) -> None:
        """The job's coordinator, in ``term``, answered this node (a report weighed, or
        refused for a reason of its own: it is in office). A new term restarts the wait of
        every undecided version (:meth:`deadline`)."""
        if term != self.term:
            self.term, self.term_since = term, now
        self.heard_at = max(self.heard_at, now)

    def _drop(self, which: Callable[[Version], bool], actions: Actions) -> Actions:
        """Forgets the entries ``which`` picks and lets their copies go."""
        for version in [v for v in self.entries if which(v)]:
            actions.release += [Retention(h, r, version) for h, r in sorted(
                self.entries.pop(version).copies, key=lambda c: (c[0].value, c[1]))]
        return actions

    # -- the follower ----------------------------------------------------------------------

    def verdict(self, version: Version, now: float, hopeless: bool = False) -> Verdict:
        """What the follower of ``version`` does now; ``hopeless``: another owner's record
        shows it can no longer be committed. IDLE also ends the following. Past the
        deadline, a blocking version is withdrawn only on a coordinator's answer heard since
        (:meth:`answered`), or ``patience`` later: WAIT meanwhile (the caller asks)."""
        entry = self.entries.get(version)
        if entry is None:
            return Verdict.KEEP if version == self.committed else Verdict.REUSE
        if hopeless:
            return Verdict.WITHDRAW
        deadline = self.deadline(version)
        if now < deadline:
            return Verdict.WAIT
        if entry.blocked:
            return Verdict.WITHDRAW if self.answered(version, now) else Verdict.WAIT
        entry.following = False
        return Verdict.IDLE

    def answered(self, version: Version, now: float) -> bool:
        """Whether a coordinator answered this node since ``version``'s deadline (or no
        answer is waited for any more: ``patience`` passed)."""
        deadline = self.deadline(version)
        return self.heard_at >= deadline or now >= deadline + self.patience

    def ask_at(self, version: Version, lead: float) -> float:
        """When the follower of an undecided ``version`` asks the coordinator whether it is
        hopeless, before its :meth:`deadline`: once, ``lead`` seconds before this node's next
        snapshot is due (the landing of ``version`` plus the :attr:`cadence`; the deadline
        when sooner or the cadence is not known yet). An answer pays off only then: a
        hopeless version withdrawn before that snapshot frees the slot it wants; asked
        earlier, the answer mostly comes before the other nodes' reports and says nothing."""
        entry = self.entries.get(version)
        if entry is None:
            return float("-inf")
        due = self.deadline(version)
        if self.cadence is not None:
            due = min(due, entry.since + self.cadence)
        return max(entry.since, due - lead)

    def deadline(self, version: Version) -> float:
        """When an undecided ``version`` that blocks a snapshot is withdrawn, on the word of
        a coordinator (``withdraw_after`` after its landing or after this node first heard
        the coordinator's term, whichever is later)."""
        entry = self.entries.get(version)
        return (float("-inf") if entry is None
                else max(entry.since, self.term_since) + self.withdraw_after)
