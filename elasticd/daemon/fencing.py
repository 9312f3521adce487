"""The outage and fencing rules: when this node stops its workers for the cluster's sake.

A node fences itself (stops every job process it runs, before it rejoins) when peers declared
it dead (a ``failed`` event against one of its lost leases) or when etcd stayed unreachable for
longer than ``outage_grace``; until then its workers keep running, and the cycle sentence says
for how much longer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable

from elasticd.clock import Clock
from elasticd.cluster.events import Event, EventLog
from elasticd.cluster.membership import NodeState
from elasticd.config import Settings
from elasticd.coordination.api import CoordinationError, Coordinator
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.lease import LeaseKeeper
from elasticd.metrics import Metrics

log = logging.getLogger("elasticd.daemon.daemon")

FenceHook = Callable[[str], None]


class Fencing:
    """The daemon's fencing (a base of :class:`~elasticd.daemon.daemon.Daemon`, which sets
    the attributes annotated here)."""

    settings: Settings
    coord: Coordinator
    clock: Clock
    keeper: LeaseKeeper
    health: EtcdHealth
    events: EventLog
    metrics: Metrics
    state: NodeState
    registered_lease: int | None
    fence_hooks: list[FenceHook]
    _suspect: dict[int, float]  # old lease -> until when to look for our failure
    _fenced_for: str
    _need_resync: bool
    _wake: threading.Event
    _notes: list[str]

    def _handle_lost_leases(self) -> None:
        for old in self.keeper.take_lost():
            self._need_resync = True  # a lease found gone: etcd may have lost its data
            self.metrics.leases_lost.inc()
            if self.registered_lease == old:
                self.registered_lease = None
            self._suspect[old] = self.clock.monotonic() + self.settings.provisional_seconds + 2
            self._notes.append(f"lost lease {old:x}")
        self._check_suspects(self.clock.monotonic())

    def _check_suspects(self, now: float) -> None:
        """Looks for a failure recorded against one of our lost leases: if found, fence."""
        for old, until in list(self._suspect.items()):
            if self.events.exists(self.settings.node_id, old, "failed"):
                del self._suspect[old]
                self.fence(f"declared dead by peers (lease {old:x} expired)", lease=old)
            elif now > until:
                del self._suspect[old]

    def fence(self, reason: str, lease: int | None = None) -> None:
        """Stops everything this node runs for the cluster, before it rejoins.

        Args:
            reason: why, for the log, the event and /status.
            lease: the lease the fencing is about (the one peers declared dead); the event is
                recorded against it, else against the current lease if there is one.
        """
        if self.state is NodeState.FENCED:
            return
        log.warning("fencing: %s; stopping workers", reason)
        self.state = NodeState.FENCED
        self._fenced_for = reason
        self.metrics.fenced.inc()
        for hook in self.fence_hooks:
            try:
                hook(reason)
            except Exception:
                log.exception("fence hook failed")
        # The keeper thread may not have granted a new lease yet: the old one names this fence.
        lease = lease or self.registered_lease or self.keeper.lease
        self._notes.append(f"fenced: {reason}")
        with contextlib.suppress(CoordinationError):  # etcd is gone; the fence is what matters
            if lease is not None:
                self.events.record(Event("fenced", self.settings.node_id, lease,
                                         self.clock.wall(), self.settings.node_id, reason))

    def _maybe_fence_for_outage(self) -> None:
        if self.settings.outage_grace and self.health.outage_seconds() > self.settings.outage_grace:
            self.fence(f"etcd unreachable for more than {self.settings.outage_grace:.0f} s")

    def _outage_started(self) -> None:
        self.metrics.etcd_outages.inc()
        self.metrics.etcd_up.set(0)
        self._wake.set()

    def _outage_ended(self, seconds: float) -> None:
        self.metrics.etcd_up.set(1)
        self._need_resync = True
        rewatch = getattr(self.coord, "rewatch", None)
        if rewatch is not None:
            rewatch()
        self._wake.set()

    def _describe_outage(self) -> str:
        gone = self.health.outage_seconds()
        if self.state is NodeState.FENCED:
            return (f"etcd unreachable for {gone:.1f} s; fenced (workers stopped) after the "
                    f"{self.settings.outage_grace:.0f} s grace; retrying")
        return (f"etcd unreachable for {gone:.1f} s; keeping workers running for "
                f"{max(0.0, self.settings.outage_grace - gone):.1f} s more; retrying")
