"""What this node knows about commits: per job, the placement in force, each local rank's
acknowledged and fully replicated versions, and the committed step.

A :class:`CommitTracker` turns peer acknowledgements into ``m``-copy versions, records them in
etcd (one record per node, :mod:`elasticd.replication.commit`), commits when every rank of the
job has a common version, and learns commits made by other nodes through a watch on the commit
record. It also holds the retention gate: a rank's next push waits (up to ``commit_wait``
seconds, real time) until its previous fully replicated version is committed, because a holder
keeps only a shard's two newest copies and a third push would evict the committed one; after
the wait it goes ahead and the wait is counted, since nodes that replicated different steps
would otherwise wait for each other forever.

Which copies stay in their slots is decided per job by a
:class:`~elasticd.replication.commit_state.CommitBook` (acked -> protected -> committed |
withdrawn | abandoned); the tracker feeds it the events and performs its actions on the slot
stores, under ``lock``, so that the actions of two events never interleave. An acknowledged
local version is *followed* (:meth:`CommitTracker._follow`) until it is decided: a rank whose two
slots hold the committed step and an acknowledged newer one skips snapshots until then, and
when the commit does not come within ``withdraw_after`` this node takes the version back from
its record, behind a fence that no commit decided from the older record can pass
(:func:`~elasticd.replication.commit.withdraw`).

``lock`` guards the job states and is never held while calling etcd: the in-memory coordinator
runs watch callbacks on the writer's thread (it is held across the slot stores' calls, which
take only their own lock). ``_record_lock`` serialises this node's record writes (held across
the etcd call), so a withdrawal is never overwritten by an older record.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Mapping

from elasticd.store.shm import SlotStore
from elasticd.clock import Clock
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator, EventType, Watch
from elasticd.coordination.keys import Keyspace
from elasticd.replication.api import Version
from elasticd.replication.background import Background
from elasticd.replication.commit_state import Actions, CommitBook, Holder, Verdict
from elasticd.replication.commit import (
    KEEP_SKIPPED,
    Grid,
    decode_grid,
    relax_grid,
    widen_grid,
    KEEP_WITHDRAWN,
    KEEP_VERSIONS,
    CommitConflict,
    Committed,
    Replicated,
    commit_step,
    complaints,
    decode_committed,
    encode_replicated,
    read_committed,
    read_state,
    withdraw,
)
from elasticd.replication.placement import Placement

log = logging.getLogger(__name__)


@dataclasses.dataclass
class JobState:
    """One job as this node sees it (guarded by :attr:`CommitTracker.lock`).

    Attributes:
        placement, previous: the placement in force and the one before it.
        committed: the commit record last seen.
        committed_at_change: the committed version when the placement last changed.
        acked: per local rank and version, the peers that acknowledged a verified copy.
        replicated: per local rank, versions with ``m`` copies, newest first.
        latest: per local rank, the newest local snapshot notified.
        gen_base: per generation, the step before its first local snapshot (for sync lag).
        book: which copies stay, and the versions followed until decided.
        skipped: versions a local rank skipped or this node withdrew (newest first), published
            in the record: they can never be committed.
        withdrawn: versions this node withdrew (newest first), published apart (see
            :data:`~elasticd.replication.commit.KEEP_WITHDRAWN`).
        grid: the job's snapshot grid as last seen (:class:`~elasticd.replication.commit.Grid`).
    """

    placement: Placement | None = None
    previous: Placement | None = None
    committed: Committed | None = None
    committed_at_change: Version | None = None
    acked: dict[int, dict[Version, set[str]]] = dataclasses.field(default_factory=dict)
    replicated: dict[int, list[Version]] = dataclasses.field(default_factory=dict)
    latest: dict[int, Version] = dataclasses.field(default_factory=dict)
    gen_base: dict[int, int] = dataclasses.field(default_factory=dict)
    book: CommitBook = dataclasses.field(default_factory=lambda: CommitBook(0.0))
    skipped: list[Version] = dataclasses.field(default_factory=list)
    withdrawn: list[Version] = dataclasses.field(default_factory=list)
    grid: Grid = dataclasses.field(default_factory=Grid)
    watch: Watch | None = None


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
    """Counts copies and commits steps for one node.

    Args:
        background: runs the tracker's work off the caller's thread (the replicator's pool).
        on_advance: called (in the background) with a job whose commit moved past the one in
            force when its placement last changed.
        withdraw_after: seconds an acknowledged version that blocks a local snapshot may wait
            for its commit before it is withdrawn (:meth:`_follow`).
        stores: the slot stores the commit book's retentions are placed in.
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace, clock: Clock,
                 background: Background, on_advance: Callable[[str], None],
                 commit_wait: float = 2.0, withdraw_after: float = 1.0,
                 stores: Mapping[Holder, SlotStore] = {}) -> None:
        self.node_id, self.coord, self.keys, self.clock = node_id, coord, keys, clock
        self.commit_wait, self.withdraw_after, self.stores = commit_wait, withdraw_after, stores
        self._submit, self._advance = background.submit, on_advance
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self._record_lock = threading.Lock()
        self.jobs: dict[str, JobState] = {}
        self.closing = False
        self.counters: collections.Counter[str] = collections.Counter()

    def state(self, job: str) -> JobState:
        """The job's state, created if new (call with :attr:`lock` held)."""
        st = self.jobs.get(job)
        if st is None:
            st = self.jobs[job] = JobState(book=CommitBook(self.withdraw_after))
        return st

    def _perform(self, job: str, actions: Actions) -> None:
        """Performs the commit book's actions (call with :attr:`lock` held, so that two
        events' actions never interleave), and starts a follower."""
        apply_actions(self.state(job).book, job, actions, self.stores)
        if actions.follow is not None:
            # Not counted by wait_idle: a version waiting for a commit that may never come is
            # not work in progress.
            self._submit(self._follow, job, actions.follow, track=False)

    def _event(self, job: str, event: Callable[[CommitBook], Actions]) -> None:
        """Feeds an event to the job's commit book and performs its actions."""
        with self.lock:
            self._perform(job, event(self.state(job).book))

    def on_landed(self, job: str, rank: int, version: Version,
                  holder: Holder = Holder.LOCAL) -> None:
        """A copy that may be committed is here (a local snapshot a peer acknowledged, the
        only copy with ``m = 1``, or a peer's replica): it stays until its version is decided.
        Call it before the copy is counted anywhere, while it is sure to be held."""
        v, now = (int(version[0]), int(version[1])), self.clock.monotonic()
        self._event(job, lambda book: book.landed(holder, rank, v, now))

    def on_superseded(self, job: str, rank: int, version: Version) -> None:
        """A newer replica of ``rank`` arrived while ``version`` still held its slot."""
        self._event(job, lambda book: book.superseded(Holder.REPLICA, rank, tuple(version)))

    def on_blocked(self, job: str, version: Version) -> None:
        """A local snapshot was skipped: ``version`` holds the slot it needs."""
        v, now = (int(version[0]), int(version[1])), self.clock.monotonic()
        self._event(job, lambda book: book.blocked(v, now))

    def grid(self, job: str) -> int:
        """Local snapshots of ``job`` are taken only at multiples of this step count (the
        job's :class:`~elasticd.replication.commit.Grid`, followed by the commit watch)."""
        with self.lock:
            st = self.jobs.get(job)
            return st.grid.grid if st is not None else 1

    def _learn_grid(self, job: str, kv: Any) -> None:
        try:
            grid = decode_grid(kv.value, kv.key) if kv is not None else Grid()
        except records.RecordError as exc:
            complaints.warn(kv.key, kv.value, "unreadable grid record of %s: %s", job, exc)
            return
        with self.lock:
            st = self.jobs.get(job)
            if st is None or st.grid == grid:
                return
            old, st.grid = st.grid, grid
        log.info("%s: snapshot grid %d -> %d steps (%s)", job, old.grid, grid.grid,
                 "nodes snapshotted different steps" if grid.grid > old.grid
                 else "commits kept up")

    def _grid_write(self, what: str, write: Callable[[], Any]) -> None:
        try:
            write()
        except (CoordinationError, records.RecordError) as exc:
            self.etcd_error(what, exc)

    def awaiting_commit(self, job: str) -> list[Version]:
        """Acknowledged versions of local ranks followed until committed or withdrawn."""
        with self.lock:
            st = self.jobs.get(job)
            return st.book.awaiting() if st else []

    def view(self, job: str) -> tuple[Placement | None, Committed | None]:
        """The job's placement and commit record in force (None, None for an unknown job)."""
        with self.lock:
            st = self.jobs.get(job)
            return (st.placement, st.committed) if st else (None, None)

    def start_generation(self, job: str, generation: int) -> None:
        """Versions of generations below ``generation`` stop counting (and stop gating)."""
        with self.cond:
            st = self.state(job)
            self._perform(job, st.book.abandon_below(generation))
            for rank in list(st.replicated):
                st.replicated[rank] = [v for v in st.replicated[rank] if v[0] >= st.book.floor]
            st.latest = {r: v for r, v in st.latest.items() if v[0] >= st.book.floor}
            self.cond.notify_all()

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

    def on_ack(self, job: str, rank: int, version: Version, peer: str) -> None:
        with self.lock:
            st = self.jobs.get(job)
            if st is None or st.placement is None:
                return
            acked = st.acked.setdefault(rank, {}).setdefault(version, set())
            acked.add(peer)
            if not set(st.placement.peers_of(self.node_id)) <= acked:
                return
        self.on_replicated(job, rank, version)

    def on_replicated(self, job: str, rank: int, version: Version) -> None:
        """``rank`` has ``m`` copies of ``version``: record it, and commit if every rank has."""

        def add(st: JobState) -> bool:
            if not st.book.recordable(version) or version in st.replicated.get(rank, ()):
                return False
            versions = sorted({version, *st.replicated.get(rank, ())}, reverse=True)
            st.replicated[rank] = versions[:KEEP_VERSIONS]
            oldest = st.replicated[rank][-1]
            st.acked[rank] = {v: s for v, s in st.acked.get(rank, {}).items() if v >= oldest}
            mine = st.placement.ranks.get(self.node_id, ())  # type: ignore[union-attr]
            # A version can commit only once all of this node's ranks have it.
            return not mine or all(version in st.replicated.get(r, ()) for r in mine)

        if self._write_record(job, "record replicated versions", add):
            self.try_commit(job)

    def republish_record(self, job: str) -> None:
        """Writes this node's record again (etcd lost it with its data)."""
        self._write_record(job, "write its record again")

    def _write_record(self, job: str, what: str,
                      change: Callable[[JobState], bool] = lambda st: True) -> bool:
        """Applies ``change`` to the job's state (with a placement) and, unless it says False,
        writes this node's record, serialised with every other record write. False when
        nothing was written (an etcd error is counted and logged)."""
        with self._record_lock:
            with self.lock:
                st = self.jobs.get(job)
                if st is None or st.placement is None or not change(st):
                    return False
                record = self._record(st)
            try:
                self.coord.put(self.keys.job_replicated(job, self.node_id),
                               encode_replicated(record))
            except CoordinationError as exc:
                self.etcd_error(what, exc)
                return False
            return True

    def _record(self, st: JobState) -> Replicated:
        """This node's record as the job state says (call with :attr:`lock` held)."""
        assert st.placement is not None
        mine = st.placement.ranks.get(self.node_id, ())
        return Replicated(
            self.node_id, st.placement.round,
            {r: tuple(st.replicated[r]) for r in (mine or st.replicated) if r in st.replicated},
            {r: st.placement.holders[self.node_id] for r in (mine or st.replicated)},
            self.clock.wall(), tuple(st.skipped[:KEEP_SKIPPED]),
            tuple(st.withdrawn[:KEEP_WITHDRAWN]))

    def on_skipped(self, job: str, version: Version) -> None:
        """A local rank skipped the snapshot of ``version`` (a commit was pending): publishes
        it, so that a peer whose acknowledged copy of it waits for a commit withdraws that copy
        at once instead of after ``withdraw_after`` (see :meth:`_follow`)."""
        version = (int(version[0]), int(version[1]))

        def add(st: JobState) -> bool:
            if version in st.skipped:
                return False
            st.skipped = sorted({version, *st.skipped}, reverse=True)[:KEEP_SKIPPED]
            return True

        self._write_record(job, "record a skipped version", add)

    def _follow(self, job: str, version: Version) -> None:
        """Follows an acknowledged, not yet committed local ``version`` (its copies stay in
        their slots meanwhile) until the commit book decides it: committed, abandoned, or to be
        withdrawn from this node's record (see the module doc) at once when another owner's
        record shows it can no longer commit (:meth:`_hopeless`), or ``withdraw_after`` after
        its first acknowledgement when a local snapshot is blocked by it. Started at the first
        acknowledgement rather than when a snapshot is blocked, so that a version a peer
        skipped is withdrawn before this node's next step (see :meth:`_hopeless`)."""
        hopeless = False
        while True:
            with self.cond:
                st = self.jobs.get(job)
                if st is None or self.closing:
                    return
                verdict = st.book.verdict(version, self.clock.monotonic(), hopeless)
                if verdict is not Verdict.WAIT:
                    break
                placement = st.placement
                self.cond.wait(min(st.book.deadline(version) - self.clock.monotonic(), 0.1))
            # Records are read only after a first wait: most versions commit within it, so
            # the common case (a step every few ms) costs no etcd read per acknowledgement.
            hopeless = placement is not None and self._hopeless(job, version, placement)
        if verdict is Verdict.WITHDRAW:
            self._withdraw(job, version)

    def _withdraw(self, job: str, version: Version) -> None:
        with self._record_lock:
            with self.lock:
                st = self.jobs.get(job)
                if st is None:
                    return
                st.book.withdrawing(version)
                if st.placement is None:
                    self._perform(job, st.book.withdrawn_landed(version))
                    return
                # Published like a skipped version: a peer waiting on this step stops waiting.
                st.skipped = sorted({version, *st.skipped}, reverse=True)[:KEEP_SKIPPED]
                st.withdrawn = sorted({version, *st.withdrawn}, reverse=True)[:KEEP_WITHDRAWN]
                for r in st.replicated:
                    st.replicated[r] = [v for v in st.replicated[r] if v != version]
                record = self._record(st)
            try:
                committed = withdraw(self.coord, self.keys, job, record, [version],
                                     self.clock.wall())
            except (CoordinationError, records.RecordError) as exc:
                # Whether the withdrawal landed is unknown: the copy stays (a later skip asks
                # again; withdrawing twice is harmless).
                self.etcd_error("withdraw an uncommitted version", exc)
                with self.lock:
                    st.book.withdraw_failed(version, self.clock.monotonic())
                return
        if committed is not None:
            self.learn(job, committed)
            if committed.version == version:
                return  # committed just before the withdrawal: it is the kept copy now
        with self.lock:
            self._perform(job, st.book.withdrawn_landed(version))
            self.counters["withdrawals"] += 1
        self._grid_write("widen the snapshot grid",
                         lambda: widen_grid(self.coord, self.keys, job, version))
        log.info("%s: withdrew step %d (generation %d) from %s's record: not committed (other "
                 "ranks skipped it, or %.1f s passed); its slot is reused", job, version[1],
                 version[0], self.node_id, self.withdraw_after)

    def _hopeless(self, job: str, version: Version, placement: Placement) -> bool:
        """Whether another owner's record shows ``version`` can no longer be committed: one
        of its ranks skipped it (or the owner withdrew it), or it lists a newer version, or
        skipped or withdrew one, without having this one. Waiting for the
        commit is then pointless, and withdrawing at once lets the nodes realign: two nodes
        each waiting on a step the other skipped would otherwise take turns skipping steps."""
        try:
            progress = read_state(self.coord, self.keys, job).progress
        except (CoordinationError, records.RecordError):
            return False
        for owner, ranks in placement.ranks.items():
            record = progress.get(owner)
            if owner == self.node_id or record is None:
                continue
            dead = record.never_committed()
            if version in dead:
                return True
            for rank in ranks:
                versions = record.versions.get(rank, ())
                newest = max((*versions, *dead), default=None)
                if newest is not None and newest > version and version not in versions:
                    return True
        return False

    def try_commit(self, job: str) -> None:
        with self.lock:
            st = self.jobs.get(job)
            if st is None or st.placement is None:
                return
            placement, floor = st.placement, st.book.floor
        try:
            written, current = commit_step(self.coord, self.keys, job, placement, floor=floor,
                                           now=self.clock.wall())
        except (CoordinationError, CommitConflict) as exc:
            self.etcd_error("record the commit", exc)
            return
        if current is None:
            return
        if written:
            self.counters["commits"] += 1
            log.info("%s: committed step %d (generation %d), %d ranks with %d copies each", job,
                     current.step, current.generation, len(current.ranks), current.m)
        self.learn(job, current)

    def learn(self, job: str, committed: Committed) -> None:
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
        if advanced and (old is None or committed.version > old.version):
            self._submit(self._advance, job)
        # Read and written only when the grid this node follows is due to halve: not once per
        # commit (commits come every few steps on a fast job).
        if (old is None or committed.version > old.version) and \
                st.grid.relaxed(committed.version) is not None:
            self._submit(self._grid_write, "relax the snapshot grid",
                         lambda: relax_grid(self.coord, self.keys, job, committed.version))

    def watch(self, job: str) -> None:
        key = self.keys.job_committed(job)
        try:
            kvs, revision = self.coord.get_prefix(key)
            for kv in kvs:
                if kv.key == key:
                    self.learn(job, decode_committed(kv.value, key))
                elif kv.key == self.keys.job_commit_grid(job):
                    self._learn_grid(job, kv)
            watch = self.coord.watch_prefix(key, functools.partial(self._on_watch, job),
                                            revision + 1)
        except (CoordinationError, records.RecordError) as exc:
            self.etcd_error("watch the committed record", exc)
            return
        with self.lock:
            st = self.jobs.get(job)
            if st is not None and st.watch is None and not self.closing:
                st.watch, watch = watch, None
        if watch is not None:
            watch.cancel()

    def _on_watch(self, job: str, events: Any) -> None:
        if isinstance(events, CoordinationError):
            self._submit(self.reread, job)  # events may have been missed: read it again
            return
        key = self.keys.job_committed(job)
        for event in events:
            if event.kv.key == self.keys.job_commit_grid(job):
                self._learn_grid(job, event.kv if event.type is EventType.PUT else None)
            elif event.type is EventType.PUT and event.kv.key == key:
                try:
                    self.learn(job, decode_committed(event.kv.value, key))
                except records.RecordError as exc:
                    complaints.warn(event.kv.key, event.kv.value,
                                         "unreadable committed record of %s: %s", job, exc)

    def never_committed(self, job: str, rank: int, versions: list[Version]) -> set[Version]:
        """Those of ``versions`` the record of ``rank``'s owner (in the placement in force)
        lists as skipped or withdrawn: the owner publishes a withdrawal with its fence, before
        it reuses the slot. No other node's record counts (a stale or hostile one must not
        make this node let go of a copy), and none when etcd cannot say: the caller then keeps
        every copy."""
        with self.lock:
            placement = self.state(job).placement
        owner = next((n for n, ranks in placement.ranks.items() if rank in ranks),
                     None) if placement is not None else None
        if owner is None:
            return set()
        try:
            record = read_state(self.coord, self.keys, job).progress.get(owner)
        except (CoordinationError, records.RecordError) as exc:
            self.etcd_error("read the replicated records", exc)
            return set()
        dead = record.never_committed() if record is not None else set()
        return {v for v in versions if tuple(v) in dead}

    def reread(self, job: str) -> None:
        try:
            committed = read_committed(self.coord, self.keys, job)
        except CoordinationError as exc:
            self.etcd_error("read the committed record", exc)
            return
        if committed is not None:
            self.learn(job, committed)

    def sync_lag(self, st: JobState) -> int:
        if not st.latest:
            return 0
        latest = max(st.latest.values())
        c = st.committed
        if c is not None and c.generation == latest[0]:
            return max(0, latest[1] - c.step)
        if c is not None and c.generation > latest[0]:
            return 0
        return latest[1] - st.gen_base.get(latest[0], latest[1] - 1)

    def etcd_error(self, what: str, exc: Exception) -> None:
        with self.lock:
            self.counters["etcd_errors"] += 1
        log.warning("replicator %s: cannot %s: %s", self.node_id, what, exc)

    def close(self) -> None:
        """Wakes every gate and cancels the watches."""
        with self.cond:
            self.closing = True
            watches = [st.watch for st in self.jobs.values() if st.watch is not None]
            self.cond.notify_all()
        for watch in watches:
            watch.cancel()
