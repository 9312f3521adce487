"""Whether a job's snapshots protect it on this node, and if not, why: pure decisions.

A job is protected when a node failure now would cost it at most a few steps: its snapshots
succeed, and (with peer replication on) a placement names the peers that hold copies and the
committed step keeps up with the newest snapshot. When it is not, the daemon says so loudly —
``UNPROTECTED: <detail>`` in ``elasticctl jobs`` and ``elasticctl checkpoints``, in ``/status``,
in ``elasticd_jobs_unprotected{reason}`` (an alert rule fires on it) — and the workers warn,
learning it from the daemon's replies. :func:`assess` only decides; the checkpoint service
gathers the facts (:class:`JobView`) and reports the verdict. No torch.
"""

from __future__ import annotations

import dataclasses

__all__ = ["REASONS", "JobView", "Unprotected", "assess"]

#: Why a job is unprotected: the values of the ``reason`` label of elasticd_jobs_unprotected.
REASONS = ("snapshots_failing", "no_placement", "commit_lag")


@dataclasses.dataclass(frozen=True)
class Unprotected:
    """A job that a node failure now would set back further than it should.

    Attributes:
        reason: one of :data:`REASONS` (a metrics label).
        detail: one sentence for people: what is wrong and where to look.
    """

    reason: str
    detail: str

    def __str__(self) -> str:
        return f"UNPROTECTED: {self.detail}"


@dataclasses.dataclass(frozen=True)
class JobView:
    """What one node knows about a job's protection.

    Attributes:
        failing: why this node's last snapshot of some rank failed (skipped over the memory
            cap, refused), or why a rank's training state cannot be snapshotted at all (its
            worker's first save raised and said so), or "" when its snapshots succeed.
        newest: the newest (generation, step) snapshotted here, or None before any.
        replicated: peer replication is on (a cluster secret and ``replicas`` >= 2).
        placement: a replica placement for the job's current group is known.
        committed: the newest committed (generation, step), or None.
        lag: steps the committed step lags the newest snapshot here.
        seconds: since the job's first snapshot on this node (placement and the first commit
            take a moment after a (re)start).
    """

    failing: str = ""
    newest: tuple[int, int] | None = None
    replicated: bool = False
    placement: bool = False
    committed: tuple[int, int] | None = None
    lag: int = 0
    seconds: float = 0.0


def assess(view: JobView, lag_limit: int, grace: float) -> Unprotected | None:
    """Decides whether the job is unprotected (None: it is protected, or too young to say).

    Args:
        view: the facts.
        lag_limit: the most steps the committed step may lag the newest snapshot.
        grace: seconds after the first snapshot during which a missing placement or commit is
            expected (the group's ranks are being published), not a fault.
    """
    if view.failing:
        return Unprotected("snapshots_failing", f"snapshots failing: {view.failing}")
    if not view.replicated or view.newest is None or view.seconds < grace:
        return None
    if not view.placement:
        return Unprotected(
            "no_placement", "no replica placement: the daemons do not know every rank of the "
            "worker group, so no snapshot is copied to a peer (see `elasticctl placement`)")
    if view.lag > lag_limit:
        have = f"step {view.committed[1]}" if view.committed else "no step"
        return Unprotected(
            "commit_lag", f"{have} committed, {view.lag} steps behind the newest snapshot "
            f"(step {view.newest[1]}; limit {lag_limit}): replication is not keeping up "
            "(see `elasticctl checkpoints`)")
    return None
