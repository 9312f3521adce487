"""The commit coordinator's decisions for one job and term, as pure bookkeeping.

One node per job is elected commit coordinator (:mod:`elasticd.replication.coordinator`). Every
node of the job sends it :class:`~elasticd.replication.report.Report`\\ s; a :class:`Tally`
takes them, and the coordinator's view of etcd (the committed record, the fence keys), and says
what to write: :meth:`Tally.next_write`. It does no I/O, takes no lock and reads no clock; the
coordinator performs the writes and feeds back what etcd answered.

Which reports count (*usable*): those of this term, from an owner of this placement, naming this
placement, whose ``fence`` equals that node's fence revision in the fence listing the tally
holds (read with the fence epoch every commit compares; why that keeps a commit from naming a
holder that let its copy go: docs/replication.md, "Which reports count"). A report naming a
fence newer than the listing makes the tally ask for the fences again (:class:`ReadFences`).

The decision is counted, not searched: per version newer than the commit that some usable
report names, how many ranks list it with ``m`` copies (``have``), and how many ranks cannot get
it any more (``blocked``: the rank lists a newer version without it, or its node lists it among
the versions that can never commit). A report changes only its own node's share, so taking one
costs the versions tracked times the node's ranks, not the job's size; a version seen for the
first time is counted once over every usable report. The newest version every rank lists
(``have == ranks``) in a generation not below any usable report's floor is committed; the
versions a node asks about are *hopeless* when ``blocked`` is not zero. ``tests/unit/
test_tally.py`` checks these counts against a recount from scratch after every event.

Besides commits the tally asks for one more small write: ``ckpt/committed.ahead``, the newest
version some rank has with ``m`` copies, when that is newer than the commit and the stored one
is not (at most one per commit): the agents' grow gate reads it
(:mod:`elasticd.agent.commit_watch`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping

from elasticd.replication.api import Version
from elasticd.replication.placement import Placement
from elasticd.replication.report import Reply, Report, placement_digest


@dataclasses.dataclass(frozen=True)
class Guards:
    """The mod_revisions a coordinator's write compares: its election key (its term), the
    fence epoch (0: absent) and the committed record (0: absent)."""

    term: int
    epoch: int
    committed: int


@dataclasses.dataclass(frozen=True)
class CommitWrite:
    """Commit ``version``; with ``placement`` also store the placement its holders derive
    from (the first commit under a placement), with ``ahead`` also the ahead record."""

    version: Version
    guards: Guards
    placement: bool = False
    ahead: Version | None = None


@dataclasses.dataclass(frozen=True)
class AheadWrite:
    """Record ``version`` as the newest one some rank has with ``m`` copies."""

    version: Version
    guards: Guards


@dataclasses.dataclass(frozen=True)
class ReadFences:
    """List the fence keys and the epoch, then call :meth:`Tally.take_fences`."""


Write = CommitWrite | AheadWrite | ReadFences


@dataclasses.dataclass
class _Entry:
    """A usable report, pre-digested: per owned rank its versions and its newest version
    (listed or dead), and what it names newer than the commit."""

    report: Report
    have: list[frozenset[Version]]
    newest: list[Version | None]
    dead: frozenset[Version]

    @classmethod
    def of(cls, report: Report, owned: tuple[int, ...]) -> "_Entry":
        have = [frozenset(report.ranks.get(r, ())) for r in owned]
        newest = [max((*report.ranks.get(r, ()), *report.dead), default=None) for r in owned]
        return cls(report, have, newest, frozenset(report.dead))

    def share(self, v: Version) -> tuple[int, int]:
        """(ranks listing ``v``, ranks that cannot get it any more) of this node."""
        have = blocked = 0
        for vs, newest in zip(self.have, self.newest):
            if v in vs:
                have += 1
            elif newest is not None and newest > v:
                blocked += 1
        if v in self.dead:
            blocked += 1
        return have, blocked


class Tally:
    """The coordinator's decisions for one job in one term.

    Args:
        term: this coordinator's term (its election record's random number).
        term_rev: mod_revision of its election key (what every write compares).
        committed, committed_rev: the committed version known and its record's mod_revision.
        stored_placement: digest of the placement stored beside the committed record.
        ahead: the ahead version stored, if any.
    """

    def __init__(self, term: int, term_rev: int, placement: Placement, *,
                 committed: Version | None = None, committed_rev: int = 0,
                 stored_placement: str = "", ahead: Version | None = None,
                 floor: int = 0) -> None:
        self.term, self.term_rev = term, term_rev
        self.committed, self.committed_rev = committed, committed_rev
        self.stored_placement, self.ahead, self.floor = stored_placement, ahead, floor
        self.epoch_rev: int | None = None  # None: fences not listed (or no longer trusted)
        self.want_fences = False  # a report names a fence newer than the listing
        self.fences: dict[str, int] = {}
        self.reports: dict[str, Report] = {}
        self.entries: dict[str, _Entry] = {}  # the usable reports
        self.set_placement(placement)

    # -- counting ---------------------------------------------------------------------------

    def _reset_counts(self) -> None:
        self.have: collections.Counter[Version] = collections.Counter()
        self.blocked: collections.Counter[Version] = collections.Counter()
        self.listed: collections.Counter[Version] = collections.Counter()
        self.floors: collections.Counter[int] = collections.Counter()
        self.entries = {}

    def _newer(self, v: Version) -> bool:
        return self.committed is None or v > self.committed

    def _add(self, node: str, report: Report) -> None:
        entry = _Entry.of(report, self.owned[node])
        self.entries[node] = entry
        self.floors[report.floor] += 1
        fresh = []
        for v in report.mentioned():
            if self._newer(v):
                if self.listed[v] == 0:
                    fresh.append(v)
                self.listed[v] += 1
        for v in self.listed:
            if v not in fresh:
                have, blocked = entry.share(v)
                self.have[v] += have
                self.blocked[v] += blocked
        for v in fresh:  # first seen: counted over every usable report, this one included
            for e in self.entries.values():
                have, blocked = e.share(v)
                self.have[v] += have
                self.blocked[v] += blocked

    def _remove(self, node: str) -> None:
        entry = self.entries.pop(node)
        self.floors[entry.report.floor] -= 1
        if not self.floors[entry.report.floor]:
            del self.floors[entry.report.floor]
        for v in list(self.listed):
            have, blocked = entry.share(v)
            self.have[v] -= have
            self.blocked[v] -= blocked
        for v in entry.report.mentioned():
            if self._newer(v):
                self.listed[v] -= 1
                if not self.listed[v]:
                    self._forget(v)

    def _forget(self, v: Version) -> None:
        for counter in (self.listed, self.have, self.blocked):
            counter.pop(v, None)

    def _usable(self, report: Report) -> bool:
        return (report.placement == self.digest and self.epoch_rev is not None
                and report.fence == self.fences.get(report.node, 0))

    def _update(self, node: str) -> None:
        """Brings ``node``'s share in line with its stored report."""
        report = self.reports.get(node)
        usable = report is not None and self._usable(report)
        if node in self.entries:
            if usable and self.entries[node].report is report:
                return
            self._remove(node)
        if usable:
            self._add(node, report)  # type: ignore[arg-type]

    # -- events -----------------------------------------------------------------------------

    def set_placement(self, placement: Placement) -> None:
        """The placement in force changed: every report is weighed again."""
        self.placement, self.digest = placement, placement_digest(placement)
        self.owned = {n: tuple(sorted(rs)) for n, rs in placement.ranks.items() if rs}
        self.total = sum(len(rs) for rs in self.owned.values())
        self.reports = {n: r for n, r in self.reports.items() if n in self.owned}
        self._reset_counts()
        for node in self.reports:
            self._update(node)

    def take_fences(self, epoch_rev: int, fences: Mapping[str, int]) -> None:
        """A listing of the fence keys (node -> mod_revision) and the epoch's mod_revision
        (0: absent), read at one revision."""
        changed = {n for n in set(fences) | set(self.fences)
                   if fences.get(n, 0) != self.fences.get(n, 0)}
        if self.epoch_rev is None:
            changed = set(self.reports)
        self.epoch_rev, self.fences, self.want_fences = epoch_rev, dict(fences), False
        for node in changed:
            self._update(node)

    def report(self, report: Report) -> Reply:
        """Takes one node's report; the reply says whether it counts."""
        reason = ""
        if report.term != self.term:
            reason = "term"
        elif report.node not in self.owned:
            reason = "not an owner in the coordinator's placement"
        else:
            old = self.reports.get(report.node)
            if old is not None and old.boot == report.boot and report.seq <= old.seq:
                reason = "stale"
        if reason:
            return Reply(False, reason, committed=self.committed)
        self.reports[report.node] = report
        entry = self.entries.get(report.node)
        if entry is not None and _same_state(entry.report, report):
            entry.report = report  # the same counts: a poll
        else:
            self._update(report.node)
        if report.placement != self.digest:
            reason = "placement"
        elif report.fence < self.fences.get(report.node, 0):
            reason = "fenced"
        elif self.epoch_rev is None or report.fence > self.fences.get(report.node, 0):
            reason = "fences"
            self.want_fences = True
        hopeless = tuple(v for v in report.ask if self.hopeless(v)) if not reason else ()
        return Reply(not reason, reason, hopeless, self.committed)

    def learn_committed(self, version: Version | None, rev: int,
                        authoritative: bool = True) -> None:
        """The committed record as etcd holds it (None: absent or unreadable), and its
        mod_revision: what the next commit compares. The version known never goes back; a
        watched one (not ``authoritative``) older than what this tally wrote is ignored."""
        if not authoritative and 0 < rev < self.committed_rev:
            return  # a watch event behind this coordinator's own write
        self.committed_rev = rev
        if version is None or not self._newer(version):
            return
        self.committed = version
        for v in [v for v in self.listed if not self._newer(v)]:
            self._forget(v)

    def wrote(self, write: CommitWrite | AheadWrite, rev: int) -> None:
        """``write`` landed at revision ``rev``."""
        if isinstance(write, CommitWrite):
            self.learn_committed(write.version, rev)
            if write.placement:
                self.stored_placement = self.digest
            if write.ahead is not None:
                self.ahead = write.ahead
        else:
            self.ahead = write.version

    # -- decisions --------------------------------------------------------------------------

    def candidate(self) -> Version | None:
        """The newest version every rank lists with ``m`` copies, if newer than the commit."""
        if not self.total:
            return None
        floor = max(self.floor, max(self.floors, default=0))
        return max((v for v, n in self.have.items() if n == self.total and v[0] >= floor),
                   default=None)

    def newest(self) -> Version | None:
        """The newest version newer than the commit some rank lists with ``m`` copies."""
        return max((v for v, n in self.have.items() if n > 0), default=None)

    def hopeless(self, version: Version) -> bool:
        """Whether a usable report shows ``version`` can no longer be committed (a rank
        lists a newer version without it, or it is among its node's dead versions)."""
        return self.blocked.get(tuple(version), 0) > 0  # type: ignore[call-overload]

    def next_write(self) -> Write | None:
        """What to write now, if anything (see the module docstring)."""
        if self.epoch_rev is None or self.want_fences:
            return ReadFences()
        guards = Guards(self.term_rev, self.epoch_rev, self.committed_rev)
        newest, cand = self.newest(), self.candidate()
        if cand is not None:
            return CommitWrite(cand, guards, self.stored_placement != self.digest,
                               newest if newest is not None and newest > cand else None)
        if newest is not None and (self.ahead is None or not self._newer(self.ahead)):
            return AheadWrite(newest, guards)
        return None

    def waiting_for(self) -> list[str]:
        """The owners with no usable report (a commit waits for every one)."""
        return sorted(n for n in self.owned if n not in self.entries)


def _same_state(a: Report, b: Report) -> bool:
    """Whether two reports of one node weigh the same (they differ at most in seq and ask)."""
    return (a.placement, a.fence, a.floor, a.dead, dict(a.ranks)) == \
        (b.placement, b.fence, b.floor, b.dead, dict(b.ranks))
