"""A node's term as its job's commit coordinator: reports in, commits out.

While this node holds the job's election key (:mod:`elasticd.replication.election`), a
:class:`JobCoordinator` takes every node's reports (:meth:`~JobCoordinator.on_report`, from the
replica server's threads or, for its own, from the tracker), weighs them in a
:class:`~elasticd.replication.tally.Tally` and carries out what the tally asks
(:meth:`~JobCoordinator.flush`): list the fences, commit (one transaction per committed step,
guarded by the election key, the fence epoch and the committed record), write the ahead
record. When a write fails its guards it reads back what they compared: the election key (not
ours any more: deposed, nothing more is written), the committed record and the epoch. It keeps
its election lease alive (:meth:`~JobCoordinator.tick`) and steps down when the lease is lost.

No thread of its own: the tracker calls :meth:`~JobCoordinator.flush` when a report may have
made a write due (through ``wake``) and :meth:`~JobCoordinator.tick` periodically; a simulator
may call both itself.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from elasticd.clock import Clock
from elasticd.coordination import records
from elasticd.coordination.api import Compare, CoordinationError, Coordinator, LeaseLost, Put
from elasticd.coordination.keys import Keyspace
from elasticd.replication.commit import (
    Committed,
    commit_of,
    commit_txn,
    decode_committed,
    encode_ahead,
)
from elasticd.replication.election import Coordinatorship, resign
from elasticd.replication.fences import read_fences
from elasticd.replication.placement import Placement
from elasticd.replication.report import Reply, Report
from elasticd.replication.tally import CommitWrite, ReadFences, Tally

log = logging.getLogger(__name__)

#: Seconds before a write that failed on an etcd error is tried again.
RETRY_AFTER = 0.25
#: Seconds without a commit, while some owner's report does not count, before the coordinator
#: says so in its log (again every this many seconds while it lasts).
SAY_WAITING = 15.0


class ElectionLease:
    """A term's election lease: kept alive every TTL/3; lost when etcd says it expired, or when
    no keep-alive got through for a whole TTL (the key may be gone already: step down)."""

    def __init__(self, coord: Coordinator, lease: int, ttl: float, now: float) -> None:
        self.coord, self.id, self.ttl, self.refreshed = coord, lease, ttl, now

    def keep(self, now: float) -> str | None:
        """Refreshes the lease when due; why the term must end, or None."""
        if now - self.refreshed < self.ttl / 3:
            return None
        try:
            self.coord.keep_alive(self.id)
            self.refreshed = now
        except LeaseLost:
            return "its election lease expired"
        except CoordinationError as exc:
            if now - self.refreshed > self.ttl:
                return f"its election lease could not be kept alive ({exc})"
        return None


class JobCoordinator:
    """This node's coordination of one job's commits, for one term.

    Args:
        ship: the election record this node wrote (term, and the key's mod_revision).
        lease, ttl: the election lease and its TTL (kept alive by :meth:`tick`).
        tally: the decisions, built with what the tracker knew when it won.
        on_commit: called (no lock held) with each committed record this term wrote.
        on_end: called (no lock held) once when the term ends (deposed, lease lost, closed).
        wake: asks for :meth:`flush` to run soon (off the caller's thread).
    """

    def __init__(self, node: str, job: str, coord: Coordinator, keys: Keyspace, clock: Clock,
                 ship: Coordinatorship, lease: int, ttl: float, tally: Tally,
                 on_commit: Callable[[Committed], None], on_end: Callable[[str], None],
                 wake: Callable[[], None]) -> None:
        self.node, self.job, self.coord, self.keys, self.clock = node, job, coord, keys, clock
        self.ship, self.tally = ship, tally
        self._on_commit, self._on_end, self._wake = on_commit, on_end, wake
        self.lock = threading.Lock()
        self._flushing = threading.Lock()
        self.ended = False
        now = clock.monotonic()
        self.since, self._retry_at = now, 0.0
        self._lease = ElectionLease(coord, lease, ttl, now)
        self.counters = {"reports": 0, "commits": 0, "ahead": 0, "fence_reads": 0,
                         "conflicts": 0, "etcd_errors": 0}
        self.last_commit_at: float | None = None
        self._said_waiting = now

    # -- inputs -------------------------------------------------------------------------------

    def on_report(self, report: Report) -> Reply:
        with self.lock:
            if self.ended:
                return Reply(False, "term ended")
            self.counters["reports"] += 1
            reply = self.tally.report(report)
            due = self.tally.next_write() is not None
        if due:
            self._wake()
        return reply

    def set_placement(self, placement: Placement) -> None:
        with self.lock:
            self.tally.set_placement(placement)
        self._wake()

    def learn_committed(self, version: Any, revision: int) -> None:
        """The committed record changed (the watch): its version and mod_revision."""
        with self.lock:
            self.tally.learn_committed(version, revision, authoritative=False)

    # -- carrying out the tally's writes ------------------------------------------------------

    def flush(self) -> None:
        """Carries out the tally's writes until none is due (one flusher at a time)."""
        if not self._flushing.acquire(blocking=False):
            return  # the running flush sees what this call would have
        try:
            for _ in range(16):
                if not self._step():
                    return
        finally:
            self._flushing.release()
        self._wake()  # still more to do: let other work in first

    def _step(self) -> bool:
        """One write; False when none is due or it cannot be made now."""
        with self.lock:
            if self.ended or self.clock.monotonic() < self._retry_at:
                return False
            write = self.tally.next_write()
            placement = self.tally.placement
        if write is None:
            return False
        try:
            if isinstance(write, ReadFences):
                epoch, fences = read_fences(self.coord, self.keys, self.job)
                with self.lock:
                    self.counters["fence_reads"] += 1
                    self.tally.take_fences(epoch, fences)
                return True
            g = write.guards
            committed: Committed | None = None
            if isinstance(write, CommitWrite):
                committed = commit_of(write.version, placement, self.node, self.clock.wall())
                compares, ops = commit_txn(self.keys, self.job, committed,
                                           (g.term, g.epoch, g.committed),
                                           placement if write.placement else None, write.ahead)
            else:
                compares = [Compare(self.keys.replication(self.job).coordinator, g.term)]
                ops = [Put(self.keys.replication(self.job).commit_ahead,
                           encode_ahead(write.version, self.clock.wall()))]
            ok, revision = self.coord.transaction(compares, ops)
            if not ok:
                with self.lock:
                    self.counters["conflicts"] += 1
                return self._refresh()
        except CoordinationError as exc:
            with self.lock:
                self.counters["etcd_errors"] += 1
                self._retry_at = self.clock.monotonic() + RETRY_AFTER
            log.warning("%s: commit coordinator %s cannot write: %s", self.job, self.node, exc)
            return False
        with self.lock:
            self.tally.wrote(write, revision)
            if committed is not None:
                self.counters["commits"] += 1
                self.last_commit_at = self.clock.monotonic()
            else:
                self.counters["ahead"] += 1
        if committed is not None:
            self._on_commit(committed)
        return True

    def _refresh(self) -> bool:
        """A write failed its guards: reads what they compared. False when deposed."""
        kv = self.coord.get(self.keys.replication(self.job).coordinator)
        if kv is None or kv.mod_revision != self.ship.revision:
            self.end("deposed: the election key is gone or another node's")
            return False
        kv = self.coord.get(self.keys.replication(self.job).committed)
        epoch = self.coord.get(self.keys.replication(self.job).fence_epoch)
        version = None
        if kv is not None:
            try:
                version = decode_committed(kv.value, kv.key).version
            except records.RecordError:
                pass  # overwritten by the next commit, which compares its revision
        with self.lock:
            self.tally.learn_committed(version, kv.mod_revision if kv is not None else 0)
            if (epoch.mod_revision if epoch is not None else 0) != self.tally.epoch_rev:
                self.tally.want_fences = True
        return True

    # -- the term's life ----------------------------------------------------------------------

    def tick(self) -> None:
        """Keeps the election lease alive (every TTL/3) and retries a due write."""
        now = self.clock.monotonic()
        if self.ended:
            return
        why = self._lease.keep(now)
        if why is not None:
            self.end(why)
            return
        with self.lock:
            due = not self.ended and self.tally.next_write() is not None
            waiting = self.tally.waiting_for()
            quiet = now - max(self.last_commit_at or self.since, self._said_waiting)
            if waiting and quiet >= SAY_WAITING:
                self._said_waiting = now
        if waiting and quiet >= SAY_WAITING:
            # Silence is a bug: a job whose commits stopped says whose report it waits for
            # (a node down, partitioned, on another placement, or on an older release).
            log.warning("%s: no commit for %.0f s: waiting for reports from %d node(s): %s",
                        self.job, now - (self.last_commit_at or self.since), len(waiting),
                        ", ".join(waiting[:5]) + (" ..." if len(waiting) > 5 else ""))
        if due:
            self.flush()

    def end(self, why: str, resign_key: bool = False) -> None:
        """Ends the term (idempotent): nothing more is written; with ``resign_key`` the
        election key is deleted and the lease revoked first, so that another node takes over
        at once."""
        with self.lock:
            if self.ended:
                return
            self.ended = True
        log.info("%s: %s stops coordinating commits (term %x): %s", self.job, self.node,
                 self.ship.term, why)
        if resign_key:
            try:
                resign(self.coord, self.keys, self.job, self.ship.revision)
                self.coord.revoke_lease(self._lease.id)
            except CoordinationError as exc:
                log.info("%s: resigning failed (%s); the lease expires instead", self.job, exc)
        self._on_end(why)

    def status(self) -> dict[str, Any]:
        """For /status: the term, the reports weighed, the owners a commit waits for."""
        with self.lock:
            t = self.tally
            waiting = t.waiting_for()
            return {
                "term": f"{self.ship.term:x}", "since_seconds":
                    round(self.clock.monotonic() - self.since, 3),
                "owners": len(t.owned), "usable_reports": len(t.entries),
                "waiting_for": waiting[:10], "waiting_for_count": len(waiting),
                "candidate": list(c) if (c := t.candidate()) else None,
                "newest": list(n) if (n := t.newest()) else None,
                "seconds_since_commit": None if self.last_commit_at is None else
                round(self.clock.monotonic() - self.last_commit_at, 3),
                **self.counters}
