"""Recovering from an etcd that came back empty (its data lost, not merely unreachable).

The cluster's incarnation key (:mod:`elasticd.cluster.incarnation`) tells a data loss from an
outage. Nobody failed for it: peers get the provisional grace to re-register, watches restart
from the new cluster's revision, and this node writes again what it holds.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from elasticd.agent.manager import JobManager
from elasticd.clock import Clock
from elasticd.cluster.incarnation import DataLoss, Incarnation
from elasticd.cluster.membership import Membership, NodeRecord, Observation
from elasticd.coordination.api import Coordinator
from elasticd.coordination.keys import Keyspace
from elasticd.metrics import Metrics

log = logging.getLogger("elasticd.daemon.daemon")


class DataLossRecovery:
    """The daemon's data-loss recovery (a base of :class:`~elasticd.daemon.daemon.Daemon`,
    which sets the attributes and methods annotated here)."""

    coord: Coordinator
    clock: Clock
    keys: Keyspace
    metrics: Metrics
    jobs: JobManager
    membership: Membership
    cluster_incarnation: Incarnation
    replicator: Any
    registered_lease: int | None
    cycles: int
    _looked_at_cycle: int
    _suspect: dict[int, float]
    _need_resync: bool
    _notes: list[str]
    _act: Callable[[list[Observation]], None]
    _decode_all: Callable[[list[Any]], list[NodeRecord]]
    _put_record: Callable[[int | None], None]
    record_event: Callable[[str, str, dict[str, Any]], None]

    def _look_for_data_loss(self, again: bool = False) -> bool:
        """Looks (at most once a cycle, unless ``again``) whether etcd lost its data, and
        recovers if so. Returns True when it did. Coordination errors propagate."""
        if self._looked_at_cycle == self.cycles and not again:
            return False
        self._looked_at_cycle = self.cycles
        loss = self.cluster_incarnation.check()
        if loss is None:
            return False
        self._recover_from_data_loss(loss)
        return True

    def _recover_from_data_loss(self, loss: DataLoss) -> None:
        """etcd came back empty: keys, leases and watch positions are gone. What this node
        holds is written again: its records, the job specs and controls it follows, the
        replicas' records."""
        specs = self.jobs.republish()
        log.error("etcd lost its data (%s): re-listing and re-watching, re-publishing this "
                  "node's records and %d job spec(s); no node is declared failed for it",
                  loss.reason, specs)
        self.metrics.etcd_data_losses.inc()
        self.coord.reset_watches()
        now = self.clock.monotonic()
        kvs, revision = self.coord.get_prefix(self.keys.nodes)
        self.cluster_incarnation.observe(revision)
        self._suspect.clear()  # failed events against our old leases went with the data
        self._act(self.membership.reset(self._decode_all(kvs), now, self.clock.wall(), True))
        self._need_resync = False
        if self.registered_lease is not None:
            self._put_record(self.registered_lease)  # LeaseLost: re-registered this cycle
        if self.replicator is not None:
            self.replicator.republish()
        # Not the log line's words again: the cycle sentence is logged too, and the loss is
        # said once.
        self._notes.append(f"recovered from an etcd data loss; re-published {specs} job "
                           "spec(s)")
        if loss.first:
            self.record_event("etcd_data_lost", f"etcd lost its data: {loss.reason}",
                               {"specs_republished": specs})
