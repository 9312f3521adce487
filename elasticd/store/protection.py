"""Whether a job's snapshots protect it on this node, and if not, why: pure decisions.

A job is protected when a node failure now would cost it at most a few steps: its snapshots
succeed, and (with peer replication on) a placement names the peers that hold copies and the
committed step keeps up with the newest snapshot; and (with a persistent tier flushed every K
steps or T seconds) the tier keeps getting complete steps — all the nodes flush the same steps,
else none completes. When it is not, the daemon says so loudly — ``UNPROTECTED: <detail>`` in
``elasticctl jobs`` and ``elasticctl checkpoints``, in ``/status``, in
``elasticd_jobs_unprotected{reason}`` (an alert rule fires on it) — and the workers warn,
learning it from the daemon's replies. :func:`assess` only decides; the checkpoint service
gathers the facts (:class:`JobView`) and reports the verdict. No torch.
"""

from __future__ import annotations

import dataclasses

__all__ = ["REASONS", "JobView", "Unprotected", "assess"]

#: Why a job is unprotected: the values of the ``reason`` label of elasticd_jobs_unprotected.
REASONS = ("snapshots_failing", "no_placement", "commit_lag", "persist_stale")


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
        persist_every_steps: the persistent tier's K (0: not flushed by steps).
        persist_every_seconds: its T (0.0: not flushed by time). Both 0: no tier, or one that
            takes whatever step its writer is free for, which promises no bound.
        persisted: the newest complete step on the tier (as the tier was last listed), or None.
        unpersisted_steps: steps the job's newest step is past ``persisted`` (or, with none
            complete yet, or one of an older run newer than the job, past the job's first
            step seen here).
        unpersisted_seconds: since the job first went past ``persisted`` here.
        grid: the most steps between two of the job's recent consecutive snapshots here (a flush
            due every K steps lands on the first snapshot at or after a multiple of K).
    """

    failing: str = ""
    newest: tuple[int, int] | None = None
    replicated: bool = False
    placement: bool = False
    committed: tuple[int, int] | None = None
    lag: int = 0
    seconds: float = 0.0
    persist_every_steps: int = 0
    persist_every_seconds: float = 0.0
    persisted: tuple[int, int] | None = None
    unpersisted_steps: int = 0
    unpersisted_seconds: float = 0.0
    grid: int = 0


def assess(view: JobView, lag_limit: int, grace: float) -> Unprotected | None:
    """Decides whether the job is unprotected (None: it is protected, or too young to say);
    ``lag_limit`` and ``grace`` as :class:`~elasticd.store.service.CheckpointService` takes them."""
    if view.failing:
        return Unprotected("snapshots_failing", f"snapshots failing: {view.failing}")
    if view.newest is None or view.seconds < grace:
        return None
    if view.replicated:
        verdict = _replication(view, lag_limit)
        if verdict is not None:
            return verdict
    return _persistence(view, lag_limit, grace)


def _replication(view: JobView, lag_limit: int) -> Unprotected | None:
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


def _persistence(view: JobView, lag_limit: int, grace: float) -> Unprotected | None:
    # How far the tier may fall behind: 3 flush periods of K or of the snapshot grid, plus the
    # commit lag allowed (flushes follow commits); 3 periods of T, plus the grace.
    k, t = view.persist_every_steps, view.persist_every_seconds
    steps = 3 * max(k, view.grid) + lag_limit if k else 0
    seconds = 3 * t + grace if t else 0.0
    if not steps and not seconds:
        return None
    # With both K and T a step is flushed when either is due: stale only past both bounds.
    if steps and view.unpersisted_steps <= steps:
        return None
    if seconds and (view.unpersisted_steps <= 0 or view.unpersisted_seconds <= seconds):
        return None
    have = f"step {view.persisted[1]}" if view.persisted else "none"
    since = " and ".join(
        ([f"{view.unpersisted_steps} steps (limit {steps})"] if steps else [])
        + ([f"{view.unpersisted_seconds:.0f} s (limit {seconds:g} s)"] if seconds else []))
    return Unprotected(
        "persist_stale", f"no new complete step on the persistent tier for {since}; newest "
        f"complete: {have}: the nodes' flushes do not complete a step (see `elasticctl "
        "checkpoints` and the daemons' persist log lines)")
