"""The job records this node follows in etcd: specs, controls and every node's job status.

The job manager (:mod:`elasticd.agent.manager`) lists ``<prefix>/jobs/``, watches it from the
revision after, and reads each cycle's changes into the maps below; a record that does not read
costs only its own job (a spec that does not read is kept in :attr:`JobRecords.bad_specs`, to
refuse that job with the reason). After an etcd data loss it writes back what it follows
(:meth:`JobRecords.republish`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from elasticd.agent.job_rules import JobView
from elasticd.cluster.jobspec import JobControl, JobSpec, JobState, NodeJobStatus
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator, EventType
from elasticd.coordination.keys import Keyspace, check_name
from elasticd.coordination.watch_feed import WatchFeed
from elasticd.rendezvous.records import RoundRecord, agent_pid

log = logging.getLogger(__name__)


class JobRecords:
    """The job records this node follows (owned by the job manager).

    Args:
        before_resync: called before every full re-list (the daemon looks there whether etcd
            lost its data, and if so has the specs written again first).
        on_round_closed: called with a job's name when its watch delivers a new rendezvous
            round record (on the watch thread: the moment matters, the next cycle may be a
            second away).
        complaints: where a record that does not read is reported (once per record).

    Attributes:
        specs: job -> (its spec's create revision, the spec).
        bad_specs: jobs whose spec does not read: job -> (create revision, why).
        controls: job -> its control.
        members: job -> the nodes with a live status entry (starting, running, restarting).
        statuses: job -> node -> its status.
    """

    def __init__(self, coord: Coordinator, keys: Keyspace, before_resync: Callable[[], Any],
                 on_round_closed: Callable[[str], None], complaints: records.Complaints) -> None:
        self._coord = coord
        self._keys = keys
        self._before_resync = before_resync
        self._on_round_closed = on_round_closed
        self._complaints = complaints
        self.specs: dict[str, tuple[int, JobSpec]] = {}
        self.bad_specs: dict[str, tuple[int, str]] = {}
        self.controls: dict[str, JobControl] = {}
        self.members: dict[str, set[str]] = {}
        self.statuses: dict[str, dict[str, NodeJobStatus]] = {}
        self._feed = WatchFeed(keep=self._keep)
        self._need_resync = True

    def start_watch(self) -> None:
        self._before_resync()
        kvs, revision = self._coord.get_prefix(self._keys.jobs)
        self._reset(kvs)
        self._feed.start(self._coord, self._keys.jobs, revision + 1)

    def refresh(self) -> None:
        """Reads what the watch brought since the last call, or lists the jobs again when the
        watch cannot be trusted (or after :meth:`republish`)."""
        self._drain()
        if self._need_resync:
            self._before_resync()
            kvs, _ = self._coord.get_prefix(self._keys.jobs)
            self._reset(kvs)

    def close(self) -> None:
        self._feed.close()

    def republish(self) -> int:
        """etcd lost its data: writes again every job spec and control this node follows
        (create only: another node may have done it already), oldest first so that the order
        in which jobs are wanted stays (the caller writes this node's status entry again).
        The caller re-watches; the next :meth:`refresh` re-lists. Returns the specs this call wrote.
        A job stopped on purpose stays stopped: its control says so."""
        written = 0
        for job, (_, spec) in sorted(self.specs.items(), key=lambda kv: kv[1][0]):
            if self._coord.create(self._keys.job_keys(job).spec, spec.encode()):
                written += 1
            control = self.controls.get(job)
            if control is not None:
                self._coord.create(self._keys.job_keys(job).control, control.encode())
        self._need_resync = True
        return written

    def view(self, finished: Iterable[str], me: str) -> JobView:
        """The records, reduced to what :mod:`elasticd.agent.job_rules` decides from
        (``finished``: the jobs node ``me`` completed or gave up on)."""
        created = {job: rev for job, (rev, _) in self.bad_specs.items()}
        created.update((job, rev) for job, (rev, _) in self.specs.items())
        return JobView(
            created=created,
            desired={job: c.desired for job, c in self.controls.items()},
            reasons={job: c.reason for job, c in self.controls.items()},
            unreadable={job: why for job, (_, why) in self.bad_specs.items()},
            finished=frozenset(finished),
            succeeded_elsewhere=frozenset(j for j in self.statuses
                                          if self.succeeded_on(j, me)))

    def succeeded_on(self, job: str, me: str) -> list[str]:
        return sorted(n for n, st in self.statuses.get(job, {}).items()
                      if n != me and st.state == JobState.SUCCEEDED)

    def of(self, job: str) -> tuple[Any, Any]:
        """The spec (or why it does not read) and the control of ``job``: what a refusal or a
        wait is tied to (:mod:`elasticd.agent.job_holds`)."""
        spec = self.specs.get(job)
        return (spec[1] if spec else self.bad_specs.get(job, (0, ""))[1],
                self.controls.get(job))

    def refused(self) -> dict[str, str]:
        bad = sorted(self.bad_specs.items(), key=lambda kv: kv[1][0])[-20:]
        return {job: why for job, (_, why) in bad}

    def round_pids(self, job: str) -> list[int] | None:
        """The agent pids of the job's last closed rendezvous round (read from etcd now);
        None without a round, or one that cannot be read."""
        try:
            kv = self._coord.get(self._keys.rendezvous(job).round)
            last = RoundRecord.decode(kv.value) if kv is not None else None
        except (CoordinationError, records.RecordError) as exc:
            log.warning("job %s: cannot read the rendezvous round: %s", job, exc)
            return None
        return None if last is None else [agent_pid(m) for m in last.members]

    def fail(self, job: str, control: JobControl) -> None:
        """Writes the job's control as ``control`` (the job failed: it stops on every node).

        Raises:
            CoordinationError: etcd did not take it.
        """
        self._coord.put(self._keys.job_keys(job).control, control.encode())

    def _keep(self, event: Any) -> bool:
        """Whether the loop wants a watch event; a round record is only noted."""
        job, what = self._kind(event.kv.key)
        if what is not None:
            return True
        if event.type is EventType.PUT and self._is_round(event.kv.key):
            self._on_round_closed(job)
        return False

    def _is_round(self, key: bytes) -> bool:
        """``jobs/<job>/rdzv/native/round``: the record one compare-and-set writes to close a
        rendezvous round (elasticd.rendezvous.handler)."""
        try:
            job, _, _ = self._keys.job_key(key)
        except ValueError:
            return False
        return key == self._keys.rendezvous(job).round

    def _kind(self, key: bytes) -> tuple[str, str | None]:
        """Splits ``<prefix>/jobs/<job>/<what>[/<node>]`` into (job, what) for the keys we
        follow; ``what`` is None for the rest (the rendezvous keys, and any key whose job or
        node name is not valid: ``jobs/../spec`` is no job)."""
        try:
            job, what, rest = self._keys.job_key(key)
        except ValueError:
            return "", None
        if what in ("spec", "control") and not rest:
            return job, what
        if what == "nodes" and "/" not in rest:
            try:
                return job, "nodes/" + check_name("node id in key", rest)
            except ValueError:
                return job, None
        return job, None

    def _reset(self, kvs: list[Any]) -> None:
        for records_ in (self.specs, self.bad_specs, self.controls, self.members, self.statuses):
            records_.clear()
        for kv in kvs:
            self._apply(EventType.PUT, kv.key, kv.value, kv.create_revision)
        self._need_resync = False

    def _apply(self, etype: EventType, key: bytes, value: bytes, create_revision: int) -> None:
        job, what = self._kind(key)
        if what is None:
            return
        try:
            if what == "spec":
                self.specs.pop(job, None)
                self.bad_specs.pop(job, None)
                if etype is EventType.PUT:
                    try:
                        self.specs[job] = (create_revision, JobSpec.decode(value, key, job))
                    except records.RecordError as exc:
                        self.bad_specs[job] = (create_revision, f"unreadable job spec: {exc}")
                        raise
            elif what == "control":
                self.controls.pop(job, None)
                if etype is EventType.PUT:
                    self.controls[job] = JobControl.decode(value, key)
            else:
                node = what.split("/", 1)[1]
                nodes = self.members.setdefault(job, set())
                self.statuses.get(job, {}).pop(node, None)
                nodes.discard(node)
                if etype is EventType.PUT:
                    st = NodeJobStatus.decode(value, key, node)
                    self.statuses.setdefault(job, {})[node] = st
                    if st.state in (JobState.STARTING, JobState.RUNNING, JobState.RESTARTING):
                        nodes.add(node)
        except records.RecordError as exc:
            self._complaints.warn(key, value, "ignoring job record: %s", exc)

    def _drain(self) -> None:
        events, stale = self._feed.take()
        self._need_resync |= stale
        for e in events:
            self._apply(e.type, e.kv.key, e.kv.value, e.kv.create_revision)
