"""Draining a node: hand its checkpoint replicas to others, then leave the job cleanly.

``elasticctl drain NODE`` writes a request to ``<prefix>/drain/<node>``; the daemon of NODE sees
it (each main-loop cycle reads the key) and runs the drain in a thread of its own, so the loop
keeps cycling and the watchdog keeps being fed. It writes its progress into the same record,
which the CLI polls:

1. ``snapshot``: new snapshots are refused and the one in flight is waited for (bounded), so the
   workers never stop in the middle of a copy;
2. ``replicas``: every committed step gets ``m`` copies without this node
   (:meth:`~elasticd.recovery.replicator.Replicator.drain`), copies counted as they land;
3. ``stopping``: the node stops running jobs (its workers get SIGTERM, then SIGKILL after the stop
   grace); the job goes on at the remaining nodes, or a standby takes the free slot.

The record and its states are :mod:`elasticd.cluster.drain_record` (the CLI reads and writes it
too). A failed drain (the replicas could not be handed off in time) does not take the node out:
it keeps training and snapshotting, and the record says why, so an operator may retry or stop the
daemon knowing the committed step may be under-replicated.

A daemon's SIGTERM does the same first two steps with fixed bounds (:meth:`Drainer.before_leave`)
before it stops its workers and revokes its lease.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Protocol

from elasticd.clock import Clock, SystemClock
from elasticd.cluster.drain_record import LOG_LIMIT, DrainPhase, DrainRecord, DrainState, read
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator
from elasticd.coordination.keys import Keyspace

log = logging.getLogger(__name__)


#: ``(done, failed, planned)`` copies of a hand-off, as they land (``elasticctl drain`` shows it).
Progress = Callable[[int, int, int], None]


class DrainHost(Protocol):
    """What a drain needs from its node (the daemon is one; the unit tests fake one).

    Attributes:
        replicates: whether the node replicates checkpoints; without, a drain has no replicas
            to hand off and goes from the snapshot phase to stopping.
    """

    replicates: bool

    def quiesce(self, timeout: float) -> bool:
        """Refuses new snapshots and waits at most ``timeout`` seconds for those in flight;
        True when none is left."""

    def resume(self) -> None:
        """Accepts snapshots again."""

    def handoff(self, timeout: float, progress: Progress | None) -> dict[str, dict[str, Any]]:
        """Hands this node's replicas off (as :meth:`Replicator.drain`): per job, version,
        pushed and failed (rank, target) pairs, complete."""

    def shortfall(self) -> dict[str, list[int]]:
        """Per job, the ranks of the committed step that have fewer than ``m`` copies without
        this node (as etcd says now); empty when the hand-off is complete."""

    def hold(self, reason: str | None) -> None:
        """Takes this node out of its jobs with a reason, or back in with None."""

    def job_stopped(self) -> bool:
        """True once no job of this node has processes left."""

    def record_event(self, kind: str, detail: str, data: dict[str, Any]) -> None:
        """Records a cluster event."""


class Drainer:
    """Runs this node's drains (``elasticctl drain``) and the hand-off before a clean exit.

    Args:
        stop_wait: seconds to wait for the workers to stop once held.
        read_interval: seconds between reads of the drain record (a drain starts within
            this plus one loop cycle; kept apart from the loop's pace to spare etcd).
        clock: injected time (stamps records; waits are on its monotonic clock).
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace, host: DrainHost, *,
                 stop_wait: float = 30.0, read_interval: float = 1.0,
                 clock: Clock | None = None) -> None:
        self.node_id, self.coord, self.keys, self.host = node_id, coord, keys, host
        self.stop_wait, self.read_interval = stop_wait, read_interval
        self._next_read = 0.0
        self.clock = clock or SystemClock()
        self.held = False
        #: The last seen state of this node's record ("" when none).
        self.state: DrainState | str = ""
        self._thread: threading.Thread | None = None
        self.complaints = records.Complaints(log)

    # -- main loop --------------------------------------------------------------------------

    def step(self) -> str | None:
        """One main-loop cycle: follows this node's drain record. Returns a note when
        something changed. Raises: CoordinationError (the cycle reports it)."""
        now = self.clock.monotonic()
        if now < self._next_read:
            return None
        self._next_read = now + self.read_interval
        try:
            rec = read(self.coord, self.keys, self.node_id)
        except records.RecordError as exc:
            self.complaints.warn(b"drain", str(exc).encode(), "ignoring the drain record: %s",
                                 exc)
            return None
        if self._thread is not None and self._thread.is_alive():
            return None
        self._thread = None
        if rec is None:
            self.state = ""
            if self.held:
                self.held = False
                self.host.hold(None)
                self.host.resume()
                return "undrained: may run jobs again"
            return None
        changed = rec.state != self.state
        self.state = rec.state
        if rec.state == DrainState.REQUESTED or (rec.state == DrainState.DRAINING
                                                 and not self.held):
            # "draining" with no thread here: a previous daemon died mid-drain; start over.
            self._thread = threading.Thread(target=self._run, args=(rec,),
                                            name="drain", daemon=True)
            self._thread.start()
            return f"draining (asked by {rec.by})"
        if rec.state == DrainState.DRAINED and not self.held:
            self.held = True  # e.g. after a daemon restart: stay out until undone
            self.host.hold("drained")
            return "drained: staying out of jobs until undrained"
        return f"drain {rec.state}" if changed else None

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    # -- the drain --------------------------------------------------------------------------

    def _write(self, rec: DrainRecord, **changes: Any) -> DrainRecord:
        now = self.clock.wall()
        rec = dataclasses.replace(rec, updated_at=now, **changes)
        entry = [round(now, 3), rec.state, rec.phase, rec.detail]
        if not rec.log or rec.log[-1][1:] != entry[1:]:
            rec = dataclasses.replace(rec, log=[*rec.log, entry][-LOG_LIMIT:])
        try:
            self.coord.put(self.keys.drain(self.node_id), rec.encode())
        except CoordinationError as exc:
            log.warning("could not publish drain progress: %s", exc)
        return rec

    def _run(self, rec: DrainRecord) -> None:
        started = self.clock.monotonic()
        try:
            self._drain(rec, started)
        except Exception as exc:  # noqa: BLE001 — a drain thread must report, never vanish
            log.exception("drain failed")
            self._fail(rec, f"drain failed: {exc}", started)

    def _drain(self, rec: DrainRecord, started: float) -> None:
        deadline = started + rec.timeout
        rec = self._write(rec, state=DrainState.DRAINING, phase=DrainPhase.SNAPSHOT,
                          detail="waiting for the snapshot in flight; new ones refused")
        log.info("drain requested by %s: waiting for the snapshot in flight", rec.by)
        self.host.quiesce(min(10.0, max(0.0, deadline - self.clock.monotonic())))
        jobs: dict[str, Any] = {}
        if self.host.replicates:
            rec = self._write(rec, phase=DrainPhase.REPLICAS,
                              detail="handing replicas off to peers")
            last = [0.0]

            def progress(done: int, failed: int, planned: int) -> None:
                nonlocal rec
                if self.clock.monotonic() - last[0] >= 0.2 or done + failed == planned:
                    last[0] = self.clock.monotonic()
                    rec = self._write(rec, copies_done=done, copies_failed=failed,
                                      copies_planned=planned,
                                      detail=f"handed off {done} of {planned} copies")

            done = failed = 0
            while True:
                report = self.host.handoff(max(0.0, deadline - self.clock.monotonic()),
                                           progress)
                failed = 0  # a failed copy is retried next round; only the last round's count
                for job, r in report.items():
                    jobs[job] = {"version": r["version"], "complete": r["complete"],
                                 "pushed": len(r["pushed"]), "failed": len(r["failed"])}
                    done, failed = done + len(r["pushed"]), failed + len(r["failed"])
                rec = self._write(rec, copies_done=done, copies_failed=failed,
                                  copies_planned=done + failed, jobs=jobs)
                # A step snapshotted before the pause may commit after the hand-off, with
                # this node among its holders: hand that one off too. A copy that failed (the
                # target was busy receiving, or the commit moved on under the push) is tried
                # again until the deadline rather than failing the drain at once.
                short = self.host.shortfall()
                if (not failed and not short) or self.clock.monotonic() >= deadline:
                    break
                why = (f"{failed} copies failed: trying again" if failed else
                       f"a newer step committed: handing it off too ({short})")
                rec = self._write(rec, detail=why)
                self.clock.sleep(0.2 if not failed else 0.5)
            if failed or short:
                what = (f"{failed} replica copies could not be handed off" if failed else
                        f"ranks still short of copies without this node: {short}")
                self._fail(rec, f"{what} within {rec.timeout:g} s; the node keeps running "
                           "its job", started)
                return
        rec = self._write(rec, phase=DrainPhase.STOPPING, detail="stopping this node's workers")
        self.held = True
        self.host.hold("drained")
        if not self.clock.wait(self.host.job_stopped, self.stop_wait, 0.1):
            self._fail(rec, f"workers still running {self.stop_wait:g} s after the stop",
                       started)
            return
        seconds = round(self.clock.monotonic() - started, 3)
        self._write(rec, state=DrainState.DRAINED, phase=DrainPhase.DONE,
                    detail=f"drained in {seconds:g} s: replicas handed off, workers stopped")
        self.state = DrainState.DRAINED
        self.host.record_event("drained", f"drained in {seconds:g} s (asked by {rec.by})",
                          {"seconds": seconds, "copies": rec.copies_done, "jobs": jobs})
        log.info("drained in %.1f s; staying out of jobs until undrained", seconds)

    def _fail(self, rec: DrainRecord, why: str, started: float) -> None:
        log.error("drain failed: %s", why)
        if self.held:
            self.held = False
            self.host.hold(None)
        self.host.resume()
        self._write(rec, state=DrainState.FAILED, phase=DrainPhase.DONE, detail=why)
        self.state = DrainState.FAILED
        self.host.record_event("drain_failed", why,
                          {"seconds": round(self.clock.monotonic() - started, 3)})

    # -- clean exit -------------------------------------------------------------------------

    def before_leave(self, snapshot_wait: float = 5.0) -> bool:
        """SIGTERM: lets the snapshot in flight finish (bounded) and refuses new ones, so the
        workers stop with a complete snapshot. Returns True when none was left in flight."""
        self.join(snapshot_wait)
        return self.host.quiesce(snapshot_wait)

    def handoff_before_leave(self, timeout: float = 15.0) -> dict[str, Any]:
        """SIGTERM, workers stopped: hands replicas off (bounded) so the committed step keeps
        ``m`` copies after this node is gone. Returns the report ({} without replication)."""
        if not self.host.replicates:
            return {}
        try:
            return self.host.handoff(timeout, None)
        except Exception:  # noqa: BLE001 — leaving must go on
            log.exception("handing replicas off before leaving failed")
            return {}
