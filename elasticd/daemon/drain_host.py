"""The daemon's side of a drain (:class:`elasticd.recovery.drain.DrainHost`): what a drain asks
of this node's snapshots, replicas and jobs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from elasticd.agent.manager import JobManager
from elasticd.config import Settings
from elasticd.recovery.drain import Progress

if TYPE_CHECKING:
    from elasticd.recovery.replicator import Replicator
    from elasticd.store.service import CheckpointService


class DrainHosting:
    """The daemon as a drain's host (a base of :class:`~elasticd.daemon.daemon.Daemon`, which
    sets the attributes annotated here and the protocol's ``record_event``)."""

    settings: Settings
    jobs: JobManager
    checkpoints: CheckpointService | None
    replicator: Replicator | None
    wake: Callable[[], None]

    @property
    def replicates(self) -> bool:
        return self.replicator is not None

    def quiesce(self, timeout: float) -> bool:
        return self.checkpoints.quiesce(timeout) if self.checkpoints is not None else True

    def resume(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.resume()

    def handoff(self, timeout: float, progress: Progress | None) -> dict[str, dict[str, Any]]:
        if self.replicator is None:
            return {}
        # Our pushes in flight may still commit a step: let them land first (bounded).
        self.replicator.wait_idle(min(5.0, timeout))
        return self.replicator.drain(timeout, progress)

    def shortfall(self) -> dict[str, list[int]]:
        if self.replicator is None:
            return {}
        out = {}
        for job in list(self.replicator.tracker.jobs):
            c = self.replicator.committed(job)
            short = [] if c is None else [
                r for r in c.ranks
                if len([h for h in c.holders.get(r, ()) if h != self.settings.node_id]) < c.m]
            if short:
                out[job] = short
        return out

    def hold(self, reason: str | None) -> None:
        self.jobs.hold = reason or ""
        self.wake()

    def job_stopped(self) -> bool:
        return self.jobs.idle()
