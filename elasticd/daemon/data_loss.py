"""Recovering from an etcd that came back empty (its data lost, not merely unreachable).

The cluster's incarnation key (:mod:`elasticd.cluster.incarnation`) tells a data loss from an
outage. Nobody failed for it: peers get the provisional grace to re-register, watches restart
from the new cluster's revision, and this node writes again what it holds. What to do is
:func:`elasticd.daemon.node_rules.data_loss_plan`'s; this part looks for a loss and carries the
plan out, each step through the callable the daemon gave for it.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from elasticd.cluster.incarnation import DataLoss, Incarnation
from elasticd.daemon.node_rules import Recover, data_loss_plan, look_for_data_loss
from elasticd.metrics import Metrics

log = logging.getLogger("elasticd.daemon.daemon")


class DataLossRecovery:
    """Looks for an etcd data loss and recovers from it (owned by the daemon).

    Args:
        republish_specs: writes the job specs and controls again; returns how many specs.
        record_event: records the loss (with the number of specs written again).
        steps: what carries out each other step of the plan.
    """

    def __init__(self, incarnation: Incarnation, metrics: Metrics,
                 republish_specs: Callable[[], int],
                 record_event: Callable[[DataLoss, int], None],
                 steps: Mapping[Recover, Callable[[], None]],
                 registered: Callable[[], bool], replicates: bool) -> None:
        self.incarnation = incarnation
        self._metrics = metrics
        self._republish_specs = republish_specs
        self._record_event = record_event
        self._steps = steps
        self._registered = registered
        self._replicates = replicates
        self._looked_at_cycle = -1  # the cycle that last looked for an etcd data loss

    def look(self, cycle: int, again: bool = False) -> str | None:
        """Looks (at most once a cycle, unless ``again``) whether etcd lost its data, and
        recovers if so. Returns the cycle's note when it did. Coordination errors propagate."""
        if not look_for_data_loss(self._looked_at_cycle, cycle, again):
            return None
        self._looked_at_cycle = cycle
        loss = self.incarnation.check()
        return None if loss is None else self._recover(loss)

    def _recover(self, loss: DataLoss) -> str:
        """etcd came back empty: keys, leases and watch positions are gone. What this node
        holds is written again: its records, the job specs and controls it follows, the
        replicas' records."""
        specs = 0
        for step in data_loss_plan(loss.first, self._registered(), self._replicates):
            if step is Recover.REPUBLISH_SPECS:
                specs = self._republish_specs()
                log.error("etcd lost its data (%s): re-listing and re-watching, re-publishing "
                          "this node's records and %d job spec(s); no node is declared failed "
                          "for it", loss.reason, specs)
                self._metrics.etcd.data_losses.inc()
            elif step is Recover.RECORD_EVENT:
                self._record_event(loss, specs)
            else:
                self._steps[step]()
        # Not the log line's words again: the cycle sentence is logged too, and the loss is
        # said once.
        return f"recovered from an etcd data loss; re-published {specs} job spec(s)"
