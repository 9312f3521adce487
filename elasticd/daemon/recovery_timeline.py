"""Writing each recovery's timeline (:mod:`elasticd.cluster.timeline`), once per failure.

**One writer.** When a peer that runs the job fails, every survivor computes the same writer
from the job statuses in etcd: the lowest node id among the job's other nodes that ran workers
(:func:`elasticd.agent.job_rules.recovery_writer`). That daemon writes the record
as soon as the job trained again, so N nodes do not write N copies; and the record's key,
``events/<failed node>/<lease>/timeline@<job>``, is created only if absent, so two daemons whose
views differed still store one. The other survivors follow it too, as stand-ins: one that
finds no record ``STAND_IN_WAIT`` seconds after the job trained again (the writer died too, or
the views of who writes differed) writes its own. Only the node that stored the record observes
the metrics.

**What it notes, as it happens** (on whichever thread brings it, wall time, whether or not a
recovery is open: the agent may act before this daemon's watch reports the failure): each
abort of its workers (its own proactive abort, or its agent's, which kills them when a member
of its round is gone and says so over the local socket: ``workers_aborted``), every round
close its job watch delivers (:meth:`TimelineRecorder.on_round_closed`), its workers' restores
and each worker's first step (the first step a worker pid reports past the step its node
restored last: an old worker's last words are not a first step). The ``failed`` event and
every node's ``recovered`` events are read from etcd when the record is assembled.

**When it writes:** at the first cycle after that first step, or, when no first step comes
within ``give_up`` seconds, with what was seen (the missing moments stay missing). A failure of
another node of the job while a recovery is under way joins it (the same recovery goes on
without that node too). The writer observes each phase in ``elasticd_recovery_phase_seconds``
and sets ``elasticd_last_recovery_phase_seconds`` (NaN for a missing phase).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import threading
from typing import Any, Callable

from elasticd.clock import Clock
from elasticd.cluster import timeline
from elasticd.cluster.events import KIND as EVENT_KIND
from elasticd.cluster.events import Event, EventLog
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator
from elasticd.coordination.keys import Keyspace
from elasticd.metrics import Metrics

log = logging.getLogger(__name__)

#: Worker pids remembered per job between failures (a long job's restarts stay bounded).
_MAX_PIDS = 4096
#: Seconds the other survivors wait after the job trained again before writing the timeline
#: themselves.
STAND_IN_WAIT = 10.0
#: A job's last moments of each kind (aborts, round closes, first steps).
_recent = functools.partial(collections.deque, maxlen=16)


@dataclasses.dataclass
class _Recovery:
    """A recovery this node writes the timeline of."""

    job: str
    failed: list[str]
    lease: int
    detected_at: float  # this node's own detection (the failed event's is preferred)
    started: float  # monotonic, for give_up
    writer: bool  # False: the stand-in, in case the writer died too
    in_group: bool = True  # the failed node ran workers of the job: its steps were ours
    due_since: float | None = None  # monotonic: when the job trained again (the stand-in)


@dataclasses.dataclass
class _Moments:
    """What this node saw of a job's worker groups, whoever is recovering (wall times), kept
    whether or not a recovery is open (the module docstring says why)."""

    aborts: collections.deque = dataclasses.field(default_factory=_recent)
    closes: collections.deque = dataclasses.field(default_factory=_recent)
    first_steps: collections.deque = dataclasses.field(default_factory=_recent)
    stepped: set = dataclasses.field(default_factory=set)  # pids past their first step
    closed: set = dataclasses.field(default_factory=set)  # ... whose connection ended
    restored_step: int | None = None  # the step the newest local restore loaded
    step_at: float | None = None  # the last training step a worker reported
    #: (abort, the last training step before it): a failed peer's last step, when it trained
    steps_before_abort: collections.deque = dataclasses.field(default_factory=_recent)
    #: (when, path, moments): each time the agent of an in-process job said it re-formed
    reforms: collections.deque = dataclasses.field(default_factory=_recent)
    #: each local worker's moments of an in-process re-formation, as it reported them
    worker_moments: collections.deque = dataclasses.field(default_factory=_recent)


def _moments(times: Any) -> dict[str, float]:
    """The re-formation moments a message carries that a timeline keeps (numbers only)."""
    if not isinstance(times, dict):
        return {}
    return {k: float(v) for k, v in times.items()
            if k in timeline.REFORM_MOMENTS and type(v) in (int, float) and math.isfinite(v)}


def _path(m: _Moments, since: float) -> tuple[str, dict[str, float]]:
    """The path this node's workers took in the recovery after ``since`` (the first agent's
    word since then; none: the restart path, the only one of a job not in-process, and of one
    whose daemon restarted its workers), and in-process its moments: the agent's, and of its
    workers' each moment's latest (the slowest worker's) from this re-formation on."""
    said = next(((path, moments) for at, path, moments in m.reforms if at >= since), None)
    if said is None or said[0] != "in_process":
        return "restart", {}
    moments = dict(said[1])
    start = moments.get("round_closed", since)
    for worker in m.worker_moments:
        if worker["group_made"] >= start:
            for k, v in worker.items():
                if k not in ("learned", "reform_started", "rendezvous_returned",
                             "round_closed", "all_left"):  # the agent's own
                    moments[k] = max(v, moments.get(k, v))
    return "in_process", moments


class TimelineRecorder:
    """Follows the recoveries this node writes the timeline of.

    Args:
        lease_ttl: the lease TTL (places the failure before its detection).
        give_up: seconds after which a recovery with no first step is written as it is.
        last_heard: when this node's replica server last received a frame from a node (wall
            time, None: never); a sign of life of a failed peer.
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace, events: EventLog,
                 metrics: Metrics, clock: Clock, lease_ttl: Callable[[], float],
                 give_up: float = 600.0,
                 last_heard: Callable[[str], float | None] = lambda node: None) -> None:
        self.node_id, self.coord, self.keys, self.events = node_id, coord, keys, events
        self.metrics, self.clock, self.lease_ttl, self.give_up = metrics, clock, lease_ttl, give_up
        self.last_heard = last_heard
        self._lock = threading.Lock()  # progress and restores arrive on the local API's threads
        self._open: dict[str, _Recovery] = {}
        self._jobs: dict[str, _Moments] = {}
        self.complaints = records.Complaints(log)
        #: The last recovery's timeline as stored, by this node or another (``/status``).
        self.last: timeline.Timeline | None = None

    def _job(self, job: str) -> _Moments:
        m = self._jobs.get(job)
        if m is None:
            if len(self._jobs) >= 64:  # one job runs at a time: forget the oldest
                del self._jobs[next(iter(self._jobs))]
            m = self._jobs[job] = _Moments()
        return m

    # -- what happens (any thread) ------------------------------------------------------------

    def on_failure(self, job: str, node: str, lease: int, writer: bool,
                   aborted: bool, in_group: bool = True) -> None:
        """A node of ``job`` failed (main loop). ``writer``: this node writes its timeline;
        ``aborted``: this node just killed its workers; ``in_group``: the failed node ran
        workers of the job (a spare did not: its death stops no step of ours)."""
        if aborted:
            self.on_abort(job)
        with self._lock:
            rec = self._open.get(job)
            if rec is not None and not self._due(rec):
                # A failure during a recovery: the same recovery goes on without it too.
                if node not in rec.failed:
                    rec.failed.append(node)
                return
        if rec is not None:
            self._finish(rec)  # its first step came, the cycle that writes it not yet
        with self._lock:
            self._open[job] = _Recovery(job, [node], lease, self.clock.wall(),
                                        self.clock.monotonic(), writer, in_group)
        log.info("%s: following the recovery from %s's failure (%s)", job, node,
                 "writer of its timeline" if writer else "stand-in for its writer")

    def on_abort(self, job: str, by: str = "daemon") -> None:
        """The job's workers on this node were killed (by this daemon, or by its agent, which
        reports it: ``workers_aborted``)."""
        now = self.clock.wall()
        log.info("%s: workers aborted by the %s (a moment of the recovery's timeline)", job, by)
        with self._lock:
            m = self._job(job)
            m.aborts.append(now)
            m.steps_before_abort.append((now, m.step_at))

    def on_connection_closed(self, conn: dict[str, Any]) -> None:
        """A local connection ended (``{"pid", "job"}``, the local API's thread). A worker
        that trained (it reported a step) and whose connection ends has died or ended: when
        a peer's death kills it (gloo sees the connection reset), it is the first abort."""
        job, pid = conn.get("job"), conn.get("pid")
        with self._lock:
            m = self._jobs.get(job) if isinstance(job, str) else None
            if m is None or pid not in m.stepped or pid in m.closed:
                return  # not a worker that trained, or its second connection
            if len(m.closed) >= _MAX_PIDS:
                m.closed.clear()
            m.closed.add(pid)
        self.on_abort(job, f"exit of worker pid {pid}")

    def on_round_closed(self, job: str) -> None:
        """The job's watch delivered a new rendezvous round record (the watch thread)."""
        now = self.clock.wall()
        with self._lock:
            self._job(job).closes.append(now)

    def on_progress(self, msg: dict[str, Any]) -> None:
        """A worker's progress report (a step, a register, a slot request; any thread)."""
        peer = msg.get("_peer") if isinstance(msg.get("_peer"), dict) else {}
        job, step = msg.get("job", peer.get("job")), msg.get("step")
        pid = peer.get("pid", msg.get("pid"))  # the kernel's word, when there is one
        if not isinstance(job, str) or type(pid) is not int:
            return
        now = self.clock.wall()
        with self._lock:
            m = self._job(job)
            if type(step) is not int or m.restored_step is not None and step <= m.restored_step:
                return  # no step, or a new worker's register: at its restored step, not past it
            m.step_at = now  # a training step: every rank of the group was alive for it
            if pid in m.stepped:
                return  # a worker already counted (an old one's last words too)
            if len(m.stepped) >= _MAX_PIDS:
                m.stepped.clear()
            m.stepped.add(pid)
            m.first_steps.append(now)  # a worker's first step past its restore
        log.info("%s: first step %d of worker pid %d", job, step, pid)

    def on_reformed(self, msg: dict[str, Any]) -> None:
        """The agent of an in-process job re-formed its workers (``reformed``: ``path``
        in_process, with its moments, or restart when it fell back; the local API's thread)."""
        job, path = msg.get("job"), msg.get("path")
        if not isinstance(job, str) or path not in timeline.PATHS:
            return
        moments = _moments(msg.get("times"))
        with self._lock:
            self._job(job).reforms.append((self.clock.wall(), path, moments))
        log.info("%s: its agent re-formed the workers (%s): a moment of the recovery's "
                 "timeline", job, path.replace("_", "-"))

    def on_reform_moments(self, msg: dict[str, Any]) -> None:
        """A worker of an in-process job made its new group (``reform_moments``: its
        re-formation's moments, :attr:`elasticd.worker.in_process.Round.times`).

        A worker that re-entered is a worker of the new group from now on: its next training
        step past its restore is a first step, as a new process's would be (without this an
        in-process recovery never had one: the process had stepped before)."""
        job, moments = msg.get("job"), _moments(msg.get("times"))
        peer = msg.get("_peer") if isinstance(msg.get("_peer"), dict) else {}
        if not isinstance(job, str) or "group_made" not in moments:
            return
        with self._lock:
            m = self._job(job)
            m.worker_moments.append(moments)
            m.stepped.discard(peer.get("pid"))

    def on_restore(self, report: dict[str, Any]) -> None:
        """A local worker restored (``ckpt_report``): its step is not a training step."""
        job, step = report.get("job"), report.get("step")
        if not isinstance(job, str) or type(step) is not int:
            return
        with self._lock:
            self._job(job).restored_step = step

    # -- the main loop ------------------------------------------------------------------------

    def step(self) -> str | None:
        """Writes the recoveries that are over; returns a note for the cycle's sentence."""
        now = self.clock.monotonic()
        due = []
        with self._lock:
            for r in self._open.values():
                if self._due(r) and r.due_since is None:
                    r.due_since = now
                if (r.due_since is not None and (r.writer or now - r.due_since >= STAND_IN_WAIT)
                        or now - r.started >= self.give_up + (0 if r.writer else STAND_IN_WAIT)):
                    due.append(r)
        notes = [self._finish(r) for r in due]
        return "; ".join(n for n in notes if n) or None

    def _due(self, rec: _Recovery) -> bool:
        """The job trained again since the failure was detected (under the lock)."""
        m = self._jobs.get(rec.job)
        if m is None:
            return False
        # The failure is placed at most a lease TTL before its detection, and the new group
        # steps after its round closed (cluster/timeline.py).
        since = rec.detected_at - self.lease_ttl()
        anchor = (timeline.first_after(m.closes, since) or timeline.first_after(m.aborts, since)
                  or since)
        return timeline.first_after(m.first_steps, anchor) is not None

    def _finish(self, rec: _Recovery) -> str | None:
        try:
            tl = self._assemble(rec)
            stored = self.events.record(Event(
                timeline.KIND, rec.failed[0], rec.lease, self.clock.wall(), self.node_id,
                tl.describe(), tl.as_dict(), instance=rec.job))
        except CoordinationError as exc:
            if self.clock.monotonic() - rec.started < self.give_up + 60:
                log.warning("could not write the timeline of %s's recovery yet: %s", rec.job,
                            exc)
                return None  # the next cycle tries again
            stored, tl = False, None
        with self._lock:
            if self._open.get(rec.job) is rec:
                del self._open[rec.job]
        if tl is None or not stored:
            self.last = self._stored(rec) or self.last  # the writer (or a stand-in) wrote it
            return None
        self._observe(tl)
        self.last = tl
        log.info("%s%s", tl.describe(), "" if rec.writer else " (written by a stand-in: the "
                 "writer did not within %g s)" % STAND_IN_WAIT)
        return f"recovery timeline of {rec.job} written"

    def _assemble(self, rec: _Recovery) -> timeline.Timeline:
        detected_at, detection = rec.detected_at, None
        failed = self._failed_event(rec.failed[0], rec.lease)
        if failed is not None:
            detected_at = failed.at
            d = (failed.data or {}).get("detection_seconds")
            detection = float(d) if records.check_type(d, float) is None else None
        restores = [r for e in self.events.list()
                    if e.kind == "recovered" and isinstance(e.data, dict)
                    and (r := timeline.restore_of(e.data, e.at, e.node)) is not None]
        ttl = self.lease_ttl()
        with self._lock:
            m = self._job(rec.job)
            aborts, closes, steps = list(m.aborts), list(m.closes), list(m.first_steps)
            # The last step before the first abort that can be this failure's (the window
            # assemble gives aborts): its peers stepped with the failed node until then.
            step_sign = next((at for abort, at in m.steps_before_abort
                              if abort >= detected_at - 2 * ttl), None) if rec.in_group else None
            path, reform = _path(m, detected_at - 2 * ttl)
        signs = {"step": step_sign, "frame": self.last_heard(rec.failed[0])}
        return timeline.assemble(job=rec.job, failed=rec.failed, detected_at=detected_at,
                                 detection_seconds=detection, lease_ttl=ttl, signs=signs,
                                 aborted=aborts, round_closed=closes, restores=restores,
                                 first_steps=steps, path=path, reform=reform)

    def _stored(self, rec: _Recovery) -> timeline.Timeline | None:
        """The timeline of ``rec`` as another node stored it (None: none, or unreadable)."""
        key = self.keys.event(rec.failed[0], rec.lease, f"{timeline.KIND}@{rec.job}")
        try:
            kv = self.coord.get(key)
            if kv is None:
                return None
            return timeline.decode(records.decode_dataclass(Event, kv.value, EVENT_KIND,
                                                            key).data, records.where_of(key))
        except (CoordinationError, records.RecordError) as exc:
            log.info("could not read the timeline of %s's recovery: %s", rec.job, exc)
            return None

    def _failed_event(self, node: str, lease: int) -> Event | None:
        key = self.keys.event(node, lease, "failed")
        kv = self.coord.get(key)
        if kv is None:
            return None
        try:
            return records.decode_dataclass(Event, kv.value, EVENT_KIND, key)
        except records.RecordError as exc:
            self.complaints.warn(key, kv.value, "ignoring the failed event: %s", exc)
            return None

    def _observe(self, tl: timeline.Timeline) -> None:
        for phase, seconds in tl.phases().items():
            if seconds is not None:
                self.metrics.recovery.phase_seconds.labels(phase).observe(seconds)
            self.metrics.recovery.last_phase_seconds.labels(phase).set(
                math.nan if seconds is None else seconds)
        self.metrics.recovery.last_timestamp.set(tl.first_step_at or tl.detected_at)
