"""The closer's running counts over the node records: O(1) work per watch event.

The closer follows every node record of the run (one watch event per join, rejoin and expiry),
and the round decision (:func:`~.rounds.decide_close`) ranks them all, which is O(N log N).
Called on every event, that is O(N²) per round. :class:`Tally` keeps the counts the rules of
:mod:`.rounds` depend on, updated per event in O(1), and says when the round *may* close
(:meth:`Tally.may_close`): only then does the closer call the decision, once or twice a round.
It also keeps when each member of the round was first seen absent, for the dead members of the
waiting summary (:meth:`Tally.dead`), and the daemons' failure marks (:mod:`.failures`): a
record a mark dooms counts as deleted, and a member gone with a mark is dead at once.

Pure: no I/O, no clock of its own (times are passed in), tested alone against the counts
recomputed from scratch (``tests/unit/test_rendezvous_tally.py``).
"""

from __future__ import annotations

from typing import Iterable

from elasticd.rendezvous.failures import doomed, markable
from elasticd.rendezvous.records import NodeRecord, RoundRecord, Waiting
from elasticd.rendezvous.rounds import next_round


class Tally:
    """Counts over the live node records, for the round after ``last``.

    Attributes:
        nodes: live node records by id (what :func:`~.rounds.decide_close` reads).
        live_members: live members of ``last``.
        training: live members of ``last`` still asking for it (they block the close).
        absent_since: when each member of ``last`` was first seen absent (caller's clock).
        gone_records: the last record seen of each absent member (what daemon it named).
        failed: absent members whose daemon the daemons recorded failed (:mod:`.failures`):
            dead at once, without the confirmation.
        marks: the failure marks, by (daemon, lease): the revision that created each, and
            the members it names.
    """

    def __init__(self, last: RoundRecord | None = None, now: float = 0.0) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self.last: RoundRecord | None = None
        self._members: frozenset[str] = frozenset()
        self._next = 0
        self.live_members = 0
        self.training = 0
        self.absent_since: dict[str, float] = {}
        self.gone_records: dict[str, NodeRecord] = {}
        self.failed: set[str] = set()
        self.marks: dict[tuple[str, int], tuple[int, frozenset[str]]] = {}
        self.new_round(last, now)

    # -- events ---------------------------------------------------------------------------

    def new_round(self, last: RoundRecord | None, now: float) -> None:
        """A round closed (or the record was re-read): recounts, O(N) once per round."""
        self.last = last
        self._members = frozenset(last.members) if last is not None else frozenset()
        self._next = next_round(last)
        self.live_members = self.training = 0
        for rec in self.nodes.values():
            self._count(rec, +1)
        self.absent_since = {m: self.absent_since.get(m, now)
                             for m in self._members if m not in self.nodes}
        self.gone_records = {m: r for m, r in self.gone_records.items() if m in self.absent_since}
        self.failed &= set(self.absent_since)
        self._find_marked()

    def load(self, records: Iterable[NodeRecord], now: float) -> None:
        """Replaces the records by a full listing (the marks first: :meth:`load_marks`)."""
        records = list(records)
        self.nodes = {rec.node: rec for rec in records if not self._doomed(rec)}
        self.new_round(self.last, now)
        for rec in records:
            if self._doomed(rec) and rec.node in self.absent_since:
                self.gone_records[rec.node] = rec
                self.failed.add(rec.node)

    def load_marks(self, marks: Iterable[tuple[str, int, int, Iterable[str]]]) -> None:
        """Replaces the failure marks by a full listing: (daemon, lease, the revision that
        created the mark, the members it names) each; :meth:`load` applies them."""
        self.marks = {(d, lease): (rev, frozenset(names)) for d, lease, rev, names in marks}

    def mark(self, daemon: str, lease: int, revision: int, members: Iterable[str],
             now: float) -> None:
        """The daemons recorded ``daemon``'s lease ``lease`` failed (its mark, created at
        ``revision``, was written or rewritten): the records it dooms are deleted from now
        on, and the members gone with it dead (:mod:`.failures`). O(N) once a failure."""
        self.marks[(daemon, lease)] = (revision, frozenset(members))
        for rec in [r for r in self.nodes.values() if self._doomed(r)]:
            self.delete(rec.node, now)
        self._find_marked()

    def unmark(self, daemon: str, lease: int) -> None:
        """A mark went (its writer's lease did): what it did stays done."""
        self.marks.pop((daemon, lease), None)

    def _doomed(self, rec: NodeRecord) -> bool:
        mark = self.marks.get((rec.daemon, rec.daemon_lease))
        return doomed(rec.daemon, rec.daemon_lease, rec.written,
                      mark[0] if mark is not None else None)

    def _find_marked(self) -> None:
        """Marks the absent members a failure mark is about (see :mod:`.failures`)."""
        if not self.marks:
            return
        named: set[str] = set()
        for _, members in self.marks.values():
            named |= members
        for m in self.absent_since:
            rec = self.gone_records.get(m)
            if rec is None:  # this closer never saw its record: the marks' member lists
                if m in named:
                    self.failed.add(m)
            elif markable(rec.daemon, rec.daemon_lease) \
                    and (rec.daemon, rec.daemon_lease) in self.marks:
                self.failed.add(m)

    def put(self, rec: NodeRecord, now: float) -> None:
        """A node record was written (a join, a rejoin, a re-registration); one a failure
        mark dooms (written before the mark) counts as deleted."""
        if self._doomed(rec):
            self.delete(rec.node, now)
            if rec.node in self.absent_since:
                self.gone_records[rec.node] = rec
                self.failed.add(rec.node)
            return
        old = self.nodes.get(rec.node)
        if old is not None:
            self._count(old, -1)
        self.nodes[rec.node] = rec
        self._count(rec, +1)
        self.absent_since.pop(rec.node, None)
        self.gone_records.pop(rec.node, None)
        self.failed.discard(rec.node)

    def delete(self, node: str, now: float) -> None:
        """A node record is gone (its lease expired or was revoked)."""
        old = self.nodes.pop(node, None)
        if old is not None:
            self._count(old, -1)
        if node in self._members:
            self.absent_since.setdefault(node, now)
            if old is not None:
                self.gone_records[node] = old
                if (old.daemon, old.daemon_lease) in self.marks:  # the mark came first
                    self.failed.add(node)

    def _count(self, rec: NodeRecord, sign: int) -> None:
        if rec.node in self._members:
            self.live_members += sign
            if rec.target < self._next:
                self.training += sign

    # -- what the counts say --------------------------------------------------------------

    @property
    def candidates(self) -> int:
        """Live nodes that have joined the next round (:func:`~.rounds.joined`)."""
        return len(self.nodes) - self.training

    @property
    def rejoining(self) -> int:
        """Live members asking for a later round."""
        return self.live_members - self.training

    @property
    def outsiders(self) -> int:
        """Live nodes that are not members of the last round."""
        return len(self.nodes) - self.live_members

    def may_close(self, min_nodes: int) -> bool:
        """False when :func:`~.rounds.decide_close` would surely say no: a live member still
        trains, or fewer than ``min_nodes`` joined. True does not mean it closes (the last
        call may still run): the caller then asks the decision itself."""
        return self.training == 0 and self.candidates >= min_nodes

    def dead(self, now: float, confirm: float, trusted: bool) -> tuple[str, ...]:
        """Members absent for ``confirm`` seconds, or absent and recorded failed by the
        daemons (:attr:`failed`), in rank order; none when not ``trusted``."""
        if not trusted or self.last is None:
            return ()
        return tuple(m for m in self.last.members if m in self.absent_since and (
            m in self.failed or now - self.absent_since[m] >= confirm))

    def next_confirm(self, now: float, confirm: float) -> float | None:
        """When the next absent member becomes dead (None: no member is absent)."""
        due = [t + confirm for m, t in self.absent_since.items()
               if t + confirm > now and m not in self.failed]
        return min(due) if due else None

    def waiting(self, dead: tuple[str, ...]) -> Waiting:
        """The summary of who waits for the next round."""
        return Waiting(self.last.round if self.last is not None else -1, self.rejoining,
                       self.outsiders, dead)
