"""The job's current worker group on this node: its agent, its progress, its hangs.

Workers report progress (``progress`` messages, and a Checkpointer's ``register`` and slot
requests, forwarded by the checkpoint service) to :meth:`WorkerGroup.on_progress`: the ranks it
learns go into the node's job status, from which replica placement is computed
(:func:`elasticd.agent.job_rules.round_ranks`); the steps feed hang detection
(:mod:`elasticd.agent.progress`, with a timeout the job sets or one learned from its step times:
:mod:`elasticd.cluster.learned_timeout`) and the crash-loop count
(:class:`RestartWatch`). The group is restarted at once when it hangs
(:meth:`WorkerGroup.restart_if_hung`) or when the job manager decides so for a failed peer
(:meth:`WorkerGroup.restart_workers`). Its other part: the straggler verdict
(:class:`StragglerWatch`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from elasticd.agent import crashloop, job_rules
from elasticd.agent.job_status import JobStatusBoard
from elasticd.agent.progress import ProgressTracker, progress_handler
from elasticd.agent.straggler import StragglerJudge
from elasticd.agent.supervisor import AgentSupervisor, process_runs
from elasticd.clock import Clock
from elasticd.cluster.jobspec import JobSpec, JobState, NodeJobStatus
from elasticd.cluster.learned_timeout import LearnedTimeout
from elasticd.coordination.api import CoordinationError
from elasticd.metrics import Metrics

log = logging.getLogger(__name__)


class WorkerGroup:
    """The running job's agent and worker group (owned by the job manager).

    Args:
        board: the node's job status, whose worker fields (ranks, world size, step, hang
            timeout, compute time) this group keeps.
        stragglers: this node's straggler verdict, asked once a cycle (:meth:`tick`).

    Attributes:
        job: the job whose agent runs here (None: none).
        restarts: the group's restarts, counted for the crash-loop rule.
        tracker: the job's hang detection (None: off), kept through the agent's restarts.
    """

    def __init__(self, board: JobStatusBoard, metrics: Metrics, clock: Clock,
                 stragglers: StragglerWatch) -> None:
        self._board = board
        self._metrics = metrics
        self._clock = clock
        self._stragglers = stragglers
        self.job: str | None = None
        self.supervisor: AgentSupervisor | None = None
        self.restarts = RestartWatch(clock)
        self.tracker: ProgressTracker | None = None
        self._tracker_job: str | None = None  # the job the tracker (and what it learned) is of
        self._report: Callable[[dict[str, Any]], None] | None = None
        self._restarted_at: float | None = None  # a worker group is (re)starting since then
        self._generations = 0
        self._lock = threading.Lock()  # progress arrives on the local API's threads
        self._group_restart: int | None = None  # the workers' TORCHELASTIC_RESTART_COUNT

    def attach(self, job: str, supervisor: AgentSupervisor) -> None:
        """``supervisor``'s agent of ``job`` started: its first worker group starts."""
        with self._lock:
            self.job, self.supervisor = job, supervisor
        self._new_generation()

    def detach(self, job_over: bool = False) -> None:
        """The agent is gone (stopped, or dead and to be restarted); ``job_over``: the job is
        over on this node too, what hang detection learned of it goes."""
        with self._lock:
            self.job, self.supervisor = None, None
            if job_over:
                self.tracker, self._report, self._tracker_job = None, None, None

    def _new_generation(self) -> None:
        """A worker group is (re)starting: hang detection starts over for it."""
        with self._lock:
            assert self.job is not None and self.supervisor is not None
            spec = self.supervisor.spec
            if self._tracker_job != self.job:
                # A tracker per job, kept while the job runs here (through the agent's own
                # restarts too): the learned step times and doublings are the job's.
                self.tracker, self._report, self._tracker_job = None, None, self.job
                alive = process_runs  # a worker that reported and died is restarting, not hung
                if spec.hang_timeout is None:
                    self.tracker = ProgressTracker(
                        LearnedTimeout(floor=spec.hang_timeout_floor,
                                       first_step=spec.hang_first_step), self._clock,
                        alive=alive)
                elif spec.hang_timeout > 0:
                    self.tracker = ProgressTracker(spec.hang_timeout, self._clock, alive=alive)
                if self.tracker is not None:
                    self._report = progress_handler(self.tracker, default_job=self.job)
            if self.tracker is not None:
                self.tracker.reset(self.job)
            self._restarted_at = self._clock.monotonic()
            self._board.edit(lambda st: {"ranks": []})
            self._group_restart = None  # ranks were reset here; a new agent counts from 0

    def on_progress(self, msg: dict[str, Any]) -> None:
        """A worker's progress report (from the local API; any thread)."""
        with self._lock:
            if self.job is None or msg.get("job", self.job) != self.job:
                return
            if self._report is not None and "step" in msg:  # a register may carry no step
                self._report(msg)
            world, step = msg.get("world_size"), msg.get("step")
            if isinstance(world, int) and world > 0:
                self._metrics.rendezvous.world_size.set(world)
            restart = msg.get("restart")
            regrouped = False
            if isinstance(restart, int) and (self._group_restart is None
                                             or restart > self._group_restart):
                # The agent restarted its workers on its own (a peer left the job cleanly,
                # e.g. drained): a new group whose ranks may have moved between nodes.
                regrouped = self._group_restart is not None
                self._group_restart = restart
            self._board.edit(lambda st: _progressed(st, world, regrouped, msg.get("rank"), step))
            if isinstance(step, int):
                self.restarts.progress(step)
            if self._restarted_at is not None:
                self._metrics.rendezvous.seconds.observe(
                    self._clock.monotonic() - self._restarted_at)
                self._restarted_at = None
                self._generations += 1
                self._metrics.rendezvous.round.set(self._generations)

    def restart_workers(self, why: str) -> int:
        """Kills the workers (their agent starts a new group); returns how many."""
        assert self.supervisor is not None
        n = self.supervisor.restart_workers(why)
        self._new_generation()
        return n

    def restart_if_hung(self) -> str | None:
        """Restarts the group if it hangs (:meth:`ProgressTracker.check`: no progress for the
        timeout in force; a learned timeout that fired is doubled). Returns a note, or None."""
        hang = self.tracker.check(self.job) if self.tracker is not None and self.job else None
        if hang is None:
            return None
        self.tracker.restarted_for(hang)
        self.restarts.cause = f"hang: {hang}"
        n = self.restart_workers(f"hang: {hang}")
        self._metrics.jobs.worker_restarts.labels("hang").inc()
        self._metrics.jobs.hangs.inc()
        return f"restarted {n} workers of {self.job}: hang ({hang})"

    def tick(self, spec: JobSpec | None, peers: dict[str, NodeJobStatus]) -> None:
        """Once a cycle: the hang timeout in force into the node's job status and the metric,
        the node's compute time per step into its metric, and the straggler verdict
        (``spec``: the running job's; ``peers``: every node's status for it)."""
        seconds, source, compute = 0.0, "", None
        if self.job is not None and self.tracker is not None and self.supervisor is not None:
            seconds, source = self.tracker.timeout(self.job)
            compute = self.tracker.compute_seconds(self.job)
        self._metrics.jobs.hang_timeout_seconds.set(seconds)
        self._metrics.jobs.compute_seconds.set(float("nan") if compute is None else compute)
        shown = show_seconds(seconds)
        published = show_seconds(compute or 0.0)  # two digits: not a write per step

        def change(st: NodeJobStatus) -> dict[str, Any]:
            fields: dict[str, Any] = {}
            if (shown, source) != (st.hang_timeout, st.hang_timeout_source):
                fields.update(hang_timeout=shown, hang_timeout_source=source)
            if published != st.compute_seconds:
                fields["compute_seconds"] = published
            return fields

        self._board.edit(change)
        running = self.job if self.supervisor is not None else None
        self._stragglers.observe(running, spec, compute, peers)

    def progress_status(self) -> dict[str, Any]:
        with self._lock:
            return {} if self.tracker is None or self.job is None else self.tracker.status(self.job)

    def straggler_detection(self) -> str:
        """Whether this node's straggler verdict means anything, in words ("" without a job).

        The judge compares compute time outside collectives, which only a script that uses
        ``ComputeTimer`` reports: without it nobody is ever named, and that must not look like
        a healthy "no stragglers".
        """
        status = self._board.status
        if self.job is None:
            return ""
        if status.compute_seconds > 0:
            return "on"
        if self.tracker is None:
            return "off: hang detection is off for this job (straggler detection needs it)"
        if status.last_step < 1:
            return "waiting for the first step"
        return ("off: the training script reports no compute time (wrap the model with "
                "elasticd.worker.compute_time.ComputeTimer; docs/jobs.md, Stragglers)")


def _progressed(st: NodeJobStatus, world: Any, regrouped: bool, rank: Any,
                step: Any) -> dict[str, Any]:
    """The status fields a progress report changes: a new world size or worker group starts
    the ranks over (they may have moved between nodes), a new rank joins them."""
    fields: dict[str, Any] = {}
    ranks = st.ranks
    if isinstance(world, int) and world > 0 and world != st.world_size:
        fields["world_size"], ranks = world, []
    if regrouped:
        ranks = []
    if isinstance(rank, int) and rank not in ranks:
        ranks = sorted([*ranks, rank])
    if ranks != st.ranks:
        fields["ranks"] = ranks
    if isinstance(step, int) and step != st.last_step:
        fields["last_step"] = step
    return fields


class RestartWatch:
    """Counts the restarts of the job this node runs (owned by the worker group).

    Two kinds are seen: torchrun's agent restarting its worker group (a new ``attempt_<n>`` in
    its run directory) and the daemon restarting an agent that died. Each is counted with the
    failure the agent's log shows since the last one (or the reason the daemon itself gave, a
    hang), and the job's newest committed step at that moment: the pure rule in
    :mod:`elasticd.agent.crashloop` decides from these whether the job crash-loops.

    Attributes:
        loop: the crash-loop rule's state for the job.
        cause: why the daemon itself restarted the workers last, if it did (a hang), until
            that restart is counted.
        runs_known: torchrun run directories of the agents before the current one.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.loop = crashloop.LoopState()
        self._job: str | None = None
        self._best_step = -1  # the newest step reported for the job (fallback watermark)
        self.runs_known: set[str] = set()
        self._attempt = 0  # the agent's worker group attempt (torchrun's restart count)
        self._log_mark = 0  # agent log size at the last restart seen
        self._attempt_at = 0.0  # when the current worker group attempt started (monotonic)
        self.cause = ""

    def agent_starting(self, job: str, run_dir: str) -> None:
        """An agent of ``job`` is about to start, its torchrun runs under ``run_dir``: a new job
        starts counting afresh; the same job keeps its count (an agent restarted after dying)."""
        if self._job != job:
            self.loop, self._job, self._best_step = crashloop.LoopState(), job, -1
        self.runs_known = crashloop.runs(run_dir)
        self._attempt = 0

    def agent_started(self, log_size: int) -> None:
        self._log_mark = log_size
        self._attempt_at = self._clock.monotonic()

    def progress(self, step: int) -> None:
        """A worker reported ``step`` (the watermark when nothing is committed)."""
        self._best_step = max(self._best_step, step)

    def new_attempts(self, run_dir: str) -> int:
        """How many worker group restarts torchrun made since the last look."""
        attempt = crashloop.attempts(run_dir, self.runs_known)
        new, self._attempt = max(0, attempt - self._attempt), max(attempt, self._attempt)
        return new

    def restarted(self, log_size: int, log_tail: Callable[[int], str],
                  committed: crashloop.Version | None, fallback: str = "", times: int = 1) -> None:
        """A worker group restart, or ``times`` of them seen at once: counts them. Restarts
        seen together share the failure the log shows since the last look: read for the first
        alone, the others counted as showing no traceback, and a job whose restarts came faster
        than the daemon's cycle was failed with that reason instead of its exception (CI: the
        crash-loop test, one run in two)."""
        text = log_tail(self._log_mark) if log_size > self._log_mark else ""
        self._log_mark = log_size
        failure = (self.cause or crashloop.failure_summary(text) or fallback
                   or crashloop.NO_TRACEBACK)
        self.cause = ""
        if committed is None and self._best_step >= 0:
            committed = (0, self._best_step)
        now = self._clock.monotonic()
        for _ in range(times):
            self.loop = crashloop.after_restart(self.loop, committed, failure,
                                                now - self._attempt_at)
        self._attempt_at = now

    def verdict(self, limit: int) -> str | None:
        """Why the job crash-loops (``limit`` restarts in a row without progress), or None."""
        return crashloop.verdict(self.loop, limit)


class StragglerWatch:
    """Judges this node against its job's other nodes, once a cycle (owned by the worker group).

    The verdict is :class:`elasticd.agent.straggler.StragglerJudge`'s (pure), from the compute
    times per step the nodes publish; it goes into the node's job status and the
    ``elasticd_straggler`` metric. A node newly named records a ``straggler`` event, and asks for
    its own drain when the job wants that and would keep its minimum of nodes
    (:func:`elasticd.agent.job_rules.drain_straggler`).

    Args:
        board: the node's job status (its ``straggler`` field).
        drain: asks for this node's drain, as ``elasticctl drain`` would (raises
            CoordinationError when etcd does not take it).
    """

    def __init__(self, board: JobStatusBoard, metrics: Metrics, drain: Callable[[], Any],
                 record_event: Callable[[str, str, dict[str, Any]], None],
                 note: Callable[[str], None]) -> None:
        self._board = board
        self._metrics = metrics
        self._drain = drain
        self._record_event = record_event
        self._note = note
        self._judge: tuple[str, StragglerJudge] | None = None  # (job, its judge here)

    def observe(self, job: str | None, spec: JobSpec | None, compute: float | None,
                peers: dict[str, NodeJobStatus]) -> None:
        """This cycle's verdict on ``job`` (None: no agent runs here), given this node's
        ``compute`` time per step and ``peers``' statuses (every node's: this one is left
        out)."""
        me = self._board.node_id
        if job is None or spec is None:
            self._judge = None
            self._metrics.jobs.straggler.set(1 if self._board.status.straggler else 0)
            return
        if self._judge is None or self._judge[0] != job:
            self._judge = (job, StragglerJudge(spec.straggler_factor, spec.straggler_steps))
        running = {n: st for n, st in peers.items()
                   if n != me and st.state == JobState.RUNNING}
        step = self._board.status.last_step
        verdict = self._judge[1].observe(step if step >= 0 else None, compute,
                                         {n: st.compute_seconds for n, st in running.items()})
        self._metrics.jobs.straggler.set(1 if verdict.named else 0)
        before = self._board.edit(lambda st: {"straggler": verdict.text}
                                  if verdict.text != st.straggler else {})
        if not verdict.named or before.straggler:
            return
        log.warning("job %s: this node is a straggler: %s", job, verdict.text)
        self._note(f"{job}: {verdict.text}")
        drain = job_rules.drain_straggler(spec.straggler_drain, len(running), spec.nnodes_min)
        if spec.straggler_drain and not drain:
            log.warning("job %s: not draining straggler %s: %d other nodes run the job, its "
                        "minimum is %d", job, me, len(running), spec.nnodes_min)
        if drain:
            try:
                self._drain()
            except CoordinationError as exc:
                log.warning("job %s: could not ask for straggler %s's drain: %s", job, me, exc)
                drain = False
        self._record_event("straggler", f"{job}: {me} {verdict.text}"
                           f"{'; draining it' if drain else ''}",
                           {"job": job, "ratio": verdict.ratio, "compute_seconds": compute,
                            "step": step, "drain": drain})


def show_seconds(seconds: float) -> float:
    """``seconds`` to two significant digits (what the node publishes: a learned timeout or a
    compute time that drifts by a few percent is no etcd write; /status and the metrics carry
    the exact value)."""
    return float(f"{seconds:.2g}") if seconds > 0 else 0.0
