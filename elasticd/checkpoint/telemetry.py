"""What the checkpoint service tells the daemon's metrics, and the metric names it recommends.

The service never defines Prometheus objects itself (every metric lives in
:mod:`elasticd.metrics`): it calls an optional sink with events (:class:`CheckpointMetrics`,
for histograms and labelled counters) and offers plain numbers through
``CheckpointService.stats()`` (for gauges and totals a custom collector reads at scrape time).
:data:`RECOMMENDED` lists the metrics to define, with their type and where the value comes
from. No labels carry a job, step or rank: a node runs one job at a time (docs/architecture.md, "Jobs"), and
per-step labels would explode cardinality. No torch.
"""

from __future__ import annotations

from typing import Any, Protocol

#: Restore sources, the values of the ``source`` label.
RESTORE_SOURCES = ("local", "peer", "persistent", "none")
#: Why a snapshot was skipped, the values of the ``reason`` label.
SKIP_REASONS = ("over_budget", "busy", "commit_pending")

#: metric name -> (type, help, where the value comes from).
RECOMMENDED: dict[str, tuple[str, str, str]] = {
    "elasticd_snapshot_stall_seconds": (
        "histogram", "Time the training loop waited for one snapshot (save and optimizer hook)",
        "sink.snapshot_completed(stall_seconds)"),
    "elasticd_snapshots_total": ("counter", "Snapshots sealed in this node's RAM",
                                 "sink.snapshot_completed / stats()['snapshots_total']"),
    "elasticd_snapshot_bytes": ("gauge", "Bytes of the latest snapshot of every local rank",
                                "stats()['snapshot_bytes']"),
    "elasticd_snapshot_step": ("gauge", "Newest step every local rank holds in RAM",
                               "stats()['snapshot_step']"),
    "elasticd_snapshots_skipped_total": (
        "counter", "Snapshots skipped, by reason (over_budget: the memory cap; busy: slot "
        "pinned by a reader; commit_pending: both slots hold copies awaiting or holding the "
        "commit)", "sink.snapshot_skipped(reason)"),
    "elasticd_jobs_unprotected": (
        "gauge", "Jobs a node failure now would set back further than it should, by reason "
        "(snapshots_failing, no_placement, commit_lag)", "stats()['unprotected_jobs'][reason]"),
    "elasticd_snapshots_refused_total": (
        "counter", "Corrupt or truncated snapshots refused at restore, by source",
        "sink.snapshot_refused(source)"),
    "elasticd_local_slot_bytes": ("gauge", "Bytes of shared-memory slot files holding this "
                                  "node's own ranks' snapshots", "stats()['replica_bytes_held']"),
    "elasticd_persisted_step": ("gauge", "Newest step complete on the persistent tier",
                                "stats()['persisted_step']"),
    "elasticd_persist_seconds": ("histogram", "Time to flush this node's ranks of one step",
                                 "sink.persisted(seconds)"),
    "elasticd_persists_total": ("counter", "Flushes to the persistent tier, by outcome "
                                "(ok, failed, skipped)", "sink.persisted(ok) / stats()"),
    "elasticd_restores_total": ("counter", "Worker restores, by source",
                                "sink.restored(source)"),
    "elasticd_restore_seconds": ("histogram", "Time one worker took to restore, by source",
                                 "sink.restored(seconds)"),
    "elasticd_restore_steps_lost": ("gauge", "Steps lost at the last restore",
                                    "sink.restored(steps_lost)"),
}


class CheckpointMetrics(Protocol):
    """Events the service reports (implement any subset; missing methods are skipped)."""

    def snapshot_completed(self, job: str, rank: int, step: int, nbytes: int,
                           stall_seconds: float) -> None: ...
    def snapshot_skipped(self, job: str, reason: str) -> None: ...
    def snapshot_refused(self, job: str, source: str) -> None: ...
    def restored(self, job: str, source: str, seconds: float, steps_lost: int,
                 nbytes: int) -> None: ...
    def persisted(self, job: str, step: int, seconds: float, nbytes: int, ok: bool) -> None: ...


class RecordingSink:
    """A sink that keeps every event as a tuple, for tests."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args: self.events.append((name, *args))
