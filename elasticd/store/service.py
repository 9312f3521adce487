"""The daemon's checkpoint service: what workers call, over the local socket, to snapshot and
restore.

A worker asks for a slot (``ckpt_reserve``), copies its state into it, writes the unsealed
header JSON into the slot's header area and says so (``ckpt_complete``); the service reads and
validates that header, computes the xxh3 block checksums and seals the snapshot — on the
daemon's thread, so checksums never stall the training loop. Over the memory cap a snapshot is
skipped, never an error: the worker gets ``{"skip": true}``, the job is marked unprotected, one
warning is logged per job and a counter goes up. At restore, workers list what is held
(``ckpt_list``), open a snapshot read-only (``ckpt_open``: verified here first, pinned until
``ckpt_release``) and report where they restored from (``ckpt_report``).

When every local rank has completed a step, the step is offered to the :class:`Persister`;
when the job's snapshots are committed (peer replication), each commit learned is offered
instead, so that every node flushes the same steps and they complete on the shared tier.
A worker never opens a slot file by path: it maps the descriptor that comes with the reply
(``_fds``; why: docs/security.md, "Snapshots are reached through descriptors"), read-write for
``ckpt_reserve``, read-only for ``ckpt_open`` and ``ckpt_fetch``. Daemon side: no torch.

Ops, request fields → reply fields: :mod:`~elasticd.store.service_snapshots` and
:mod:`~elasticd.store.service_restores`, parts the service owns that keep their per-job state
in its :class:`~elasticd.store.service_records.JobBook`, under its lock.

With a :class:`~elasticd.recovery.replicator.Replicator`, every completed snapshot is
handed to it (``on_local_snapshot``) for replication to peers, and a restore that opens a new
generation (``ckpt_report`` with ``next_generation``) tells it (``start_generation``).

A ``ckpt_reserve`` with a step, and a ``register``, count as the worker's progress report: they
go to :attr:`CheckpointService.on_progress` (hang detection, the group's ranks), so a script
that checkpoints needs no :func:`elasticd.worker.progress` call. Each job's protection is
assessed every daemon cycle (:mod:`elasticd.store.protection`); ``ckpt_reserve`` and
``register`` replies carry ``unprotected`` (the reason) while it lasts, so workers warn too.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from elasticd.store.api import Replication
from elasticd.store.protection import REASONS, JobView, assess
from elasticd.store.read_pins import ReadPins
from elasticd.store.service_records import JobBook, ServiceDeps
from elasticd.store.service_restores import Restores
from elasticd.store.service_snapshots import Snapshots
from elasticd.store.shm import SlotStore
from elasticd.store.telemetry import CheckpointStats
from elasticd.clock import Clock, SystemClock
from elasticd.persistence.persister import Persister

log = logging.getLogger(__name__)


class CheckpointService:
    """Serves the checkpoint ops for one node.

    Args:
        store: the node's slot store (after :meth:`SlotStore.scan` on a restart).
        node_id: this node, for log lines.
        persist: the persistent tier's flusher, or None.
        metrics_sink: optional :class:`~elasticd.store.telemetry.CheckpointMetrics`.
        pin_ttl: a read pin not released within this many seconds (its worker died) is dropped.
        replicator: the node's :class:`~elasticd.recovery.replicator.Replicator`, or None
            (no peer replication: ``ckpt_committed`` says nothing is committed and
            ``ckpt_fetch`` finds only what this node holds).
        lag_limit: steps the committed step may lag the newest snapshot before the job counts
            as unprotected.
        grace: seconds after a job's first snapshot here before a missing placement or
            commit counts as unprotected (the group's ranks are being published meanwhile).
        persist_recheck: a job is called ``persist_stale`` only on a listing of the tier at
            most this many seconds old (asked of the persister's writer, not made here).
    """

    def __init__(self, store: SlotStore, node_id: str, persist: Persister | None = None,
                 metrics_sink: Any = None, clock: Clock | None = None,
                 pin_ttl: float = 600.0, replicator: Replication | None = None, lag_limit: int = 100,
                 grace: float = 10.0, persist_recheck: float = 30.0) -> None:
        self.store, self.node_id, self.persist = store, node_id, persist
        self.replicator = replicator
        self.lag_limit, self.grace, self.persist_recheck = lag_limit, grace, persist_recheck
        #: Called with each progress-like message (``register``, ``ckpt_reserve`` with a
        #: step): job, rank, world_size, [step], [restart], [local_rank], _peer.
        self.on_progress: list[Callable[[dict[str, Any]], None]] = []
        self.sink, self.clock = metrics_sink, clock or SystemClock()
        self.book = JobBook()
        self.counters = self.book.counters
        #: Called with each restore report (after it is logged), e.g. to record an event.
        self.on_restore: list[Callable[[dict[str, Any]], None]] = []
        self.pins = ReadPins(self.clock, pin_ttl)
        #: The restore side (``ckpt_list``, ``ckpt_open``, ``ckpt_fetch``, ...).
        deps = ServiceDeps(store, persist, replicator, node_id, self.clock, metrics_sink)
        self.restores = Restores(self.book, self.pins, deps, self.on_restore)
        #: The snapshot side (``ckpt_reserve``, ``ckpt_complete``, ``register``) and its pause.
        self.snapshots = Snapshots(self.book, self.pins, deps, self.on_progress, self.assess)
        for job, rank, gen, step in store.holdings():  # adopted after a daemon restart
            record = self.book.jobs[job]
            record.reached((gen, step))

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """Op name → handler, for :class:`~elasticd.daemon.local_api.LocalServer`."""
        return {**self.snapshots.handlers(), **self.restores.handlers()}

    # -- housekeeping and status ----------------------------------------------------------

    def remove_job(self, job: str) -> None:
        """Drops the job's slots, pins and records (its persisted steps stay)."""
        with self.book.lock:
            self.book.jobs.pop(job, None)
        self.pins.sweep(job)
        self.restores.handed.cut_off_job(job)
        self.store.remove_job(job)

    def assess(self) -> None:
        """Re-assesses every job's protection (once per daemon cycle); logs each change. Also
        lets go of restore scratch kept past its time."""
        self.store.scratch.sweep()
        try:
            replication = self.replicator.status()["jobs"] if self.replicator else {}
        except Exception:  # noqa: BLE001 — status must not fail over replication
            log.exception("cannot read the replication status")
            replication = {}
        now = self.clock.monotonic()
        changes = []
        with self.book.lock:
            for job, record in self.book.jobs.items():
                rep = replication.get(job) or {}
                committed = rep.get("committed")
                view = JobView(
                    failing=next(iter(record.failing.values()), ""), newest=record.progress,
                    replicated=self.replicator is not None,
                    placement=bool(rep.get("placement")),
                    committed=tuple(committed) if committed else None,
                    lag=int(rep.get("sync_lag") or 0),
                    seconds=0.0 if record.first_snapshot_at is None
                    else now - record.first_snapshot_at, **self._persist_view(job, record, now))
                verdict = assess(view, self.lag_limit, self.grace)
                old = record.protection
                if verdict is not None and verdict.reason == "persist_stale" \
                        and not self.persist.listed(job, self.persist_recheck):
                    # This node may only have missed the manifests its peers wrote: the
                    # writer lists the tier first, and the verdict waits for that.
                    verdict = old if old is not None and old.reason == verdict.reason else None
                if (verdict and verdict.reason) != (old and old.reason):
                    changes.append((job, old, verdict))  # logged once per change of reason
                record.protection = verdict
        for job, old, new in changes:
            if new is not None:
                log.warning("job %s is %s (node %s)", job, new, self.node_id)
            else:
                log.warning("job %s is protected again on node %s (was: %s)", job,
                            self.node_id, old.detail if old else "")

    def _persist_view(self, job: str, record: Any, now: float) -> dict[str, Any]:
        """The persistent tier's facts of :class:`JobView` (none without a tier flushed every
        K steps or T seconds). Call with the book's lock held."""
        persist, progress = self.persist, record.progress
        if persist is None or not (persist.every_steps or persist.every_seconds) \
                or progress is None:
            return {}
        persisted = persist.persisted(job)
        if persisted != record.persist_seen:  # a new complete step: the clock starts again
            record.persist_seen, record.unpersisted_since = persisted, None
        # A tier step newer than the job is an older run's (the job's name used again).
        base = persisted[1] if persisted is not None and persisted <= progress \
            else record.first_step
        behind = max(0, progress[1] - (progress[1] if base is None else base))
        if behind and record.unpersisted_since is None:
            record.unpersisted_since = now
        elif not behind:
            record.unpersisted_since = None
        return {"persist_every_steps": persist.every_steps or 0,
                "persist_every_seconds": persist.every_seconds or 0.0,
                "persisted": persisted, "unpersisted_steps": behind, "grid": record.grid,
                "unpersisted_seconds": 0.0 if record.unpersisted_since is None
                else now - record.unpersisted_since}

    def status(self) -> dict[str, Any]:
        """Per job: each rank's latest (generation, step) held, bytes held, unprotected flag,
        reason (a metrics label) and detail, newest persisted step, progress and the last
        restore (protection re-assessed first)."""
        self.assess()
        out: dict[str, Any] = {}
        holdings = self.store.holdings()
        with self.book.lock:
            for job, record in sorted(self.book.jobs.items()):
                ranks = {str(r): [g, s] for j, r, g, s in holdings if j == job}
                persisted = self.persist.persisted(job) if self.persist else None
                out[job] = {
                    "ranks": ranks,
                    "bytes": sum(record.nbytes.get(int(r), 0) for r in ranks),
                    "unprotected": record.protection is not None,
                    "unprotected_reason": record.protection.detail if record.protection else "",
                    "unprotected_kind": record.protection.reason if record.protection else "",
                    "persisted": persisted and list(persisted),
                    "progress": record.progress and list(record.progress),
                    "last_restore": record.last_restore,
                    "scratch": {"bytes": self.store.scratch.held(job),
                                "cap": self.store.scratch.job_cap,
                                "refused": record.scratch_refused},
                    # Replication sessions handed to the job's workers (a reshard's direct
                    # fetch), live until the worker's fetch ends them or their deadline.
                    "handed_sessions": self.restores.handed.live(job),
                }
        return out

    def stats(self) -> CheckpointStats:
        """Plain numbers for the daemon's metrics (:mod:`elasticd.metrics` sets its gauges
        from them once per daemon cycle)."""
        status = self.status()
        steps = [s for job in status.values() for _, s in job["ranks"].values()]
        return CheckpointStats(
            snapshot_bytes=sum(job["bytes"] for job in status.values()),
            snapshot_step=min(steps) if steps else -1,
            local_slot_bytes=self.store.bytes_held(),
            scratch_bytes=self.store.scratch.held(),
            unprotected_jobs={reason: sum(job["unprotected_kind"] == reason
                                          for job in status.values()) for reason in REASONS},
            persisted_step=max((j["persisted"][1] for j in status.values() if j["persisted"]),
                               default=-1))
