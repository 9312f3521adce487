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
import dataclasses
import logging
import os
import subprocess
import threading
from typing import Any, Callable

from elasticd.agent import job_rules
from elasticd.agent.job_check import JobChecks, Verdict, WAIT_RETRY
from elasticd.agent.job_holds import JobHolds
from elasticd.agent.job_records import JobRecords
from elasticd.agent.restart_watch import RestartWatch
from elasticd.cluster.job_policy import JobPolicy
from elasticd.agent.supervisor import AgentSupervisor
from elasticd.agent.worker_group import WorkerGroup
from elasticd.clock import Clock, SystemClock
from elasticd.cluster.jobspec import JobControl, JobSpec, JobState, NodeJobStatus
from elasticd.coordination import records
from elasticd.coordination.api import AuthError, CoordinationError, Coordinator
from elasticd.coordination.keys import Keyspace
from elasticd.metrics import Metrics

log = logging.getLogger(__name__)


class JobManager(JobRecords, WorkerGroup):
    """Runs this node's share of the cluster's jobs.

    Args:
        node_id: this node.
        coord: the coordinator.
        keys: the cluster keyspace.
        etcd: endpoints handed to the agent's rendezvous.
        state_dir: where per-job logs go (``<state_dir>/jobs/<job>/agent.log``).
        metrics: the daemon's metrics.
        lease: returns the node's current lease (0 when it has none).
        extra_env: returns more environment for agents (e.g. the daemon's local socket).
        rdzv_conf: torchrun rendezvous settings tuned for fast recovery.
        warm_workers: start workers from a zygote (:mod:`elasticd.agent.zygote`).
        before_resync: called before every full re-list of the jobs (the daemon looks there
            whether etcd lost its data, and if so has the specs written again first: specs
            that vanished with the data must not stop the job).
        policy: what this node agrees to run (:class:`JobPolicy`).
        credentials: called with a job's spec before its agent starts; returns the extra
            rendezvous settings and environment that give the agent its own etcd credentials
            (:mod:`elasticd.coordination.agent_credentials`), or raises to refuse the start.
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace, etcd: str,
                 state_dir: str, metrics: Metrics, lease: Callable[[], int],
                 extra_env: Callable[[], dict[str, str]] = dict,
                 rdzv_conf: dict[str, str] | None = None, agent_restarts: int = 10,
                 stop_grace: float = 10.0, warm_workers: bool = False,
                 clock: Clock | None = None,
                 before_resync: Callable[[], Any] = lambda: None,
                 policy: JobPolicy | None = None,
                 credentials: Callable[[JobSpec], tuple[dict[str, str], dict[str, str]]]
                 | None = None) -> None:
        self.node_id = node_id
        self.coord = coord
        self.keys = keys
        self.etcd = etcd
        self.state_dir = state_dir
        self.metrics = metrics
        # Part of every job's process tag: the tag finds a job's processes through /proc, and
        # an agent that fences SIGKILLs every process with its tag. Without this token, an
        # agent of an earlier daemon of the same prefix, node and job (a daemon restarted
        # under systemd, or the previous cluster on a test host) fencing late would kill
        # this daemon's agent and workers too.
        self._incarnation = os.urandom(4).hex()
        self._lease = lease
        self._extra_env = extra_env
        self.rdzv_conf = rdzv_conf or {}
        self.agent_restarts = agent_restarts
        self.stop_grace = stop_grace
        self.warm_workers = warm_workers
        self.clock = clock or SystemClock()
        self._before_resync = before_resync
        self.policy = policy or JobPolicy()
        self.credentials = credentials
        self.complaints = records.Complaints(log)

        JobRecords.__init__(self)
        WorkerGroup.__init__(self)

        self.job: str | None = None
        self.supervisor: AgentSupervisor | None = None
        self.status = NodeJobStatus(node=node_id, state=JobState.IDLE)
        self._published: NodeJobStatus | None = None
        self._failures = 0
        self._next_start = 0.0
        self._stopping: threading.Thread | None = None
        self._finished: set[str] = set()  # jobs this node completed (exit 0) or gave up on
        # Jobs refused here (until their spec or control changes) or waiting for their files.
        self._holds = JobHolds()
        #: The job file checks, off the main loop (agent/job_check.py).
        self.checks = JobChecks(state_dir, self.clock)
        self._status_job: str | None = None
        self.on_job_end: list[Callable[[str], None]] = []  # called with the job's name
        self.notes: list[str] = []
        self.hold = ""  # why this node runs no job for now (a drain), or ""
        #: The job's newest committed (generation, step) (the daemon's replication view);
        #: None without replication: the newest step reported is used then.
        self.committed: Callable[[str], tuple[int, int] | None] = lambda job: None
        #: Records a cluster event (kind, detail, data): set by the daemon.
        self.record_event: Callable[[str, str, dict[str, Any]], None] = lambda *a: None
        #: The job's worker group restarts, counted for the crash-loop rule.
        self.restarts = RestartWatch(self.clock)

    # -- decisions ------------------------------------------------------------------------

    def view(self) -> job_rules.JobView:
        """The job records, reduced to what :mod:`elasticd.agent.job_rules` decides from."""
        created = {job: rev for job, (rev, _) in self.bad_specs.items()}
        created.update((job, rev) for job, (rev, _) in self.specs.items())
        return job_rules.JobView(
            created=created,
            desired={job: c.desired for job, c in self.controls.items()},
            reasons={job: c.reason for job, c in self.controls.items()},
            unreadable={job: why for job, (_, why) in self.bad_specs.items()},
            finished=frozenset(self._finished),
            succeeded_elsewhere=frozenset(j for j in self.statuses if self.succeeded_on(j)))

    def wanted(self, view: job_rules.JobView | None = None) -> str | None:
        """The job this node should run (:func:`job_rules.wanted`): the oldest wanted job it
        has not finished, none while the node is held out of jobs (e.g. drained). A job whose
        spec does not read is wanted too, to be refused (:meth:`_start`)."""
        now, busy = self.clock.monotonic(), self.job is not None
        return job_rules.wanted(
            view or self.view(), self.job, self.hold,
            held=lambda job: self._holds.held(job, self._records_of(job), now, busy))

    def refused(self) -> dict[str, str]:
        """Jobs whose spec this node cannot read, with why (for /status; at most 20)."""
        bad = sorted(self.bad_specs.items(), key=lambda kv: kv[1][0])[-20:]
        return {job: why for job, (_, why) in bad}

    def succeeded_on(self, job: str) -> list[str]:
        """Other nodes whose agent finished ``job`` with success.

        The job is over for this node too: torch closes the rendezvous when an agent
        succeeds, and a standby's agent (or one restarting) then exits with an error
        (RendezvousClosedError, or torch 2.13's AttributeError on a graceful exit) that is no
        reason to start it again.
        """
        return sorted(n for n, st in self.statuses.get(job, {}).items()
                      if n != self.node_id and st.state == JobState.SUCCEEDED)

    def step(self) -> None:
        """One cycle: follow etcd, start/stop/restart the agent, publish this node's status."""
        self.notes = []
        self._drain()
        if self._need_resync:
            self._before_resync()
            kvs, _ = self.coord.get_prefix(self.keys.jobs)
            self._reset(kvs)
        if self._stopping is not None:
            if self._stopping.is_alive():
                self._publish()
                return
            self._stopping = None
        self._end_if_decided_elsewhere(self.view())
        view = self.view()  # again: a job that ended above is finished now
        wanted = self.wanted(view)
        self._end_waiting()
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
        self._update_hang_timeout()
        self._publish()

    def _end_if_decided_elsewhere(self, view: job_rules.JobView) -> None:
        """A job this node was about to restart (its agent died) succeeded on peers meanwhile,
        or was failed (:func:`job_rules.decided_elsewhere`): record that here too rather than
        leave it 'restarting'."""
        job = self._status_job
        if self.job is not None or job is None or self.status.state != JobState.RESTARTING:
            return
        decided = job_rules.decided_elsewhere(view, job)
        if decided is None:
            return
        state, why = decided
        if state is JobState.SUCCEEDED:
            done = ", ".join(self.succeeded_on(job))
            why = f"job succeeded on {done}"
            note = f"job {job} succeeded on {done}; not restarting it here"
        else:
            note = f"job {job} failed: {why}"
        self._finished.add(job)
        self._set_status(state, why, agent_starts=self.status.agent_starts, log=self.status.log)
        self.notes.append(note)
        self._job_ended(job)

    def _job_ended(self, job: str) -> None:
        """Runs the job-end hooks (shared memory and replicas of the job are freed)."""
        for hook in self.on_job_end:
            try:
                hook(job)
            except Exception:
                log.exception("job-end hook failed for %s", job)

    def _start(self, job: str) -> None:
        now = self.clock.monotonic()
        if now < self._next_start:
            return
        if job in self.bad_specs:
            self._refuse(job, self.bad_specs[job][1])
            return
        _, spec = self.specs[job]
        verdict = self.checks.verdict(job, spec, self.controls.get(job), self.policy)
        if verdict is None:
            self.notes.append(f"checking job {job}'s files on this node")
            return
        if verdict.waiting:
            self._wait(job, verdict)
            return
        problem = verdict.problem or None
        try:
            extra_conf, extra_env = (self.credentials(spec) if self.credentials is not None
                                     and problem is None else ({}, {}))
        except AuthError as exc:
            problem = (f"cannot give its agent etcd credentials ({exc}): the daemons' etcd "
                       "user needs etcd's root role, or set agent_etcd_users = off")
        except CoordinationError:
            raise  # etcd trouble: the cycle reports it and the start is tried again
        except Exception as exc:  # noqa: BLE001 — whatever the spec holds, refuse, not crash
            problem = f"cannot check the job on this node: {exc}"
        if problem is not None:
            self._refuse(job, problem)
            return
        log_dir = os.path.join(self.state_dir, "jobs", job)
        self.restarts.agent_starting(job, os.path.join(log_dir, "torchrun"))
        tag = f"{self.keys.prefix}:{self.node_id}:{job}:{self._incarnation}"
        supervisor = AgentSupervisor(
            spec, self.node_id, tag=tag, etcd=self.etcd,
            prefix=self.keys.prefix, log_dir=log_dir,
            extra_env={**self._extra_env(), **extra_env},
            rdzv_conf={**self.rdzv_conf, **extra_conf}, warm=self.warm_workers, clock=self.clock)
        try:
            pid = supervisor.start()
        except (OSError, subprocess.SubprocessError) as exc:
            # e.g. the job's user may not run the interpreter after all (PermissionError
            # from exec): this job cannot run here; the daemon goes on.
            supervisor.stop(grace=1.0)
            self._refuse(job, f"cannot start its agent: {exc}")
            return
        self.supervisor = supervisor
        self.job = self._status_job = job
        self._new_generation()
        self.restarts.agent_started(supervisor.log_size())
        self._set_status(JobState.RUNNING, "agent started", agent_pid=pid, agent_starts=1,
                         log=self.supervisor.log_path)
        self.notes.append(f"started job {job} (agent pid {pid})")

    def _records_of(self, job: str) -> tuple[Any, Any]:
        """The spec (or why it does not read) and the control a refusal of ``job`` is tied to."""
        spec = self.specs.get(job)
        return (spec[1] if spec else self.bad_specs.get(job, (0, ""))[1],
                self.controls.get(job))

    def _refuse(self, job: str, problem: str) -> None:
        self._set_status(JobState.REFUSED, problem)
        self._status_job = job
        self._holds.refuse(job, self._records_of(job))
        self.notes.append(f"refused job {job}: {problem}")
        log.error("refusing job %s: %s", job, problem)
        self._publish(job)

    def _wait(self, job: str, verdict: Verdict) -> None:
        """``job``'s files are not on this node yet: say so, and check again in
        :data:`WAIT_RETRY` seconds if no other job runs here by then."""
        self._holds.wait(job, self._records_of(job), self.clock.monotonic() + WAIT_RETRY)
        detail = f"waiting: {verdict.problem}"
        if (self._status_job, self.status.detail) != (job, detail):
            log.warning("job %s: %s", job, verdict.problem)
        self._status_job = job
        self._set_status(JobState.IDLE, detail)
        self.notes.append(f"job {job} {detail}")
        self._publish(job)

    def _end_waiting(self) -> None:
        """A job this node was waiting for (its files not deployed yet) is no longer wanted
        (stopped, deleted, the node drained): its status says so rather than waiting for ever."""
        def wanted(job: str) -> bool:
            control = self.controls.get(job)
            return (job in self.specs and not self.hold
                    and (control is None or control.desired == JobState.RUNNING))

        for job in self._holds.end_waits(wanted):
            if job == self._status_job and self.job is None:
                self._set_status(JobState.STOPPED, f"job {job} is no longer wanted here")
                self._publish(job)
            else:  # another job's status is this node's now: the waiting one goes
                with contextlib.suppress(CoordinationError):
                    self.coord.delete(self.keys.job_node(job, self.node_id))

    def _check_agent(self) -> None:
        sup = self.supervisor
        assert sup is not None and self.job is not None
        code = sup.poll()
        if code is None:
            new = self.restarts.new_attempts(os.path.join(sup.log_dir, "torchrun"))
            if new:
                # torchrun restarted the worker group (its restart count went up), maybe more
                # than once since the last look: each restart with the failure the log shows.
                self._restart_seen(times=new)
                if self._crash_looping():
                    return
            hang = self.tracker.check(self.job) if self.tracker is not None else None
            if hang is not None:
                self.tracker.restarted_for(hang)  # a learned timeout that fired is doubled
                self.on_hang(str(hang))
            return
        done = self.succeeded_on(self.job)
        if code != 0 and not done:
            self._failures += 1
            self.metrics.worker_restarts.labels("agent_died").inc()
            self._restart_seen(f"agent exited with {code}")
            if self._crash_looping():
                return
        verdict = job_rules.agent_exited(code, bool(done), self._failures, self.agent_restarts)
        if verdict is job_rules.AgentExit.SUCCEEDED:
            self.notes.append(f"job {self.job} finished on this node")
            self._stop_async(f"job {self.job} succeeded", JobState.SUCCEEDED)
            return
        if verdict is job_rules.AgentExit.SUCCEEDED_ELSEWHERE:
            self.notes.append(f"job {self.job} succeeded on {', '.join(done)}; this node's "
                              f"agent exited {code}")
            self._stop_async(f"job {self.job} succeeded on {', '.join(done)}", JobState.SUCCEEDED)
            return
        if verdict is job_rules.AgentExit.GIVE_UP:
            self.notes.append(f"job {self.job}: agent failed {self._failures} times; giving up")
            self._stop_async(f"agent exited {code} too often", JobState.FAILED)
            return
        backoff = job_rules.restart_backoff(self._failures)
        self.notes.append(f"job {self.job}: agent exited with {code}; restarting in "
                          f"{backoff:.1f} s ({self._failures}/{self.agent_restarts})")
        sup.stop(grace=1.0)  # leftovers of the dead agent, if any
        self._next_start = self.clock.monotonic() + backoff
        job = self.job
        self.job, self.supervisor = None, None  # the tracker stays: the job is restarted
        self._set_status(JobState.RESTARTING, f"agent exited with {code}", agent_starts=sup.starts,
                         log=sup.log_path)
        self._publish(job)

    # -- crash loops ----------------------------------------------------------------------

    def _restart_seen(self, fallback: str = "", times: int = 1) -> None:
        """A worker group restart (torchrun's, or the daemon's of a dead agent), or ``times``
        of them seen at once (:meth:`RestartWatch.restarted`)."""
        sup, job = self.supervisor, self.job
        if sup is None or job is None:
            return
        self.restarts.restarted(sup.log_size(), sup.log_tail, self.committed(job), fallback,
                                times)

    def _crash_looping(self) -> bool:
        """Fails the job everywhere when it crash-loops; returns True if it did."""
        job = self.job
        if job is None or job not in self.specs:
            return False
        reason = self.restarts.verdict(self.specs[job][1].crash_loop_restarts)
        if reason is None:
            return False
        log.error("job %s: %s; stopping it on every node", job, reason)
        self.metrics.crash_loops.inc()
        self.notes.append(f"job {job} failed: {reason}")
        try:
            self.coord.put(self.keys.job_control(job),
                           JobControl(JobState.FAILED, self.clock.wall(), self.node_id,
                                      reason).encode())
        except CoordinationError as exc:
            log.warning("could not mark job %s failed in etcd: %s", job, exc)
        self.record_event("job_failed", f"{job}: {reason}",
                          {"job": job, "reason": reason, "restarts": self.restarts.loop.restarts})
        self._stop_async(reason, JobState.FAILED)
        return True

    # -- actions from the daemon ----------------------------------------------------------

    def fence(self, reason: str) -> None:
        """Stops everything at once (the node was declared dead)."""
        if self.supervisor is not None:
            self.supervisor.stop(grace=1.0)
            self.notes.append(f"stopped job {self.job}: {reason}")
            self._set_status(JobState.STOPPED, f"fenced: {reason}")
            self.job, self.supervisor = None, None

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
        if self.supervisor is not None:
            job = self.job
            self.supervisor.stop(self.stop_grace)
            self._set_status(JobState.STOPPED, "daemon shut down")
            self._publish(job)
            self.job, self.supervisor = None, None
        self.close()

    def _stop_async(self, why: str, final_state: JobState) -> None:
        sup, job = self.supervisor, self.job
        if final_state in (JobState.SUCCEEDED, JobState.FAILED):
            self._finished.add(job)  # over for this node; a stopped or drained job may return
        elif final_state is JobState.REFUSED and job is not None:
            self._holds.refuse(job, self._records_of(job))
        if sup is None:
            self.job = None
            return
        # A straggler's verdict stays on its stopped status: why it was drained, for instance.
        straggler = self.status.straggler
        self._set_status(JobState.STOPPING, why, agent_pid=sup.pid, agent_starts=sup.starts,
                         log=sup.log_path, straggler=straggler)
        self._publish(job)

        def run() -> None:
            code = sup.stop(self.stop_grace)
            self._job_ended(job)
            self._set_status(final_state, f"{why} (agent exit {code})", agent_starts=sup.starts,
                             log=sup.log_path, straggler=straggler)
            with contextlib.suppress(CoordinationError):
                self._publish(job)

        self.job, self.supervisor, self.tracker, self._report = None, None, None, None
        self._tracker_job = None
        self._stopping = threading.Thread(target=run, name=f"stop-{job}", daemon=True)
        self._stopping.start()

    # -- status ---------------------------------------------------------------------------

    def _set_status(self, state: JobState, detail: str, **fields: Any) -> None:
        self.status = NodeJobStatus(self.node_id, state, detail, at=self.clock.wall(), **fields)

    def _publish(self, job: str | None = None) -> None:
        job = job or self.job or self._status_job
        lease = self._lease()
        # The step moves every training step: publish it with the next real change (or the
        # daemon's heartbeat), not one etcd write per step.
        same = (self._published is not None and
                dataclasses.replace(self.status, last_step=0, at=0) ==
                dataclasses.replace(self._published, last_step=0, at=0))
        # ``hang_timeout`` is rounded to two significant digits (worker_group._show_timeout):
        # a learned one that drifts by a few percent is no write.
        if job is None or not lease or same:
            return
        self.coord.put(self.keys.job_node(job, self.node_id), self.status.encode(), lease)
        self._published = self.status

    def set_unprotected(self, text: str) -> None:
        """What the checkpoint service says of the job's protection ("" while protected),
        published with the node's job status (``elasticctl jobs``)."""
        with self._lock:
            if text != self.status.unprotected:
                self.status = dataclasses.replace(self.status, unprotected=text)

    def describe(self) -> dict[str, Any]:
        sts = {**self.statuses.get(self.job, {}), self.node_id: self.status} if self.job else {}
        return {"job": self.job, **self.status.as_dict(), "progress": self.progress_status(),
                "refused_specs": self.refused(),
                # every node's own verdict, as published (agent/straggler.py)
                "stragglers": {n: st.straggler for n, st in sorted(sts.items()) if st.straggler},
                "straggler_detection": self.straggler_detection()}

    def straggler_detection(self) -> str:
        """Whether this node's straggler verdict means anything, in words ("" without a job).

        The judge compares compute time outside collectives, which only a script that uses
        ``ComputeTimer`` reports: without it nobody is ever named, and that must not look like
        a healthy "no stragglers".
        """
        if self.job is None:
            return ""
        if self.status.compute_seconds > 0:
            return "on"
        if self.tracker is None:
            return "off: hang detection is off for this job (straggler detection needs it)"
        if self.status.last_step < 1:
            return "waiting for the first step"
        return ("off: the training script reports no compute time (wrap the model with "
                "elasticd.worker.compute_time.ComputeTimer; docs/jobs.md, Stragglers)")
