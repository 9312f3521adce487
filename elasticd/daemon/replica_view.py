"""The daemon's view of peer replication: which round the replicator places replicas for,
and what it knows that other parts ask (the committed step, when a peer was last heard)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elasticd.agent.manager import JobManager

if TYPE_CHECKING:
    from elasticd.recovery.replicator import Replicator


class ReplicaView:
    """Keeps the replicator on the job's current round (owned by the daemon).

    Args:
        replicator: peer replication, or None when it is off (every answer is then empty).
    """

    def __init__(self, node_id: str, replicator: Replicator | None, jobs: JobManager) -> None:
        self._node = node_id
        self.replicator = replicator
        self._jobs = jobs
        self._round: Any = None  # the (job, nodes and ranks) the replicator was last given

    def follow_round(self) -> str | None:
        """Tells the replicator the job's current round: the nodes that run it, in rank
        order, with their ranks (as each node publishes them in its job status). Returns the
        cycle's note when the round changed."""
        job = self._jobs.job
        if self.replicator is None or job is None:
            return None
        ranks = self._jobs.round_ranks()
        if not ranks:
            return None
        if self._node not in ranks and not self._placed_here(job):
            return None
        # A round without this node, while the replicator still places it (declared dead
        # and fenced, or shrunk out), is given too: a commit term this node won before it
        # learned it was dead (a daemon woken from SIGSTOP campaigns at once as its
        # placement's first node) stayed on a placement no owner reports on, and nothing
        # committed again (CI: 15 s, the job's end, in the frozen-holder chaos test). Placed
        # without it, the term resigns and this node campaigns no more.
        nodes = sorted(ranks, key=lambda n: min(ranks[n]))
        key = (job, tuple((n, tuple(ranks[n])) for n in nodes))
        if key == self._round:
            return None
        self._round = key
        self.replicator.set_membership(job, nodes, {n: list(ranks[n]) for n in nodes})
        return f"replica placement for {len(nodes)} nodes"

    def _placed_here(self, job: str) -> bool:
        placement = self.replicator.tracker.view(job)[0] if self.replicator else None
        return placement is not None and self._node in placement.nodes

    def committed_step(self, job: str) -> tuple[int, int] | None:
        """The job's newest committed (generation, step) as replication last saw it."""
        c = self.replicator.tracker.view(job)[1] if self.replicator is not None else None
        return c.version if c is not None else None

    def last_heard(self, node: str) -> float | None:
        """When this node's replica server last heard from ``node`` (a sign of life)."""
        return self.replicator.last_heard(node) if self.replicator is not None else None

    def status(self) -> dict[str, Any] | None:
        if self.replicator is None:
            return None
        return {**self.replicator.status(), "round_ranks": self._jobs.round_ranks()}
