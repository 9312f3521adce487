"""The node's side of a drain (:class:`elasticd.recovery.drain.DrainHost`): what a drain asks
of this node's snapshots, replicas and jobs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from elasticd.agent.manager import JobManager
from elasticd.recovery.drain import Progress

if TYPE_CHECKING:
    from elasticd.recovery.replicator import Replicator
    from elasticd.store.service import CheckpointService


class NodeDrainHost:
    """A drain's host on this node (owned by the daemon, handed to its drainer).

    Args:
        jobs: the node's job manager (held out of jobs while drained).
        checkpoints: the checkpoint service, if any (quiesced while replicas are handed off).
        replicator: peer replication, if on (the replicas to hand off).
        wake: wakes the daemon's loop (a hold takes effect at once).
    """

    def __init__(self, node_id: str, jobs: JobManager, checkpoints: CheckpointService | None,
                 replicator: Replicator | None, wake: Callable[[], None],
                 record_event: Callable[[str, str, dict[str, Any]], None]) -> None:
        self._node = node_id
        self._jobs = jobs
        self._checkpoints = checkpoints
        self._replicator = replicator
        self._wake = wake
        self.record_event = record_event

    @property
    def replicates(self) -> bool:
        return self._replicator is not None

    def quiesce(self, timeout: float) -> bool:
        return self._checkpoints.snapshots.quiesce(timeout) if self._checkpoints is not None else True

    def resume(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.snapshots.resume()

    def handoff(self, timeout: float, progress: Progress | None) -> dict[str, dict[str, Any]]:
        if self._replicator is None:
            return {}
        # Our pushes in flight may still commit a step: let them land first (bounded).
        self._replicator.wait_idle(min(5.0, timeout))
        return self._replicator.drain(timeout, progress)

    def shortfall(self) -> dict[str, list[int]]:
        if self._replicator is None:
            return {}
        out = {}
        for job in list(self._replicator.tracker.jobs):
            c = self._replicator.committed(job)
            short = [] if c is None else [
                r for r in c.ranks
                if len([h for h in c.holders.get(r, ()) if h != self._node]) < c.m]
            if short:
                out[job] = short
        return out

    def hold(self, reason: str | None) -> None:
        self._jobs.hold = reason or ""
        self._wake()

    def job_stopped(self) -> bool:
        return self._jobs.idle()
