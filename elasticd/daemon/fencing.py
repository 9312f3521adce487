"""The daemon's fence: stopping every job process this node runs, for the cluster's sake.

The rules (when to fence) are :class:`elasticd.daemon.node_rules.FenceBook`'s; this part
gathers what they need (which lost leases peers declared failed, in etcd's events), carries
out their orders (the fence hooks, a ``fenced`` event, the metric) and says what it did.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

from elasticd.clock import Clock
from elasticd.cluster.events import Event, EventLog
from elasticd.coordination.api import CoordinationError
from elasticd.daemon.node_rules import FenceBook, FenceOrder, describe_outage
from elasticd.hooks import call_hooks
from elasticd.metrics import Metrics

log = logging.getLogger("elasticd.daemon.daemon")

FenceHook = Callable[[str], None]


class Fence:
    """Fences this node when its rules say so (owned by the daemon).

    Args:
        events: the cluster's event log (``failed`` events read, ``fenced`` written).
        lease: this node's current lease (registered, else the keeper's), or None.
    """

    def __init__(self, node_id: str, events: EventLog, metrics: Metrics, clock: Clock,
                 lease: Callable[[], int | None]) -> None:
        self._node = node_id
        self._events = events
        self._metrics = metrics
        self._clock = clock
        self._lease = lease
        self.book = FenceBook()
        #: Called with the reason when the node fences (the job manager stops its jobs).
        self.hooks: list[FenceHook] = []

    def lease_lost(self, lease: int, provisional_seconds: float) -> str:
        """The keep-alive found ``lease`` gone; returns the cycle's note."""
        self._metrics.etcd.leases_lost.inc()
        self.book.lease_lost(lease, self._clock.monotonic(), provisional_seconds)
        return f"lost lease {lease:x}"

    def check(self, now: float) -> str | None:
        """Looks for a failure recorded against one of the lost leases: fences if found."""
        declared = [lease for lease in self.book.suspects
                    if self._events.exists(self._node, lease, "failed")]
        return self._carry_out(self.book.judge(declared, now))

    def outage(self, outage_seconds: float, grace: float, kind: str | None = None) -> str | None:
        """etcd has failed this node (``kind``: how) for ``outage_seconds``: fences past the
        grace."""
        return self._carry_out(self.book.outage(outage_seconds, grace, kind))

    def describe_outage(self, gone: float, grace: float, kind: str | None = None) -> str:
        return describe_outage(gone, grace, self.book.fenced, kind or "unreachable")

    def _carry_out(self, order: FenceOrder | None) -> str | None:
        if order is None:
            return None
        log.warning("fencing: %s; stopping workers", order.reason)
        self._metrics.etcd.fenced.inc()
        call_hooks(self.hooks, order.reason, log=log, failed="fence hook failed")
        # The keeper thread may not have granted a new lease yet: the old one names this fence.
        lease = order.lease or self._lease()
        with contextlib.suppress(CoordinationError):  # etcd is gone; the fence is what matters
            if lease is not None:
                self._events.record(Event("fenced", self._node, lease, self._clock.wall(),
                                          self._node, order.reason))
        return f"fenced: {order.reason}"
