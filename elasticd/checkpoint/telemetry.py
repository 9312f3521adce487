"""What the checkpoint service tells the daemon's metrics.

The service never defines Prometheus objects itself (every metric lives in
:mod:`elasticd.metrics`): it calls an optional sink with events (:class:`CheckpointMetrics`,
for histograms and labelled counters) and offers plain numbers through
``CheckpointService.stats()`` (for gauges and totals a custom collector reads at scrape time).
The metric names are defined once, there. No labels carry a job, step or rank: a node runs one
job at a time (docs/architecture.md, "Jobs"), and per-step labels would explode cardinality.
No torch.
"""

from __future__ import annotations

from typing import Protocol

#: Restore sources, the values of the ``source`` label.
RESTORE_SOURCES = ("local", "peer", "persistent", "none")
#: Why a snapshot was skipped, the values of the ``reason`` label.
SKIP_REASONS = ("over_budget", "busy", "commit_pending")


class CheckpointMetrics(Protocol):
    """Events the service reports (implement any subset; missing methods are skipped)."""

    def snapshot_completed(self, job: str, rank: int, step: int, nbytes: int,
                           stall_seconds: float) -> None: ...
    def snapshot_skipped(self, job: str, reason: str) -> None: ...
    def snapshot_refused(self, job: str, source: str) -> None: ...
    def restored(self, job: str, source: str, seconds: float, steps_lost: int,
                 nbytes: int) -> None: ...
    def persisted(self, job: str, step: int, seconds: float, nbytes: int, ok: bool) -> None: ...
