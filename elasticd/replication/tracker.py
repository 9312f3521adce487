"""What this node knows about commits: per job, the placement in force, each local rank's
acknowledged and fully replicated versions, and the committed step.

A :class:`CommitTracker` turns peer acknowledgements into ``m``-copy versions, tells the job's
commit coordinator about them (its :class:`~elasticd.replication.reporter.Reporter`: a report
over the replication channel, no etcd write), and learns the commits through one watch on the
committed record's prefix (its :class:`~elasticd.replication.committed_prefix.CommittedPrefix`).
It also holds the retention gate: a rank's next push waits up to ``commit_wait`` seconds (real
time) for its previous fully replicated version's commit (why, and why it then goes ahead:
docs/replication.md, "Holders keep a shard's two newest copies").

Which copies stay in their slots is decided per job by a
:class:`~elasticd.replication.commit_state.CommitBook` (acked -> protected -> committed |
withdrawn | abandoned); the tracker feeds it the events and performs its actions on the slot
stores, under ``lock``, so that the actions of two events never interleave. An acknowledged
local version is *followed* (:mod:`~elasticd.replication.follower`) until it is decided: a
rank whose two slots hold the committed step and an acknowledged newer one skips snapshots
until then, and when the commit does not come within ``withdraw_after`` (or the coordinator
says it never will) this node withdraws it, behind a fence that no commit decided from an
earlier report can pass (:func:`~elasticd.replication.fences.withdraw`).

``lock`` guards the job states and is never held while calling etcd or a peer: the in-memory
coordinator runs watch callbacks on the writer's thread (it is held across the slot stores'
calls, which take only their own lock). ``_record_lock`` serialises this node's fence writes
(held across the etcd call), so a withdrawal is never overwritten by an older list.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any, Callable, Mapping, Sequence

from elasticd.store.shm import SlotStore
from elasticd.clock import Clock
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator
from elasticd.coordination.keys import Keyspace
from elasticd.hooks import call_hooks
from elasticd.replication.api import ReplicationError, Version
from elasticd.replication.background import Background
from elasticd.replication.commit_state import Actions, CommitBook, Holder
from elasticd.replication.committed_prefix import CommittedPrefix
from elasticd.replication.commit import (
    KEEP_SKIPPED,
    KEEP_VERSIONS,
    KEEP_WITHDRAWN,
    Committed,
    Grid,
    decode_ahead,
    relax_grid,
    widen_grid,
)
from elasticd.replication.fences import read_fence, withdraw
from elasticd.replication.placement import Placement
from elasticd.replication.report import Reply, Report, placement_digest
from elasticd.replication import follower
from elasticd.replication.reporter import Reporter

log = logging.getLogger(__name__)

#: Lease TTLs a blocking version waits past its deadline for a coordinator's answer (see
#: commit_state): a dead one is replaced within about one TTL; longer is a partition.
OUTAGE_TTLS = 3

#: Told of each newer commit of a live generation: (job, version).
Listener = Callable[[str, Version], None]


class CommitFeed:
    """The listeners of one node's commits, and the order they are told in.

    The persistent tier takes its flushes from the commits (every node learns the same ones, and
    keeps its ranks' copies of the committed step until the next commit): the node's checkpoint
    service listens here. Commits are learned on several threads (the watch, a re-read, this
    node's own write as coordinator); the order the tracker learned them in is the order they
    are told in, because :meth:`CommitFeed.claim` is called under the tracker's lock and the
    listeners run under the feed's own lock, taken there and let go by :meth:`CommitFeed.tell`,
    after the tracker's lock is released (a listener takes the service's and the slot store's
    locks, never the tracker's).
    """

    def __init__(self) -> None:
        self.listeners: list[Listener] = []
        self._order = threading.Lock()

    def claim(self, newer: bool) -> bool:
        """Call under the tracker's lock, for a commit just learned (``newer``: newer than the
        one before, of a generation not abandoned). True when :meth:`tell` must follow."""
        if not newer or not self.listeners:
            return False
        self._order.acquire()
        return True

    def tell(self, job: str, version: Version, claimed: bool) -> None:
        """Call after the tracker's lock is released, with :meth:`claim`'s answer."""
        if not claimed:
            return
        try:
            call_hooks(self.listeners, job, version, log=log,
                       failed=f"{job}: a listener of commit {version} failed")
        finally:
            self._order.release()


@dataclasses.dataclass
class JobState:
    """One job as this node sees it (guarded by :attr:`CommitTracker.lock`).

    Attributes:
        placement, previous: the placement in force and the one before it.
        digest: the placement's digest (what reports name).
        committed: the commit record last seen (its holders resolved).
        committed_rev: the committed record's mod_revision as last seen (0: absent).
        ahead_record: the ahead record's value as last seen (None: absent); :attr:`ahead`
            is its version.
        committed_at_change: the committed version when the placement last changed.
        collected: what ``on_advance`` was last handed a commit for since then: its holders'
            placement digest and overrides (None: nothing yet).
        held_here: the ranks whose replicas the placement in force gives this node.
        stray: a replica of a rank not in :attr:`held_here` landed since ``on_advance`` was
            last handed a commit.
        acked: per local rank and version, the peers that acknowledged a verified copy.
        replicated: per local rank, versions with ``m`` copies, newest first.
        latest: per local rank, the newest local snapshot notified.
        gen_base: per generation, the step before its first local snapshot (for sync lag).
        book: which copies stay, and the versions followed until decided.
        unstarted: followed versions whose follower has not started yet, each with its first
            look (it starts when it may have to act: ``follower.followers_due``).
        skipped: versions a local rank skipped or this node withdrew (newest first), published
            in the record: they can never be committed.
        withdrawn: versions this node withdrew (newest first), published apart (see
            :data:`~elasticd.replication.commit.KEEP_WITHDRAWN`).
        grid: the job's snapshot grid as last seen (:class:`~elasticd.replication.commit.Grid`).
    """

    placement: Placement | None = None
    previous: Placement | None = None
    digest: str = ""
    committed: Committed | None = None
    committed_rev: int = 0
    ahead_record: bytes | None = None
    committed_at_change: Version | None = None
    collected: tuple[str, Mapping[int, tuple[str, ...]]] | None = None
    held_here: frozenset[int] = frozenset()
    stray: bool = False
    acked: dict[int, dict[Version, set[str]]] = dataclasses.field(default_factory=dict)
    replicated: dict[int, list[Version]] = dataclasses.field(default_factory=dict)
    latest: dict[int, Version] = dataclasses.field(default_factory=dict)
    gen_base: dict[int, int] = dataclasses.field(default_factory=dict)
    book: CommitBook = dataclasses.field(default_factory=lambda: CommitBook(0.0))
    unstarted: dict[Version, float] = dataclasses.field(default_factory=dict)
    skipped: list[Version] = dataclasses.field(default_factory=list)
    withdrawn: list[Version] = dataclasses.field(default_factory=list)
    grid: Grid = dataclasses.field(default_factory=Grid)

    @property
    def ahead(self) -> Version | None:
        """The ahead record's version as last seen (None: absent or unreadable), decoded and
        checked here, when read (a new coordinator's tally), not at each watch event."""
        if self.ahead_record is None:
            return None
        try:
            return decode_ahead(self.ahead_record)
        except records.RecordError:
            return None

    def sync_lag(self) -> int:
        """Steps the newest local snapshot is ahead of the committed one."""
        if not self.latest:
            return 0
        latest = max(self.latest.values())
        c = self.committed
        if c is not None and c.generation == latest[0]:
            return max(0, latest[1] - c.step)
        if c is not None and c.generation > latest[0]:
            return 0
        return latest[1] - self.gen_base.get(latest[0], latest[1] - 1)

    def count_acks(self, me: str, ranks: Sequence[int], version: Version,
                   peer: str) -> list[int]:
        """Counts ``peer``'s copies of local ``ranks`` at ``version``; returns those of
        ``ranks`` every placement peer of node ``me`` now holds."""
        if self.placement is None:
            return []
        peers, done = set(self.placement.peers_of(me)), []
        for rank in ranks:
            acked = self.acked.setdefault(rank, {}).setdefault(version, set())
            acked.add(peer)
            if peers <= acked:
                done.append(rank)
        return done

    def record_replicated(self, rank: int, version: Version) -> bool:
        """Records that local ``rank`` has ``m`` copies of ``version``; whether it was news."""
        if (self.placement is None or not self.book.recordable(version)
                or version in self.replicated.get(rank, ())):
            return False
        versions = sorted({version, *self.replicated.get(rank, ())}, reverse=True)
        self.replicated[rank] = versions[:KEEP_VERSIONS]
        oldest = self.replicated[rank][-1]
        self.acked[rank] = {v: s for v, s in self.acked.get(rank, {}).items() if v >= oldest}
        return True

    def all_replicated(self, me: str, version: Version) -> bool:
        """Whether every local rank of node ``me`` has ``m`` copies of ``version`` (the
        report must then say so)."""
        mine = self.placement.ranks.get(me, ()) if self.placement is not None else ()
        return not mine or all(version in self.replicated.get(r, ()) for r in mine)


def apply_actions(book: CommitBook, job: str, actions: Actions,
                  stores: Mapping[Holder, SlotStore]) -> None:
    """Places, then lets go, the retentions ``actions`` asks of ``stores``, telling ``book``
    which copies were still held."""
    for r in actions.retain:
        store = stores.get(r.holder)
        held = store is not None and store.retain(job, r.rank, r.version)
        if r.rank is not None:
            book.retained(r.holder, r.rank, r.version, held)
    for r in actions.release:
        if r.holder in stores:
            stores[r.holder].release_retained(job, r.rank, r.version)


class CommitTracker:
    """Counts copies and learns commits for one node; its :attr:`reporter` reports to the
    job's coordinator (and is it, in turn).

    Args:
        background: runs the tracker's work off the caller's thread (the replicator's pool).
        on_advance: called (in the background) with a job whose commit moved past the one in
            force when its placement last changed: at the first such commit, then at a later
            one only when its holders differ or a replica of a rank the placement does not
            give this node landed since.
        withdraw_after: seconds an acknowledged version that blocks a local snapshot may wait
            for its commit before it is withdrawn (:mod:`~elasticd.replication.follower`).
        stores: the slot stores the commit book's retentions are placed in.
        send, lease_ttl, abandon: the :class:`~elasticd.replication.reporter.Reporter`'s.
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace, clock: Clock,
                 background: Background, on_advance: Callable[[str], None],
                 commit_wait: float = 2.0, withdraw_after: float = 1.0,
                 stores: Mapping[Holder, SlotStore] = {},
                 send: Callable[[str, Report], Reply] | None = None,
                 lease_ttl: float = 2.0,
                 abandon: Callable[[str], None] = lambda node: None) -> None:
        self.node_id, self.coord, self.keys, self.clock = node_id, coord, keys, clock
        self.commit_wait, self.withdraw_after, self.stores = commit_wait, withdraw_after, stores
        self.submit, self._advance = background.submit, on_advance
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self._record_lock = threading.Lock()
        self.jobs: dict[str, JobState] = {}
        self.closing = False
        self.counters: collections.Counter[str] = collections.Counter()
        self.reporter = Reporter(self, send or _nowhere, lease_ttl, background.submit,
                                 lambda job: self.prefix.reread(job), abandon)
        self.commits = CommitFeed()
        #: The job's committed prefix in etcd, as this node follows it.
        self.prefix = CommittedPrefix(coord, keys, self.lock, self.jobs, self.reporter,
                                      self.learn, background.submit, self.etcd_error)

    def state(self, job: str) -> JobState:
        """The job's state, created if new (call with :attr:`lock` held)."""
        st = self.jobs.get(job)
        if st is None:
            st = self.jobs[job] = JobState(book=CommitBook(
                self.withdraw_after, OUTAGE_TTLS * self.reporter.ttl))
        return st

    def _perform(self, job: str, actions: Actions, at_once: bool = False) -> None:
        """Performs the commit book's actions (call with :attr:`lock` held, so that two
        events' actions never interleave); a version to follow is followed from when it may
        have to act (``at_once``: a blocking one), see :mod:`~elasticd.replication.follower`.
        """
        st = self.state(job)
        apply_actions(st.book, job, actions, self.stores)
        if actions.follow is None:
            return
        if at_once:
            follower.start(self, job, actions.follow)
            return
        # A tick by its first look starts it in time (it then waits for the look): the ticker
        # is woken only when its next tick comes later, not at every acknowledgement.
        st.unstarted[actions.follow] = look = st.book.ask_at(actions.follow, follower.ASK_LEAD)
        self.reporter.tick_by(look)

    def on_landed(self, job: str, rank: int, version: Version,
                  holder: Holder = Holder.LOCAL) -> None:
        """A copy that may be committed is here (a local snapshot a peer acknowledged, the
        only copy with ``m = 1``, or a peer's replica): it stays until its version is decided.
        Call it before the copy is counted anywhere, while it is sure to be held."""
        v, now = (int(version[0]), int(version[1])), self.clock.monotonic()
        with self.lock:
            st = self.state(job)
            if holder is Holder.REPLICA and rank not in st.held_here:
                st.stray = True  # the next commit's on_advance may free it
            self._perform(job, st.book.landed_ranks(holder, (rank,), v, now))

    def on_superseded(self, job: str, rank: int, version: Version) -> None:
        """A newer replica of ``rank`` arrived while ``version`` still held its slot."""
        with self.lock:
            self._perform(job, self.state(job).book.superseded(Holder.REPLICA, rank,
                                                               tuple(version)))

    def held_back(self, job: str, rank: int, version: Version) -> bool:
        """Whether ``version`` of local ``rank`` must not go to a peer yet: an older version
        of it is undecided here (see :meth:`CommitBook.holding_back`). That version is then
        followed as one that blocks a snapshot: committed, or withdrawn on time."""
        v, now = (int(version[0]), int(version[1])), self.clock.monotonic()
        with self.lock:
            st = self.jobs.get(job)
            older = st.book.holding_back(rank, v) if st is not None else None
            if older is None:
                return False
            # Followed at once when not followed (its deadline may be past); one whose follower
            # waits to start keeps its first look, as a running follower would.
            self._perform(job, st.book.blocked(older, now), at_once=True)
            return True

    def on_blocked(self, job: str, version: Version) -> None:
        """A local snapshot was skipped: ``version`` holds the slot it needs."""
        v, now = (int(version[0]), int(version[1])), self.clock.monotonic()
        with self.lock:
            self._perform(job, self.state(job).book.blocked(v, now), at_once=True)

    def _grid_write(self, what: str, write: Callable[[], Any]) -> None:
        try:
            write()
        except (CoordinationError, records.RecordError) as exc:
            self.etcd_error(what, exc)

    def view(self, job: str) -> tuple[Placement | None, Committed | None]:
        """The job's placement and commit record in force (None, None for an unknown job)."""
        with self.lock:
            st = self.jobs.get(job)
            return (st.placement, st.committed) if st else (None, None)

    def set_placement(self, job: str, placement: Placement) -> tuple[Placement | None, bool]:
        """Adopts ``placement`` for ``job``; returns (the previous one, whether the job's
        commit watch must start)."""
        with self.lock:
            st = self.state(job)
            old = st.placement
            st.previous, st.placement = old, placement
            st.digest = placement_digest(placement)
            st.committed_at_change = st.committed.version if st.committed else None
            st.collected = None
            st.held_here = frozenset(r for o in placement.held_by(self.node_id)
                                     for r in placement.ranks.get(o, ()))
            need_watch = job not in self.prefix.watches
        self.reporter.placement_changed(job)
        return old, need_watch

    def start_generation(self, job: str, generation: int, unsure: bool = False) -> None:
        """Versions of generations below ``generation`` stop counting (and stop gating); the
        commit stays (``unsure``: the committed record could not be read first, see
        :meth:`CommitBook.abandon_below`)."""
        with self.cond:
            st = self.state(job)
            self._perform(job, st.book.abandon_below(generation, unsure))
            for rank in list(st.replicated):
                st.replicated[rank] = [v for v in st.replicated[rank] if v[0] >= st.book.floor]
            st.latest = {r: v for r, v in st.latest.items() if v[0] >= st.book.floor}
            self.cond.notify_all()
        self.reporter.changed(job)

    def is_acked(self, job: str, rank: int, version: Version, peer: str) -> bool:
        """True when ``peer`` already holds ``version`` of ``rank``, or the version no longer
        counts (an abandoned generation, a forgotten job)."""
        with self.lock:
            st = self.jobs.get(job)
            return st is None or version[0] < st.book.floor or peer in st.acked.get(
                rank, {}).get(version, ())

    def gate(self, job: str, rank: int) -> None:
        """Waits until the rank's previous fully replicated version is committed (see the
        module doc)."""
        deadline = self.clock.monotonic() + self.commit_wait
        with self.cond:
            while not self.closing:
                st = self.jobs.get(job)
                last = (st.replicated.get(rank) or [None])[0] if st else None
                if last is None or (st.committed is not None and st.committed.version >= last):
                    return
                remaining = deadline - self.clock.monotonic()
                if remaining <= 0:
                    self.counters["gate_timeouts"] += 1  # under the lock already
                    return
                self.cond.wait(remaining)

    def on_pushed(self, job: str, version: Version, ranks: Sequence[int], peer: str) -> None:
        """``peer`` acknowledged its copies of local ``ranks`` at ``version``: each copy here
        is landed (:meth:`on_landed`, call it while the copies are sure to be held) and
        ``peer``'s counted, under one hold of the lock for all of them (per-rank calls took it
        three times a rank), and the report is asked for once. The
        commit book hears of the landings in one event and its actions are performed once
        (one call per node per version, not one per rank: every node, every step)."""
        v, now = (int(version[0]), int(version[1])), self.clock.monotonic()
        news = False
        with self.lock:
            st = self.state(job)
            self._perform(job, st.book.landed_ranks(Holder.LOCAL, ranks, v, now))
            for rank in st.count_acks(self.node_id, ranks, v, peer):
                news = st.record_replicated(rank, v) or news
            complete = news and st.all_replicated(self.node_id, v)
        if complete:
            self.reporter.changed(job)

    def on_replicated(self, job: str, rank: int, version: Version) -> None:
        """``rank`` has ``m`` copies of ``version``: reported to the coordinator once every
        local rank has it (a version can commit only then)."""
        with self.lock:
            st = self.jobs.get(job)
            if st is None or not (st.record_replicated(rank, version)
                                  and st.all_replicated(self.node_id, version)):
                return
        self.reporter.changed(job)

    def republish(self, job: str) -> None:
        """etcd lost its data: this node's fence is written again and its report resent."""
        with self.lock:
            st = self.jobs.get(job)
            withdrawn = list(st.withdrawn) if st is not None else []
        self.reporter.republish(job, withdrawn)

    def on_skipped(self, job: str, version: Version) -> None:
        """A local rank skipped the snapshot of ``version`` (a commit was pending): reported,
        so that a peer whose acknowledged copy of it waits for a commit withdraws that copy at
        once instead of after ``withdraw_after`` (see :mod:`~elasticd.replication.follower`)."""
        version = (int(version[0]), int(version[1]))
        with self.lock:
            st = self.jobs.get(job)
            if st is None or version in st.skipped:
                return
            st.skipped = sorted({version, *st.skipped}, reverse=True)[:KEEP_SKIPPED]
        self.reporter.changed(job)

    def withdraw(self, job: str, version: Version) -> None:
        """Takes ``version`` back from this node's record, behind its fence (the follower's
        verdict)."""
        with self._record_lock:
            with self.lock:
                st = self.jobs.get(job)
                if st is None:
                    return
                st.book.withdrawing(version)
                if st.placement is None:
                    self._perform(job, st.book.withdrawn_landed(version))
                    return
                # Reported like a skipped version: a peer waiting on this step stops waiting.
                st.skipped = sorted({version, *st.skipped}, reverse=True)[:KEEP_SKIPPED]
                st.withdrawn = sorted({version, *st.withdrawn}, reverse=True)[:KEEP_WITHDRAWN]
                for r in st.replicated:
                    st.replicated[r] = [v for v in st.replicated[r] if v != version]
                withdrawn, placements = list(st.withdrawn), (st.placement, st.previous)
            try:
                fence, committed = withdraw(self.coord, self.keys, job, self.node_id,
                                            withdrawn, self.clock.wall(), placements)
            except (CoordinationError, records.RecordError) as exc:
                # Whether the withdrawal landed is unknown: the copy stays (a later skip asks
                # again; withdrawing twice is harmless), and the fence is read again before
                # the next report.
                self.etcd_error("withdraw an uncommitted version", exc)
                with self.lock:
                    st.book.withdraw_failed(version, self.clock.monotonic())
                self.reporter.fence_written(job, None)
                return
        self.reporter.fence_written(job, fence)
        if committed is not None:
            self.learn(job, committed)
            if committed.version == version:
                return  # committed just before the withdrawal: it is the kept copy now
        with self.lock:
            self._perform(job, st.book.withdrawn_landed(version))
            self.counters["withdrawals"] += 1
        self._grid_write("widen the snapshot grid",
                         lambda: widen_grid(self.coord, self.keys, job, version))
        log.info("%s: withdrew step %d (generation %d) from %s's report: not committed (other "
                 "ranks skipped it, or %.1f s passed); its slot is reused", job, version[1],
                 version[0], self.node_id, self.withdraw_after)

    def learn(self, job: str, committed: Committed, by_me: bool = False) -> None:
        """A commit record (its holders resolved) was learned: from the watch, a read, or
        this node's own write as coordinator (``by_me``)."""
        with self.cond:
            st = self.jobs.get(job)
            if st is None:
                return
            old = st.committed
            if old is not None and (committed.version < old.version or committed == old):
                return
            st.committed = committed
            # This node's slots keep the committed copy over newer uncommitted ones, so a
            # stalled commit (a paused or draining peer) cannot evict it.
            self._perform(job, st.book.commit(committed.version))
            advanced = st.committed_at_change is None or committed.version > st.committed_at_change
            self.cond.notify_all()
            if by_me:
                self.counters["commits"] += 1
            newer = old is None or committed.version > old.version
            told = self.commits.claim(newer and committed.version[0] >= st.book.floor)
            # What on_advance reads (the placement, the commit's holders, the replicas here)
            # changed since it was last handed a commit: not at every commit, every node, when
            # nothing did. A record listing every holder (schema 1) is handed every time.
            holders = (committed.placement, committed.overrides) if committed.placement else None
            collect = advanced and newer and (holders is None or holders != st.collected
                                              or st.stray)
            if collect:
                st.collected, st.stray = holders, False
        self.commits.tell(job, committed.version, told)
        if collect:
            self.submit(self._advance, job)
        # Halved by the coordinator alone, when due: not read per commit, nor by every node.
        if newer and st.grid.relaxed(committed.version) is not None and (
                by_me or self.reporter.leading(job)):
            self.submit(self._grid_write, "relax the snapshot grid",
                        lambda: relax_grid(self.coord, self.keys, job, committed.version))

    def never_committed(self, job: str, rank: int, versions: list[Version]) -> set[Version]:
        """Those of ``versions`` the fence record of ``rank``'s owner (in the placement in
        force) lists as withdrawn: the owner writes it before it reuses the slot. No other
        node's record counts (a stale or hostile one must not make this node let go of a
        copy), and none when etcd cannot say: the caller then keeps every copy."""
        with self.lock:
            placement = self.state(job).placement
        owner = next((n for n, ranks in placement.ranks.items() if rank in ranks),
                     None) if placement is not None else None
        if owner is None:
            return set()
        try:
            withdrawn = set(read_fence(self.coord, self.keys, job, owner)[1])
        except CoordinationError as exc:
            self.etcd_error("read a fence record", exc)
            return set()
        return {v for v in versions if tuple(v) in withdrawn}

    def etcd_error(self, what: str, exc: Exception) -> None:
        with self.lock:
            self.counters["etcd_errors"] += 1
        log.warning("replicator %s: cannot %s: %s", self.node_id, what, exc)

    def forget(self, job: str) -> None:
        """The job ended here: its state, watch and coordination go (the state first, so
        that the watch event of the term's resignation finds no job to campaign for)."""
        with self.lock:
            self.jobs.pop(job, None)
        self.prefix.forget(job)
        self.reporter.forget(job)

    def close(self, resign: bool = True) -> None:
        """Wakes every gate, ends this node's coordination (see :meth:`Reporter.close`) and
        cancels the watches."""
        self.reporter.close(resign)
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.prefix.close()


def _nowhere(node: str, report: Report) -> Reply:
    raise ReplicationError(f"no channel to send commit reports to {node}")
