"""What the checkpoint service tells the daemon's metrics.

The service never defines Prometheus objects itself (every metric lives in
:mod:`elasticd.metrics`): it calls an optional sink with events (:class:`CheckpointMetrics`,
for histograms and labelled counters) and offers plain numbers through
``CheckpointService.stats()``, a :class:`CheckpointStats` (for gauges, once per daemon cycle).
The metric names are defined once, there. No labels carry a job, step or rank: a node runs one
job at a time (docs/architecture.md, "Jobs"), and per-step labels would explode cardinality.
No torch.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

#: Restore sources, the values of the ``source`` label.
RESTORE_SOURCES = ("local", "peer", "persistent", "none")
#: How the restoring worker came to be: kept through an in-process re-formation, or started
#: (a restarted or new worker).
RESTORE_PATHS = ("in_process", "restart")


class CheckpointMetrics(Protocol):
    """Events the service reports (implement any subset; missing methods are skipped)."""

    def snapshot_completed(self, job: str, rank: int, step: int, nbytes: int,
                           stall_seconds: float) -> None: ...
    def snapshot_skipped(self, job: str, reason: str) -> None: ...
    def snapshot_newest_only(self, job: str, refused: str) -> None: ...
    def snapshot_refused(self, job: str, source: str) -> None: ...
    def scratch_refused(self, job: str) -> None: ...
    def direct_fetched(self, job: str, wire_bytes: int, routed_bytes: int) -> None: ...
    def direct_fell_back(self, job: str) -> None: ...
    def restored(self, job: str, source: str, seconds: float, steps_lost: int,
                 nbytes: int) -> None: ...
    def persisted(self, job: str, step: int, seconds: float, nbytes: int, ok: bool) -> None: ...
    def persist_writer_busy(self, job: str, outcome: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class CheckpointStats:
    """What ``CheckpointService.stats()`` returns: the gauges the daemon sets once per cycle
    (the service's events go to :class:`CheckpointMetrics` as they happen).

    ``local_slot_bytes`` is the bytes of this node's own slot files (its ranks' snapshots), not
    the copies of other nodes' shards held here (the replicator's ``replica_bytes_held``).
    """

    snapshot_bytes: int = 0  # of the latest snapshot of each local rank held
    snapshot_step: int = -1  # oldest latest step over the local ranks; -1: none
    local_slot_bytes: int = 0
    scratch_bytes: int = 0  # restore scratch and its bookings held now, every job
    unprotected_jobs: dict[str, int] = dataclasses.field(default_factory=dict)  # by reason
    persisted_step: int = -1
