"""Which job this node runs, and keeping its torchrun agent in the state the cluster wants.

The manager follows the job specs and controls in etcd (``jobs/<job>/spec``, ``.../control``)
through a watch, runs at most one job at a time (the oldest one that is wanted), publishes this
node's view of it (``jobs/<job>/nodes/<node>``, bound to the node's lease, so a dead node's entry
disappears with it), and acts:

* start the agent when the job is wanted and this node can run it (its spec reads, the node's
  :class:`~elasticd.cluster.job_policy.JobPolicy` allows it, the same script hash, the user exists
  and can use the files: checked off the main loop, :mod:`elasticd.agent.job_check`), restart
  it with backoff when it dies (a budget of ``agent_restarts``);
* refuse a job it cannot run, with the reason, in ``jobs/<job>/nodes/<node>`` and ``/status``:
  a spec that does not read (records are written by whoever may write to etcd: a malformed one
  costs that job, never the daemon), or one the node's policy or files rule out; refused until
  its spec or control changes (``elasticctl retry``), and a job whose files are not on this
  node yet waits without holding up later ones (:mod:`elasticd.agent.job_holds`);
* restart the workers at once when a peer that runs the job fails or when the job hangs
  (:mod:`elasticd.agent.worker_group`, which also keeps what the workers report; the hang
  timeout in force is shown in ``/status``, published with the node's job status and
  exported as ``elasticd_hang_timeout_seconds``);
* stop everything (agent and every tagged process) when the job is stopped, when the node fences
  itself, and when the daemon shuts down;
* stop the job as ``failed`` on every node when its worker groups crash-loop: restarts in a row
  (torchrun's and the daemon's) with no new committed step (:mod:`elasticd.agent.crashloop`):
  the node that sees it writes ``desired: failed`` and the reason into the job's control.

Stopping takes up to ``stop_grace`` seconds, so it runs in a thread of its own: the main loop
keeps cycling (and keeps the watchdog fed) meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Callable

from elasticd.agent import job_rules
from elasticd.agent.agent_start import AgentStarter, Credentials
from elasticd.agent.job_check import JobChecks, WAIT_RETRY
from elasticd.agent.job_records import JobRecords
from elasticd.agent.job_rules import AgentExit, JobBook, PeerFailure, Start
from elasticd.agent.job_status import JobStatusBoard
from elasticd.agent.supervisor import AgentSupervisor
from elasticd.agent.worker_group import StragglerWatch, WorkerGroup
from elasticd.clock import Clock, SystemClock
from elasticd.cluster import drain_record
from elasticd.cluster.job_policy import JobPolicy
from elasticd.cluster.jobspec import JobControl, JobSpec, JobState
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator
from elasticd.coordination.keys import Keyspace
from elasticd.hooks import call_hooks
from elasticd.metrics import Metrics

log = logging.getLogger(__name__)


class JobManager:
    """Runs this node's share of the cluster's jobs: asks :mod:`elasticd.agent.job_rules` and
    carries out the answer through the parts it owns.

    Args:
        etcd, state_dir, extra_env, credentials: as :class:`AgentStarter`'s.
        lease: returns the node's current lease (0 when it has none).
        before_resync: as :class:`JobRecords`' (specs that vanished with etcd's data must not
            stop the job).

    Attributes:
        hold: why this node runs no job for now (a drain), or "".
        notes: what the last cycle did (for the daemon's sentence).
        on_job_end: called with a job's name when it ends here (its shared memory and
            replicas are freed).
        committed: the job's newest committed (generation, step) (the daemon's replication
            view); None without replication: the newest step reported is used then.
        record_event: records a cluster event (kind, detail, data): set by the daemon.
        on_round_closed: called with a job's name when its watch delivers a new rendezvous
            round record (on the watch thread).
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace, etcd: str,
                 state_dir: str, metrics: Metrics, lease: Callable[[], int],
                 extra_env: Callable[[], dict[str, str]] = dict,
                 rdzv_conf: dict[str, str] | None = None, agent_restarts: int = 10,
                 stop_grace: float = 10.0, warm_workers: bool = False,
                 clock: Clock | None = None,
                 before_resync: Callable[[], Any] = lambda: None,
                 policy: JobPolicy | None = None,
                 credentials: Callable[[JobSpec], Credentials] | None = None) -> None:
        self.metrics = metrics
        self.clock = clock or SystemClock()
        self.rdzv_conf = rdzv_conf or {}
        self.agent_restarts = agent_restarts
        self.stop_grace = stop_grace
        self.policy = policy or JobPolicy()
        self.hold = ""
        self.notes: list[str] = []
        self.on_job_end: list[Callable[[str], None]] = []
        self.committed: Callable[[str], tuple[int, int] | None] = lambda job: None
        self.record_event: Callable[[str, str, dict[str, Any]], None] = lambda *a: None
        self.on_round_closed: Callable[[str], None] = lambda job: None
        self.checks = JobChecks(state_dir, self.clock)
        self.book = job_rules.JobBook()
        self.board = JobStatusBoard(node_id, coord, keys, lease, self.clock)
        self.records = JobRecords(coord, keys, before_resync,
                                  lambda job: self.on_round_closed(job), records.Complaints(log))
        self.starter = AgentStarter(node_id, keys.prefix, etcd, state_dir, extra_env,
                                    warm_workers, self.clock, credentials)
        stragglers = StragglerWatch(
            self.board, metrics,
            drain=lambda: drain_record.request(coord, keys, node_id, 120.0,
                                               f"straggler@{node_id}", self.clock.wall()),
            record_event=lambda *a: self.record_event(*a), note=lambda t: self.notes.append(t))
        self.group = WorkerGroup(self.board, metrics, self.clock, stragglers)
        self.reform = ReformWatch(self.book, self.group, metrics, self.clock,
                                  note=lambda t: self.notes.append(t))
        self._stopping: threading.Thread | None = None

    def republish(self) -> int:
        """etcd lost its data: the job records are written again
        (:meth:`JobRecords.republish`), this node's status entry at the next publish."""
        written = self.records.republish()
        self.board.lost()
        return written

    @property
    def job(self) -> str | None:
        """The job whose agent runs here, if any."""
        return self.group.job

    @property
    def supervisor(self) -> AgentSupervisor | None:
        return self.group.supervisor

    # -- the cycle ------------------------------------------------------------------------

    def wanted(self, view: job_rules.JobView | None = None) -> str | None:
        """The job this node should run (:func:`job_rules.wanted`): the oldest wanted job it
        has not finished, none while the node is held out of jobs (e.g. drained). A job whose
        spec does not read is wanted too, to be refused (:meth:`_start`)."""
        now, busy = self.clock.monotonic(), self.job is not None
        return job_rules.wanted(
            view or self.records.view(self.book.finished, self.board.node_id), self.job,
            self.hold,
            held=lambda job: self.book.holds.held(job, self.records.of(job), now, busy))

    def step(self) -> None:
        """One cycle: follow etcd, start/stop/restart the agent, publish this node's status."""
        self.notes = []
        self.records.refresh()
        if self._stopping is not None:
            if self._stopping.is_alive():
                self.board.publish()
                return
            self._stopping = None
        me = self.board.node_id
        self._end_if_decided_elsewhere(self.records.view(self.book.finished, me))
        view = self.records.view(self.book.finished, me)  # a job that ended above is finished
        wanted = self.wanted(view)
        self._end_waiting(view)
        stop = (job_rules.stop_running(view, self.job, wanted, self.hold)
                if self.job is not None else None)
        if stop is not None:
            if stop.state is JobState.REFUSED:
                self.notes.append(f"refused job {self.job}: {stop.why}")
                log.error("stopping job %s: %s", self.job, stop.why)
            self._stop_async(stop.why, stop.state)
        elif wanted is not None and self.job is None:
            self._start(wanted)
        elif self.supervisor is not None:
            self._check_agent()
            self.reform.check()
        job = self.job
        self.group.tick(self.records.specs[job][1] if job in self.records.specs else None,
                        self.records.statuses.get(job, {}) if job is not None else {})
        self.board.publish()

    def _end_if_decided_elsewhere(self, view: job_rules.JobView) -> None:
        """A job this node was about to restart (its agent died) succeeded on peers meanwhile,
        or was failed (:func:`job_rules.decided_elsewhere`): record that here too rather than
        leave it 'restarting'."""
        job, status = self.board.about, self.board.status
        if self.job is not None or job is None or status.state != JobState.RESTARTING:
            return
        decided = job_rules.decided_elsewhere(view, job)
        if decided is None:
            return
        state, why = decided
        if state is JobState.SUCCEEDED:
            done = ", ".join(self.records.succeeded_on(job, self.board.node_id))
            why = f"job succeeded on {done}"
            note = f"job {job} succeeded on {done}; not restarting it here"
        else:
            note = f"job {job} failed: {why}"
        self.book.finished.add(job)
        self.board.set(state, why, agent_starts=status.agent_starts, log=status.log)
        self.notes.append(note)
        call_hooks(self.on_job_end, job, log=log, failed=f"job-end hook failed for {job}")

    def _start(self, job: str) -> None:
        spec = self.records.specs.get(job)

        def check() -> tuple[str, bool] | None:
            assert spec is not None
            v = self.checks.verdict(job, spec[1], self.records.controls.get(job), self.policy)
            return None if v is None else (v.problem, v.waiting)

        unreadable = self.records.bad_specs[job][1] if spec is None else None
        decision, why = job_rules.start(self.clock.monotonic(), self.book.not_before_for(job),
                                        unreadable, check)
        if decision is Start.CHECKING:
            self.notes.append(f"checking job {job}'s files on this node")
        if decision in (Start.WAIT, Start.REFUSE):
            self._hold(job, why, waiting=decision is Start.WAIT)
        if decision is not Start.GO:
            return
        assert spec is not None
        credentials = self.starter.credentials(spec[1])
        if isinstance(credentials, str):
            self._hold(job, credentials)
            return
        self.group.restarts.agent_starting(job, os.path.join(self.starter.log_dir(job),
                                                             "torchrun"))
        sup = self.starter.start(job, spec[1], self.rdzv_conf, credentials)
        if isinstance(sup, str):
            self._hold(job, sup)
            return
        self.group.attach(job, sup)
        self.group.restarts.agent_started(sup.log_size())
        self.board.set(JobState.RUNNING, "agent started", about=job, agent_pid=sup.pid,
                       agent_starts=1, log=sup.log_path)
        self.notes.append(f"started job {job} (agent pid {sup.pid})")

    def _hold(self, job: str, problem: str, waiting: bool = False) -> None:
        """Leaves ``job`` aside (:class:`~elasticd.agent.job_holds.JobHolds`), saying why in
        its status here: refused until its spec or control changes, or (``waiting``: its files
        are not on this node yet) looked at again in :data:`WAIT_RETRY` seconds if no other job
        runs here by then."""
        if waiting:
            self.book.holds.wait(job, self.records.of(job), self.clock.monotonic() + WAIT_RETRY)
            detail = f"waiting: {problem}"
            if (self.board.about, self.board.status.detail) != (job, detail):
                log.warning("job %s: %s", job, problem)
            self.board.set(JobState.IDLE, detail, about=job)
            self.notes.append(f"job {job} {detail}")
        else:
            self.board.set(JobState.REFUSED, problem, about=job)
            self.book.holds.refuse(job, self.records.of(job))
            self.notes.append(f"refused job {job}: {problem}")
            log.error("refusing job %s: %s", job, problem)
        self.board.publish(job)

    def _end_waiting(self, view: job_rules.JobView) -> None:
        """A job this node was waiting for (its files not deployed yet) is no longer wanted
        (stopped, deleted, the node drained): its status says so rather than waiting for ever."""
        for job in self.book.holds.end_waits(lambda j: job_rules.still_waited(view, j,
                                                                              self.hold)):
            if job == self.board.about and self.job is None:
                self.board.set(JobState.STOPPED, f"job {job} is no longer wanted here")
                self.board.publish(job)
            else:  # another job's status is this node's now: the waiting one goes
                with contextlib.suppress(CoordinationError):
                    self.board.withdraw(job)

    def _check_agent(self) -> None:
        group, sup, job = self.group, self.group.supervisor, self.group.job
        assert sup is not None and job is not None
        code = sup.poll()
        if code is None:
            new = group.restarts.new_attempts(os.path.join(sup.log_dir, "torchrun"))
            # torchrun restarted the worker group (its restart count went up), maybe more than
            # once since the last look: each restart with the failure the log shows.
            if new:
                group.restarts.restarted(sup.log_size(), sup.log_tail, self.committed(job),
                                         times=new)
                if self._crash_looping():
                    return
            note = group.restart_if_hung()
            if note:
                self.notes.append(note)
            return
        done = self.records.succeeded_on(job, self.board.node_id)
        if code != 0 and not done:
            committed = self.committed(job)
            self.book.agent_died(job, committed)
            self.metrics.jobs.worker_restarts.labels("agent_died").inc()
            group.restarts.restarted(sup.log_size(), sup.log_tail, committed,
                                     f"agent exited with {code}")
            if self._crash_looping():
                return
        verdict = self.book.agent_exited(code, bool(done), self.agent_restarts,
                                         self.clock.monotonic())
        if verdict is AgentExit.SUCCEEDED:
            self.notes.append(f"job {job} finished on this node")
            self._stop_async(f"job {job} succeeded", JobState.SUCCEEDED)
        elif verdict is AgentExit.SUCCEEDED_ELSEWHERE:
            self.notes.append(f"job {job} succeeded on {', '.join(done)}; this node's "
                              f"agent exited {code}")
            self._stop_async(f"job {job} succeeded on {', '.join(done)}", JobState.SUCCEEDED)
        elif verdict is AgentExit.GIVE_UP:
            self.notes.append(f"job {job}: agent failed {self.book.deaths} times; giving up")
            self._stop_async(f"agent exited {code} too often", JobState.FAILED)
        else:
            self.notes.append(
                f"job {job}: agent exited with {code}; restarting in "
                f"{job_rules.restart_backoff(self.book.deaths):.1f} s "
                f"({self.book.deaths}/{self.agent_restarts})")
            sup.stop(grace=1.0)  # leftovers of the dead agent, if any
            group.detach()  # what hang detection learned stays: the job is restarted
            self.board.set(JobState.RESTARTING, f"agent exited with {code}",
                           agent_starts=sup.starts, log=sup.log_path)
            self.board.publish(job)

    def _crash_looping(self) -> bool:
        """Fails the job everywhere when it crash-loops (:mod:`elasticd.agent.crashloop`);
        returns True if it did."""
        job = self.job
        if job is None or job not in self.records.specs:
            return False
        reason = self.group.restarts.verdict(self.records.specs[job][1].crash_loop_restarts)
        if reason is None:
            return False
        log.error("job %s: %s; stopping it on every node", job, reason)
        self.metrics.jobs.crash_loops.inc()
        self.notes.append(f"job {job} failed: {reason}")
        try:
            self.records.fail(job, JobControl(JobState.FAILED, self.clock.wall(),
                                              self.board.node_id, reason))
        except CoordinationError as exc:
            log.warning("could not mark job %s failed in etcd: %s", job, exc)
        self.record_event("job_failed", f"{job}: {reason}",
                          {"job": job, "reason": reason,
                           "restarts": self.group.restarts.loop.restarts})
        self._stop_async(reason, JobState.FAILED)
        return True

    # -- actions from the daemon ----------------------------------------------------------

    def fence(self, reason: str) -> None:
        """Stops everything at once (the node was declared dead)."""
        sup = self.supervisor
        if sup is not None:
            sup.stop(grace=1.0)
            self.notes.append(f"stopped job {self.job}: {reason}")
            self.board.set(JobState.STOPPED, f"fenced: {reason}")
            self.group.detach()

    def idle(self) -> bool:
        """True when this node runs no job and no stop is under way."""
        stopping = self._stopping
        return self.supervisor is None and (stopping is None or not stopping.is_alive())

    def shutdown(self) -> None:
        """Stops the agent and waits (daemon exit)."""
        if self._stopping is not None:
            # Bounded: the stop gives the agent stop_grace, then SIGKILLs; a stop thread stuck
            # past that (an etcd call in remove_job) must not keep the daemon from exiting.
            self._stopping.join(self.stop_grace + 15.0)
            if self._stopping.is_alive():
                log.warning("job stop still under way after %.0f s; exiting without it",
                            self.stop_grace + 15.0)
        sup, job = self.supervisor, self.job
        if sup is not None:
            sup.stop(self.stop_grace)
            self.board.set(JobState.STOPPED, "daemon shut down")
            self.board.publish(job)
            self.group.detach()
        self.records.close()

    def _stop_async(self, why: str, final_state: JobState) -> None:
        sup, job, board, hooks = self.supervisor, self.job, self.board, self.on_job_end
        if job is not None and final_state in (JobState.SUCCEEDED, JobState.FAILED):
            self.book.finished.add(job)  # over for this node; a stopped or drained job may return
        elif final_state is JobState.REFUSED and job is not None:
            self.book.holds.refuse(job, self.records.of(job))
        if sup is None or job is None:
            self.group.detach()
            return
        # A straggler's verdict stays on its stopped status: why it was drained, for instance.
        straggler = board.status.straggler
        board.set(JobState.STOPPING, why, agent_pid=sup.pid, agent_starts=sup.starts,
                  log=sup.log_path, straggler=straggler)
        board.publish(job)

        def run() -> None:
            code = sup.stop(self.stop_grace)
            call_hooks(hooks, job, log=log, failed=f"job-end hook failed for {job}")
            board.set(final_state, f"{why} (agent exit {code})", agent_starts=sup.starts,
                      log=sup.log_path, straggler=straggler)
            with contextlib.suppress(CoordinationError):
                board.publish(job)

        self.group.detach(job_over=True)
        self._stopping = threading.Thread(target=run, name=f"stop-{job}", daemon=True)
        self._stopping.start()

    def on_peer_failed(self, node: str) -> int | None:
        """A peer's lease expired: what it means for our workers (:func:`job_rules.peer_failed`).

        Returns:
            how many workers were killed; None when the peer did not run our job.
        """
        job, sup = self.job, self.supervisor

        def reformed_without() -> bool:  # job_rules.reformed_without, read from etcd
            assert job is not None and sup is not None
            peer = self.records.statuses.get(job, {}).get(node)
            mine, theirs = sup.pid, peer.agent_pid if peer else None
            return bool(mine and theirs) and job_rules.reformed_without(
                self.records.round_pids(job), mine, theirs)

        members = self.records.members.get(job, set()) if job is not None else set()
        in_process = sup is not None and sup.spec.in_process
        decision = job_rules.peer_failed(sup is not None and job is not None, node, members,
                                         reformed_without, in_process)
        if decision is PeerFailure.NOT_OURS:
            return None
        if decision is PeerFailure.REFORM:
            assert sup is not None
            sup.tell_peer_failed()  # first: the agent's round waits for it, not for this
            self.reform.started(node, sup.spec.reform_deadline)
            return 0
        # Counted either way: a group that went on without the peer was restarted by its agent.
        self.metrics.jobs.worker_restarts.labels("peer_failed").inc()
        if decision is PeerFailure.LEFT_RUNNING:
            note = (f"peer {node} of {job} failed; its last rendezvous round already "
                    "went on without it: workers left running")
            self.notes.append(note)
            log.info("%s", note)
            return 0
        n = self.group.restart_workers(f"peer {node} failed")
        self.notes.append(f"restarted {n} workers of {job}: peer {node} failed")
        return n

    # -- what the daemon reads ------------------------------------------------------------

    def set_unprotected(self, text: str) -> None:
        """What the checkpoint service says of the job's protection ("" while protected),
        published with the node's job status (``elasticctl jobs``)."""
        self.board.edit(lambda st: {"unprotected": text} if text != st.unprotected else {})

    def round_ranks(self) -> dict[str, list[int]]:
        """The current worker group's nodes and ranks (:func:`job_rules.round_ranks`)."""
        job, status = self.job, self.board.status
        if job is None:
            return {}
        statuses = {**self.records.statuses.get(job, {}), self.board.node_id: status}
        return job_rules.round_ranks(statuses, status.world_size)

    def recovery_writer(self, failed: str) -> str | None:
        """:func:`job_rules.recovery_writer` for the job here (None without one)."""
        job, me = self.job, self.board.node_id
        if job is None:
            return None
        return job_rules.recovery_writer({**self.records.statuses.get(job, {}),
                                          me: self.board.status},
                                         {*self.records.members.get(job, set()), me}, failed)

    def ran_workers(self, node: str) -> bool:
        """Whether ``node`` ran workers of our job (:func:`job_rules.ran_workers`)."""
        st = self.records.statuses.get(self.job, {}).get(node) if self.job is not None else None
        return st is not None and job_rules.ran_workers(st)

    def describe(self) -> dict[str, Any]:
        job, status = self.job, self.board.status
        sts = {**self.records.statuses.get(job, {}), self.board.node_id: status} if job else {}
        return {"job": job, **status.as_dict(), "progress": self.group.progress_status(),
                "refused_specs": self.records.refused(),
                # every node's own verdict, as published (agent/straggler.py)
                "stragglers": {n: st.straggler for n, st in sorted(sts.items()) if st.straggler},
                "straggler_detection": self.group.straggler_detection()}


class ReformWatch:
    """Starts, ends and enforces the daemon's deadline of an in-process job's re-formation
    after a peer's failure (part of the job manager).

    The job's agent re-forms its live workers itself (:mod:`.in_process_agent`) and says when it
    is done (``reformed``, over the daemon's local socket, with the path its workers took). The
    daemon keeps a backstop deadline (:meth:`job_rules.JobBook.reform_started`): past it, with no
    word from the agent, it restarts the workers as it does for a job not in the mode.
    """

    def __init__(self, book: JobBook, group: WorkerGroup, metrics: Metrics, clock: Clock,
                 note: Callable[[str], None]) -> None:
        self._book, self._group, self._metrics = book, group, metrics
        self._clock, self._note = clock, note
        #: Guards the book's deadline (``reform_by``): the main loop starts and checks it,
        #: the local API's thread ends it (``reformed``).
        self._lock = threading.Lock()

    def started(self, peer: str, deadline: float) -> None:
        """``peer`` failed and the job's agent re-forms its workers in-process, within the
        job's ``deadline`` after its round (the daemon's backstop adds an allowance)."""
        with self._lock:
            self._book.reform_started(self._clock.monotonic(), deadline)
        note = (f"peer {peer} of {self._group.job} failed: its agent re-forms the workers "
                "in-process (restarted if it has not within the deadline)")
        self._note(note)
        log.info("%s", note)

    def on_reformed(self, msg: dict[str, Any]) -> None:
        """The agent re-formed its workers (``path``: ``in_process``, or ``restart`` when it
        fell back): the deadline ends (any thread)."""
        path = msg.get("path")
        if msg.get("job", self._group.job) != self._group.job \
                or path not in ("in_process", "restart"):
            return
        with self._lock:
            self._book.reform_ended()
        self._metrics.rendezvous.recoveries.labels(path).inc()
        if path == "restart":
            self._metrics.jobs.worker_restarts.labels("peer_failed").inc()
        log.info("%s re-formed by %s%s", self._group.job, path.replace("_", "-"),
                 f": {str(msg.get('why'))[:200]}" if msg.get("why") else "")

    def check(self) -> None:
        """Once a cycle: past the deadline with no word from the agent, today's restart."""
        with self._lock:
            overdue = self._book.reform_overdue(self._clock.monotonic())
        if not overdue:
            return
        n = self._group.restart_workers("in-process re-formation overdue")
        self._metrics.rendezvous.recoveries.labels("restart").inc()
        self._metrics.jobs.worker_restarts.labels("peer_failed").inc()
        self._note(f"restarted {n} workers of {self._group.job}: its agent did not re-form "
                   "them in-process by the deadline")
