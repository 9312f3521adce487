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

An acknowledged version stays in both holders' slots until it is committed, abandoned or
*withdrawn* (:meth:`CommitTracker.resolve_pending`): a rank whose two slots hold the committed
step and an acknowledged newer one skips snapshots until then, and when the commit does not
come within ``withdraw_after`` this node takes the version back from its record, behind a fence
that no commit decided from the older record can pass (:func:`~elasticd.replication.commit.withdraw`).

``lock`` guards the job states and is never held while calling etcd: the in-memory coordinator
runs watch callbacks on the writer's thread. ``_record_lock`` serialises this node's record
writes (held across the etcd call), so a withdrawal is never overwritten by an older record.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable

from elasticd.clock import Clock
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator, EventType, Watch
from elasticd.coordination.keys import Keyspace
from elasticd.replication.api import Version
from elasticd.replication.commit import (
    KEEP_SKIPPED,
    KEEP_VERSIONS,
    CommitConflict,
    Committed,
    Replicated,
    commit_step,
    committed_key,
    decode_committed,
    encode_replicated,
    read_committed,
    read_state,
    replicated_key,
    withdraw,
)
from elasticd.replication.placement import Placement

log = logging.getLogger(__name__)


@dataclasses.dataclass
class JobState:
    """One job as this node sees it (guarded by :attr:`CommitTracker.lock`).

    Attributes:
        placement, previous: the placement in force and the one before it.
        floor: lowest generation that still counts (raised by a fallback).
        committed: the commit record last seen.
        committed_at_change: the committed version when the placement last changed.
        acked: per local rank and version, the peers that acknowledged a verified copy.
        replicated: per local rank, versions with ``m`` copies, newest first.
        latest: per local rank, the newest local snapshot notified.
        gen_base: per generation, the step before its first local snapshot (for sync lag).
        withdrawn: versions taken back from this node's record; never recorded again.
        skipped: versions a local rank skipped or this node withdrew (newest first), published
            in the record: they can never be committed.
    """

    placement: Placement | None = None
    previous: Placement | None = None
    floor: int = 0
    committed: Committed | None = None
    committed_at_change: Version | None = None
    acked: dict[int, dict[Version, set[str]]] = dataclasses.field(default_factory=dict)
    replicated: dict[int, list[Version]] = dataclasses.field(default_factory=dict)
    latest: dict[int, Version] = dataclasses.field(default_factory=dict)
    gen_base: dict[int, int] = dataclasses.field(default_factory=dict)
    withdrawn: set[Version] = dataclasses.field(default_factory=set)
    skipped: list[Version] = dataclasses.field(default_factory=list)
    watch: Watch | None = None


class CommitTracker:
    """Counts copies and commits steps for one node.

    Args:
        submit: runs a function in the background (the replicator's pool).
        on_advance: called (in the background) with a job whose commit moved past the one in
            force when its placement last changed.
        withdraw_after: seconds an acknowledged version that blocks a local snapshot may wait
            for its commit before it is withdrawn (:meth:`resolve_pending`).
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace, clock: Clock,
                 submit: Callable[..., None], on_advance: Callable[[str], None],
                 commit_wait: float = 2.0,
                 on_commit: Callable[[str, Version], None] | None = None,
                 withdraw_after: float = 1.0) -> None:
        self.node_id, self.coord, self.keys, self.clock = node_id, coord, keys, clock
        self.commit_wait, self._on_commit = commit_wait, on_commit
        self.withdraw_after = withdraw_after
        self._submit, self._advance = submit, on_advance
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self._record_lock = threading.Lock()
        self.jobs: dict[str, JobState] = {}
        self.closing = False
        self.counters: collections.Counter[str] = collections.Counter()

    def _on_advance(self, job: str) -> None:
        self._submit(self._advance, job)

    def state(self, job: str) -> JobState:
        """The job's state, created if new (call with :attr:`lock` held)."""
        return self.jobs.setdefault(job, JobState())

    def view(self, job: str) -> tuple[Placement | None, Committed | None]:
        """The job's placement and commit record in force (None, None for an unknown job)."""
        with self.lock:
            st = self.jobs.get(job)
            return (st.placement, st.committed) if st else (None, None)

    def start_generation(self, job: str, generation: int) -> None:
        """Versions of generations below ``generation`` stop counting (and stop gating)."""
        with self.cond:
            st = self.state(job)
            st.floor = max(st.floor, generation)
            for rank in list(st.replicated):
                st.replicated[rank] = [v for v in st.replicated[rank] if v[0] >= st.floor]
            st.latest = {r: v for r, v in st.latest.items() if v[0] >= st.floor}
            self.cond.notify_all()

    def is_acked(self, job: str, rank: int, version: Version, peer: str) -> bool:
        """True when ``peer`` already holds ``version`` of ``rank``, or the version no longer
        counts (an abandoned generation, a forgotten job)."""
        with self.lock:
            st = self.jobs.get(job)
            return st is None or version[0] < st.floor or peer in st.acked.get(
                rank, {}).get(version, ())

    def gate(self, job: str, rank: int) -> None:
        """Waits until the rank's previous fully replicated version is committed (see the
        module doc); real time, since it is a bound on waiting, not a measurement."""
        deadline = time.monotonic() + self.commit_wait
        with self.cond:
            while not self.closing:
                st = self.jobs.get(job)
                last = (st.replicated.get(rank) or [None])[0] if st else None
                if last is None or (st.committed is not None and st.committed.version >= last):
                    return
                remaining = deadline - time.monotonic()
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
        with self._record_lock:
            with self.lock:
                st = self.jobs.get(job)
                if (st is None or st.placement is None or version in st.withdrawn
                        or version in st.replicated.get(rank, ())):
                    return
                versions = sorted({version, *st.replicated.get(rank, ())}, reverse=True)
                st.replicated[rank] = versions[:KEEP_VERSIONS]
                oldest = st.replicated[rank][-1]
                st.acked[rank] = {v: s for v, s in st.acked.get(rank, {}).items() if v >= oldest}
                mine = st.placement.ranks.get(self.node_id, ())
                # A version can commit only once all of this node's ranks have it.
                if mine and not all(version in st.replicated.get(r, ()) for r in mine):
                    return
                record = self._record(st)
            if not self._put_record(job, record, "record replicated versions"):
                return
        self.try_commit(job)

    def republish_record(self, job: str) -> None:
        """Writes this node's record again (etcd lost it with its data)."""
        with self._record_lock:
            with self.lock:
                st = self.jobs.get(job)
                if st is None or st.placement is None:
                    return
                record = self._record(st)
            self._put_record(job, record, "write its record again")

    def _put_record(self, job: str, record: Replicated, what: str) -> bool:
        """Writes this node's record (call with ``_record_lock`` held); False on an etcd error
        (counted and logged)."""
        try:
            self.coord.put(replicated_key(self.keys, job, self.node_id), encode_replicated(record))
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
            self.clock.wall(), tuple(st.skipped[:KEEP_SKIPPED]))

    def on_skipped(self, job: str, version: Version) -> None:
        """A local rank skipped the snapshot of ``version`` (a commit was pending): publishes
        it, so that a peer whose acknowledged copy of it waits for a commit withdraws that copy
        at once instead of after ``withdraw_after`` (see :meth:`resolve_pending`)."""
        version = (int(version[0]), int(version[1]))
        with self._record_lock:
            with self.lock:
                st = self.jobs.get(job)
                if st is None or st.placement is None or version in st.skipped:
                    return
                st.skipped = sorted({version, *st.skipped}, reverse=True)[:KEEP_SKIPPED]
                record = self._record(st)
            self._put_record(job, record, "record a skipped version")

    def resolve_pending(self, job: str, version: Version, since: float,
                        blocked: Callable[[], bool]) -> bool | None:
        """Follows an acknowledged, not yet committed ``version`` of this node's ranks (its
        copies stay in their slots meanwhile) until it is committed, or withdrawn from this
        node's record (see the module doc): at once when another owner's record shows it can
        no longer commit (:meth:`_hopeless`), or ``withdraw_after`` seconds (real time) after
        ``since`` when a local snapshot is ``blocked`` by it.

        Returns:
            True when the copy may be overwritten (withdrawn, abandoned or older than the
            commit); False when it must stay (committed, or etcd could not be told); None when
            it is still pending but nothing waits for its slot (the caller follows it again
            when something does).
        """
        version = (int(version[0]), int(version[1]))
        waited = False
        while True:
            with self.cond:
                st = self.jobs.get(job)
                if st is None or version[0] < st.floor:
                    return True
                if st.committed is not None and st.committed.version >= version:
                    return st.committed.version != version
                if self.closing:
                    return False
                placement = st.placement
            remaining = since + self.withdraw_after - time.monotonic()
            # Records are read only after a first wait: most versions commit within it, so
            # the common case (a step every few ms) costs no etcd read per acknowledgement.
            if waited and placement is not None and self._hopeless(job, version, placement):
                break
            if remaining <= 0:
                if blocked():
                    break
                return None
            with self.cond:
                self.cond.wait(min(remaining, 0.1))
            waited = True
        with self._record_lock:
            with self.lock:
                st = self.jobs.get(job)
                if st is None or st.placement is None:
                    return True
                st.withdrawn.add(version)
                # Published like a skipped version: a peer waiting on this step stops waiting.
                st.skipped = sorted({version, *st.skipped}, reverse=True)[:KEEP_SKIPPED]
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
                return False
        if committed is not None:
            self.learn(job, committed)
            if committed.version == version:
                return False  # committed just before the withdrawal: it is the kept copy now
        with self.lock:
            self.counters["withdrawals"] += 1
        log.info("%s: withdrew step %d (generation %d) from %s's record: not committed (other "
                 "ranks skipped it, or %.1f s passed); its slot is reused", job, version[1],
                 version[0], self.node_id, self.withdraw_after)
        return True

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
            if version in record.skipped:
                return True
            for rank in ranks:
                versions = record.versions.get(rank, ())
                newest = max((*versions, *record.skipped), default=None)
                if newest is not None and newest > version and version not in versions:
                    return True
        return False

    def try_commit(self, job: str) -> None:
        with self.lock:
            st = self.jobs.get(job)
            if st is None or st.placement is None:
                return
            placement, floor = st.placement, st.floor
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
            # A withdrawn version at or below the commit can never count again anyway.
            st.withdrawn = {v for v in st.withdrawn if v > committed.version}
            advanced = st.committed_at_change is None or committed.version > st.committed_at_change
            self.cond.notify_all()
        if self._on_commit is not None and (old is None or committed.version > old.version):
            self._on_commit(job, committed.version)
        if advanced and (old is None or committed.version > old.version):
            self._on_advance(job)

    def watch(self, job: str) -> None:
        key = committed_key(self.keys, job)
        try:
            kvs, revision = self.coord.get_prefix(key)
            for kv in kvs:
                if kv.key == key:
                    self.learn(job, decode_committed(kv.value, key))
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
        key = committed_key(self.keys, job)
        for event in events:
            if event.type is EventType.PUT and event.kv.key == key:
                try:
                    self.learn(job, decode_committed(event.kv.value, key))
                except records.RecordError as exc:
                    log.error("unreadable committed record of %s: %s", job, exc)

    def reread(self, job: str) -> None:
        try:
            committed = read_committed(self.coord, self.keys, job)
        except CoordinationError as exc:
            self.etcd_error("read the committed record", exc)
            return
        if committed is not None:
            self.learn(job, committed)

    def sync_lag(self, st: _Job) -> int:
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
