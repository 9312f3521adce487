"""The job records this node follows in etcd: specs, controls and every node's job status.

The job manager (:mod:`elasticd.agent.manager`) lists ``<prefix>/jobs/``, watches it from the
revision after, and reads each cycle's changes into the maps below; a record that does not read
costs only its own job (a spec that does not read is kept in :attr:`JobRecords.bad_specs`, to
refuse that job with the reason). After an etcd data loss it writes back what it follows
(:meth:`JobRecords.republish`).
"""

from __future__ import annotations

from typing import Any, Callable

from elasticd.cluster.jobspec import JobControl, JobSpec, JobState, NodeJobStatus
from elasticd.coordination import records
from elasticd.coordination.api import Coordinator, EventType
from elasticd.coordination.keys import Keyspace, check_name
from elasticd.coordination.watch_feed import WatchFeed


class JobRecords:
    """The job manager's view of the job records (a base of
    :class:`~elasticd.agent.manager.JobManager`, which sets the attributes annotated here)."""

    coord: Coordinator
    keys: Keyspace
    complaints: records.Complaints
    _before_resync: Callable[[], Any]
    _published: NodeJobStatus | None

    def __init__(self) -> None:
        self.specs: dict[str, tuple[int, JobSpec]] = {}  # job -> (create revision, spec)
        # Jobs whose spec does not read: job -> (create revision, why). Each is refused.
        self.bad_specs: dict[str, tuple[int, str]] = {}
        self.controls: dict[str, JobControl] = {}
        self.members: dict[str, set[str]] = {}  # job -> nodes with a live status entry
        self.statuses: dict[str, dict[str, NodeJobStatus]] = {}  # job -> node -> status
        #: Called with the job's name when its watch delivers a new rendezvous round record
        #: (on the watch thread: the moment matters, the next cycle may be a second away).
        self.on_round_closed: Callable[[str], None] = lambda job: None
        self._feed = WatchFeed(keep=self._keep)
        self._need_resync = True

    def start_watch(self) -> None:
        self._before_resync()
        kvs, revision = self.coord.get_prefix(self.keys.jobs)
        self._reset(kvs)
        self._feed.start(self.coord, self.keys.jobs, revision + 1)

    def close(self) -> None:
        self._feed.close()

    def republish(self) -> int:
        """etcd lost its data: writes again every job spec and control this node follows
        (create only: another node may have done it already), oldest first so that the order
        in which jobs are wanted stays, and this node's status entry at the next publish.
        The caller re-watches; the next step re-lists. Returns the specs this call wrote.
        A job stopped on purpose stays stopped: its control says so."""
        written = 0
        for job, (_, spec) in sorted(self.specs.items(), key=lambda kv: kv[1][0]):
            if self.coord.create(self.keys.job_spec(job), spec.encode()):
                written += 1
            control = self.controls.get(job)
            if control is not None:
                self.coord.create(self.keys.job_control(job), control.encode())
        self._published = None  # our status entry went with the data
        self._need_resync = True
        return written

    def _keep(self, event: Any) -> bool:
        """Whether the loop wants a watch event; a round record is only noted."""
        job, what = self._kind(event.kv.key)
        if what is not None:
            return True
        if event.type is EventType.PUT and self._is_round(event.kv.key):
            self.on_round_closed(job)
        return False

    def _is_round(self, key: bytes) -> bool:
        """``jobs/<job>/rdzv/native/round``: the record one compare-and-set writes to close a
        rendezvous round (elasticd.rendezvous.handler)."""
        try:
            job, _, _ = self.keys.job_key(key)
        except ValueError:
            return False
        return key == self.keys.job_rdzv_round(job)

    def _kind(self, key: bytes) -> tuple[str, str | None]:
        """Splits ``<prefix>/jobs/<job>/<what>[/<node>]`` into (job, what) for the keys we
        follow; ``what`` is None for the rest (the rendezvous keys, and any key whose job or
        node name is not valid: ``jobs/../spec`` is no job)."""
        try:
            job, what, rest = self.keys.job_key(key)
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
            self.complaints.warn(key, value, "ignoring job record: %s", exc)

    def _drain(self) -> None:
        events, stale = self._feed.take()
        self._need_resync |= stale
        for e in events:
            self._apply(e.type, e.kv.key, e.kv.value, e.kv.create_revision)
