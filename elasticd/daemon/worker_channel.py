"""What a node's job processes reach their daemon through: the handlers of its local socket
(:mod:`elasticd.daemon.local_api`), and the environment that tells an agent and its workers
where that socket is."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from elasticd.agent.manager import JobManager
from elasticd.daemon.recovery_timeline import TimelineRecorder

if TYPE_CHECKING:
    from elasticd.store.service import CheckpointService

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Any]


class WorkerChannel:
    """The daemon's side of its workers' channel (owned by the daemon)."""

    def __init__(self, node_id: str, prefix: str, jobs: JobManager, timeline: TimelineRecorder,
                 checkpoints: CheckpointService | None,
                 record_event: Callable[[str, str, dict[str, Any]], None]) -> None:
        self._node = node_id
        self._prefix = prefix
        self._jobs = jobs
        self._timeline = timeline
        self._checkpoints = checkpoints
        self._record_event = record_event
        self.socket = ""  # path of the workers' channel to this daemon, once serving
        #: A worker's collective broke (``group_broke``): the daemon probes its job's peers
        #: (:mod:`.peer_probe`). Set by the daemon.
        self.on_group_broke: Callable[[str], object] | None = None

    def agent_env(self) -> dict[str, str]:
        """Environment the daemon adds for a job's agent and workers."""
        env = {"ELASTICD_PREFIX": self._prefix}
        if self.socket:
            env["ELASTICD_SOCKET"] = self.socket
        return env

    def handlers(self) -> dict[str, Handler]:
        """What workers may ask of this daemon over its local socket."""
        handlers: dict[str, Handler] = {
            "progress": self._on_progress,
            # The agent's daemon watch asks whether this daemon still answers.
            "ping": lambda msg: {"node": self._node},
            # The agent killed its workers (a member of its round is gone): a moment of the
            # recovery's timeline. The job is the connection's (local_binding.py).
            "workers_aborted": self._workers_aborted,
            # The agent of an in-process job re-formed its workers (kept, or restarted).
            "reformed": self._reformed,
            # A worker of an in-process job made its new group: its re-formation's moments.
            "reform_moments": self._timeline.on_reform_moments,
            # A worker's collective broke: a peer may be dead (daemon/peer_probe.py).
            "group_broke": self._group_broke,
        }
        if self._checkpoints is not None:
            handlers.update(self._checkpoints.handlers())
        return handlers

    def on_restore(self, report: dict[str, Any]) -> None:
        """A worker restored (``ckpt_report``): a ``recovered`` event for elasticctl history."""
        if report.get("source") in (None, "none"):
            return  # a first start with nothing to restore is no recovery
        r = report
        self._record_event(
            "recovered", f"{r['job']} rank {r['rank']} restored step {r['step']} from "
            f"{r['source']} in {r['seconds']:.3f} s, {r['steps_lost']} steps lost"
            f"{' (kept in-process)' if r.get('path') == 'in_process' else ''}",
            {k: r.get(k) for k in ("job", "rank", "source", "seconds", "steps_lost", "bytes",
                                   "generation", "step", "path")})

    def prepare_restore(self, job: str) -> str | None:
        """A node of ``job`` failed, so this node's workers of ``job`` restore once the new
        round forms: the checkpoint service sets the scratch of their partial copies aside now
        (in a thread of its own), touched while detection and the rendezvous run rather than
        during the restore. Returns the cycle's note, or None (nothing set aside)."""
        if self._checkpoints is None:
            return None
        try:
            nbytes = self._checkpoints.restores.membership_changed(job)
        except Exception:  # noqa: BLE001 — an optimisation: the restore reserves what it needs
            log.exception("%s: setting restore scratch aside failed", job)
            return None
        return f"{nbytes >> 20} MiB of restore scratch set aside" if nbytes else None

    def _on_progress(self, msg: dict[str, Any]) -> None:
        self._jobs.group.on_progress(msg)
        self._timeline.on_progress(msg)

    def _workers_aborted(self, msg: dict[str, Any]) -> None:
        job = msg.get("job", self._jobs.job)
        if isinstance(job, str) and job == self._jobs.job:
            self._timeline.on_abort(job, "agent")

    def _group_broke(self, msg: dict[str, Any]) -> None:
        job, why = msg.get("job", self._jobs.job), msg.get("why")
        if self.on_group_broke is not None and isinstance(job, str) and job == self._jobs.job:
            self.on_group_broke(why if isinstance(why, str) else "")

    def _reformed(self, msg: dict[str, Any]) -> None:
        self._jobs.reform.on_reformed(msg)
        self._timeline.on_reformed(msg)
