"""The job's current worker group, as this node's job manager sees it.

Workers report progress (``progress`` messages, and a Checkpointer's ``register`` and slot
requests, forwarded by the checkpoint service) to :meth:`WorkerGroup.on_progress`: the ranks it
learns are what replica placement is computed from (:meth:`WorkerGroup.round_ranks`), the steps
feed hang detection (:mod:`elasticd.agent.progress`, with a timeout the job sets or one learned
from its step times: :mod:`elasticd.agent.hang_timeout`). The group is restarted at once when it
hangs (:meth:`WorkerGroup.on_hang`) or when a peer that runs the job fails
(:meth:`WorkerGroup.on_peer_failed`: proactive abort, as a machine that loses power sends no TCP
reset and gloo would wait minutes), unless the job's last rendezvous round already went on
without that peer.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from elasticd.agent import job_rules
from elasticd.agent.hang_timeout import LearnedTimeout
from elasticd.agent.progress import ProgressTracker, progress_handler
from elasticd.agent.restart_watch import RestartWatch
from elasticd.agent.straggler import StragglerJudge
from elasticd.agent.supervisor import AgentSupervisor, process_runs
from elasticd.cluster import drain_record
from elasticd.clock import Clock
from elasticd.cluster.jobspec import JobSpec, JobState, NodeJobStatus
from elasticd.coordination.api import CoordinationError, Coordinator
from elasticd.coordination.keys import Keyspace
from elasticd.rendezvous.records import RecordError, RoundRecord, agent_pid
from elasticd.metrics import Metrics

log = logging.getLogger(__name__)


class WorkerGroup:
    """Progress, hangs and peer failures of the job's worker group (a base of
    :class:`~elasticd.agent.manager.JobManager`, which sets the attributes annotated here)."""

    node_id: str
    coord: Coordinator
    keys: Keyspace
    clock: Clock
    metrics: Metrics
    job: str | None
    supervisor: AgentSupervisor | None
    status: NodeJobStatus
    statuses: dict[str, dict[str, NodeJobStatus]]
    members: dict[str, set[str]]
    notes: list[str]
    specs: dict[str, tuple[int, JobSpec]]
    record_event: Callable[[str, str, dict[str, Any]], None]
    restarts: RestartWatch

    def __init__(self) -> None:
        self.tracker: ProgressTracker | None = None
        self._tracker_job: str | None = None  # the job the tracker (and what it learned) is of
        #: Whether a worker that reported still runs (a dead one is restarting, not hung).
        self.pid_alive: Callable[[int], bool] = process_runs
        self._report: Callable[[dict[str, Any]], None] | None = None
        self._restarted_at: float | None = None  # a worker group is (re)starting since then
        self._generations = 0
        self._lock = threading.Lock()  # progress arrives on the local API's threads
        self._group_restart: int | None = None  # the workers' TORCHELASTIC_RESTART_COUNT
        self._straggler: tuple[str, StragglerJudge] | None = None  # (job, its judge here)

    def _new_generation(self) -> None:
        """A worker group is (re)starting: hang detection starts over for it."""
        with self._lock:
            assert self.job is not None and self.supervisor is not None
            spec = self.supervisor.spec
            if self._tracker_job != self.job:
                # A tracker per job, kept while the job runs here (through the agent's own
                # restarts too): the learned step times and doublings are the job's.
                self.tracker, self._report, self._tracker_job = None, None, self.job
                alive = lambda pid: self.pid_alive(pid)  # noqa: E731 — tests swap pid_alive
                if spec.hang_timeout is None:
                    self.tracker = ProgressTracker(
                        LearnedTimeout(floor=spec.hang_timeout_floor,
                                       first_step=spec.hang_first_step), self.clock,
                        alive=alive)
                elif spec.hang_timeout > 0:
                    self.tracker = ProgressTracker(spec.hang_timeout, self.clock, alive=alive)
                if self.tracker is not None:
                    self._report = progress_handler(self.tracker, default_job=self.job)
            if self.tracker is not None:
                self.tracker.reset(self.job)
            self._restarted_at = self.clock.monotonic()
            self.status = dataclasses.replace(self.status, ranks=[])
            self._group_restart = None  # ranks were reset here; a new agent counts from 0

    def on_progress(self, msg: dict[str, Any]) -> None:
        """A worker's progress report (from the local API; any thread)."""
        with self._lock:
            if self.job is None or msg.get("job", self.job) != self.job:
                return
            if self._report is not None and "step" in msg:  # a register may carry no step
                self._report(msg)
            world = msg.get("world_size")
            if isinstance(world, int) and world > 0:
                self.metrics.world_size.set(world)
                if world != self.status.world_size:
                    self.status = dataclasses.replace(self.status, world_size=world, ranks=[])
            restart = msg.get("restart")
            if isinstance(restart, int) and (self._group_restart is None
                                             or restart > self._group_restart):
                # The agent restarted its workers on its own (a peer left the job cleanly,
                # e.g. drained): a new group whose ranks may have moved between nodes.
                if self._group_restart is not None:
                    self.status = dataclasses.replace(self.status, ranks=[])
                self._group_restart = restart
            rank = msg.get("rank")
            if isinstance(rank, int) and rank not in self.status.ranks:
                self.status = dataclasses.replace(self.status,
                                                  ranks=sorted([*self.status.ranks, rank]))
            step = msg.get("step")
            if isinstance(step, int) and step != self.status.last_step:
                self.status = dataclasses.replace(self.status, last_step=step)
            if isinstance(step, int):
                self.restarts.progress(step)
            if self._restarted_at is not None:
                self.metrics.rendezvous_seconds.observe(
                    self.clock.monotonic() - self._restarted_at)
                self._restarted_at = None
                self._generations += 1
                self.metrics.rendezvous_round.set(self._generations)

    def round_ranks(self) -> dict[str, list[int]]:
        """The current worker group's nodes and their global ranks, once every node of it has
        published them (they agree on the world size and the ranks add up to it)."""
        if self.job is None:
            return {}
        sts = {**self.statuses.get(self.job, {}), self.node_id: self.status}
        world = self.status.world_size
        group = {n: st.ranks for n, st in sts.items()
                 if st.state == JobState.RUNNING and st.world_size == world and st.ranks}
        if not world or sorted(r for rs in group.values() for r in rs) != list(range(world)):
            return {}
        return group

    def progress_status(self) -> dict[str, Any]:
        with self._lock:
            return {} if self.tracker is None or self.job is None else self.tracker.status(self.job)

    def on_peer_failed(self, node: str) -> int | None:
        """A peer's lease expired: if it ran our job, restart our workers now.

        Returns:
            how many workers were killed; None when the peer did not run our job.
        """
        running = self.job is not None and self.supervisor is not None
        members = self.members.get(self.job, set()) if self.job is not None else set()
        decision = job_rules.peer_failed(running, node, members,
                                         lambda: self._reformed_without(node))
        if decision is job_rules.PeerFailure.NOT_OURS:
            return None
        # Counted either way: a group that went on without the peer was restarted by its agent.
        self.metrics.worker_restarts.labels("peer_failed").inc()
        if decision is job_rules.PeerFailure.LEFT_RUNNING:
            note = (f"peer {node} of {self.job} failed; its last rendezvous round already "
                    "went on without it: workers left running")
            self.notes.append(note)
            log.info("%s", note)
            return 0
        n = self.supervisor.restart_workers(f"peer {node} failed")
        self._new_generation()
        self.notes.append(f"restarted {n} workers of {self.job}: peer {node} failed")
        return n

    def _reformed_without(self, node: str) -> bool:
        """Whether the job's last closed rendezvous round has this node's agent in it and not
        ``node``'s.

        A peer killed outright resets its sockets: the survivors' workers fail at once, their
        agents re-rendezvous, and the round closes as soon as the dead agent's own rendezvous
        record expires, which is often before this daemon sees the node's lease expire. Aborting
        then would only stop the group that already re-formed without the peer (one more
        restore for nothing). A round that still has ``node``, no round, an unreadable one, or
        one this agent is not in (its member ids name agents by address and pid, see
        :func:`~elasticd.rendezvous.records.node_id`) all mean: abort, as a peer
        that vanished silently (power, network) leaves collectives hanging.
        """
        job = self.job
        assert job is not None and self.supervisor is not None
        peer = self.statuses.get(job, {}).get(node)
        mine, theirs = self.supervisor.pid, peer.agent_pid if peer else None
        if not mine or not theirs:
            return False
        try:
            kv = self.coord.get(self.keys.job_rdzv_round(job))
            last = RoundRecord.decode(kv.value) if kv is not None else None
        except (CoordinationError, RecordError) as exc:
            log.warning("job %s: cannot read the rendezvous round: %s", job, exc)
            return False
        pids = None if last is None else [agent_pid(m) for m in last.members]
        return job_rules.reformed_without(pids, mine, theirs)

    def recovery_writer(self, failed: str) -> str | None:
        """The node that writes the timeline of the job's recovery from ``failed``'s failure
        (:mod:`elasticd.daemon.recovery_timeline`): the lowest node id among the job's other
        nodes that ran workers (ranks, or a step, in their published status: a worker group
        restart empties the ranks for a moment, a step stays), else among its other nodes (a
        spare never ran any). Every survivor computes it from the same statuses in etcd."""
        if self.job is None:
            return None
        sts = {**self.statuses.get(self.job, {}), self.node_id: self.status}
        live = {n: st for n, st in sts.items()
                if n != failed and (n in self.members.get(self.job, set()) or n == self.node_id)}
        ran = [n for n, st in live.items() if _ran_workers(st)]
        return min(ran or live, default=None)

    def ran_workers(self, node: str) -> bool:
        """Whether ``node`` ran workers of our job (ranks, or a step, in its last published
        status); a spare that waited never did."""
        st = self.statuses.get(self.job, {}).get(node) if self.job is not None else None
        return st is not None and _ran_workers(st)

    def on_hang(self, reason: str) -> None:
        if self.supervisor is None:
            return
        n = self.supervisor.restart_workers(f"hang: {reason}")
        self.restarts.cause = f"hang: {reason}"
        self._new_generation()
        self.metrics.worker_restarts.labels("hang").inc()
        self.metrics.hangs.inc()
        self.notes.append(f"restarted {n} workers of {self.job}: hang ({reason})")

    def _update_hang_timeout(self) -> None:
        """The hang timeout in force: into the node's job status and the metric (and the
        node's compute time per step into its metric)."""
        seconds, source, compute = 0.0, "", None
        if self.job is not None and self.tracker is not None and self.supervisor is not None:
            seconds, source = self.tracker.timeout(self.job)
            compute = self.tracker.compute_seconds(self.job)
        self.metrics.hang_timeout_seconds.set(seconds)
        self.metrics.compute_seconds.set(float("nan") if compute is None else compute)
        shown = _show_timeout(seconds)
        with self._lock:
            if (shown, source) != (self.status.hang_timeout, self.status.hang_timeout_source):
                self.status = dataclasses.replace(self.status, hang_timeout=shown,
                                                  hang_timeout_source=source)
            published = _show_timeout(compute or 0.0)  # two digits: not a write per step
            if published != self.status.compute_seconds:
                self.status = dataclasses.replace(self.status, compute_seconds=published)
        self._judge_straggler(compute)

    def _judge_straggler(self, compute: float | None) -> None:
        """This node's straggler verdict (:mod:`elasticd.agent.straggler`) into its job status
        and metric; a node newly named is an event, and drained when the job asks for it."""
        job = self.job
        spec = self.specs[job][1] if job is not None and job in self.specs else None
        if job is None or spec is None or self.supervisor is None:
            self._straggler = None
            self.metrics.straggler.set(1 if self.status.straggler else 0)
            return
        if self._straggler is None or self._straggler[0] != job:
            self._straggler = (job, StragglerJudge(spec.straggler_factor, spec.straggler_steps))
        others = {n: st.compute_seconds for n, st in self.statuses.get(job, {}).items()
                  if n != self.node_id and st.state == JobState.RUNNING}
        step = self.status.last_step
        verdict = self._straggler[1].observe(step if step >= 0 else None, compute, others)
        self.metrics.straggler.set(1 if verdict.named else 0)
        with self._lock:
            newly = verdict.named and not self.status.straggler
            if verdict.text != self.status.straggler:
                self.status = dataclasses.replace(self.status, straggler=verdict.text)
        if not newly:
            return
        log.warning("job %s: this node is a straggler: %s", job, verdict.text)
        self.notes.append(f"{job}: {verdict.text}")
        drain = spec.straggler_drain and self._drain_straggler(job, spec.nnodes_min)
        self.record_event("straggler", f"{job}: {self.node_id} {verdict.text}"
                          f"{'; draining it' if drain else ''}",
                          {"job": job, "ratio": verdict.ratio, "compute_seconds": compute,
                           "step": step, "drain": drain})

    def _drain_straggler(self, job: str, nnodes_min: int) -> bool:
        """Asks for this node's drain (as ``elasticctl drain`` would) unless the job would
        fall below its minimum of nodes; returns whether it asked."""
        running = [n for n, st in self.statuses.get(job, {}).items()
                   if n != self.node_id and st.state == JobState.RUNNING]
        if len(running) < nnodes_min:
            log.warning("job %s: not draining straggler %s: %d other nodes run the job, its "
                        "minimum is %d", job, self.node_id, len(running), nnodes_min)
            return False
        try:
            drain_record.request(self.coord, self.keys, self.node_id, 120.0,
                                 f"straggler@{self.node_id}", self.clock.wall())
        except CoordinationError as exc:
            log.warning("job %s: could not ask for straggler %s's drain: %s", job,
                        self.node_id, exc)
            return False
        return True


def _show_timeout(seconds: float) -> float:
    """``seconds`` to two significant digits (what the node publishes; /status and the metric
    carry the exact value)."""
    return float(f"{seconds:.2g}") if seconds > 0 else 0.0


def _ran_workers(st: NodeJobStatus) -> bool:
    """A worker group restart empties a node's ranks for a moment; its step stays."""
    return bool(st.ranks) or st.last_step >= 0
