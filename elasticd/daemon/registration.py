"""This node's record in etcd: registering under its id, and writing it again when it changes.

The record (``<prefix>/nodes/<node>``) is bound to the node's lease: peers see the node die
when the lease expires. The lease's keep-alive is the heartbeat: the record is written when
the node's state or sentence changes (at most once a second), when it went missing while the
lease lives, and on a timer only if ``heartbeat_interval`` asks for one. Registering creates it
only if the id is free; a record left by this daemon's earlier lease, or by a crashed daemon on
this host, is taken over; one held by a live daemon elsewhere is refused (:class:`NodeIdInUse`).
"""

from __future__ import annotations

import logging
import os
import socket

import psutil

import elasticd
from elasticd.clock import Clock
from elasticd.cluster.events import Event, EventLog
from elasticd.cluster.membership import Membership, NodeRecord, NodeState, decode_node
from elasticd.config import Settings
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator, LeaseLost
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.lease import LeaseKeeper
from elasticd.errors import NodeError

log = logging.getLogger("elasticd.daemon.daemon")

class NodeIdInUse(NodeError, RuntimeError):
    """Another live daemon holds this node id."""


class Registration:
    """The daemon's registration (a base of :class:`~elasticd.daemon.daemon.Daemon`, which
    sets the attributes annotated here)."""

    settings: Settings
    coord: Coordinator
    clock: Clock
    keys: Keyspace
    keeper: LeaseKeeper
    health: EtcdHealth
    events: EventLog
    membership: Membership
    state: NodeState
    registered_lease: int | None
    incarnation: str
    started_at: float
    http_address: str
    replication_address: str
    sentence: str
    _last_heartbeat: float
    _published_sentence: str
    _notes: list[str]

    def _record(self, lease: int) -> NodeRecord:
        return NodeRecord(
            node=self.settings.node_id,
            state=self.state.value,
            address=self.http_address,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            incarnation=self.incarnation,
            started_at=self.started_at,
            heartbeat_at=self.clock.wall(),
            version=elasticd.__version__,
            lease=lease,
            sentence=self.sentence,
            replication=self.replication_address,
        )

    def _put_record(self, lease: int | None) -> None:
        if lease is None:
            return
        try:
            record = self._record(lease)
            self.coord.put(self.keys.node(self.settings.node_id), record.encode(), lease)
            self.health.ok()
            self._last_heartbeat = self.clock.monotonic()
            self._published_sentence = record.sentence
        except LeaseLost:
            self.registered_lease = None  # the keeper will notice and re-grant

    def _register(self, wait_for_id: bool) -> None:
        """Creates this node's record bound to the current lease (only if the id is free)."""
        lease = self.keeper.lease
        if lease is None:
            return
        key = self.keys.node(self.settings.node_id)
        deadline = self.clock.monotonic() + 2 * self.settings.lease_ttl + 1
        retry = False
        while True:
            if retry:
                # A record that keeps coming back (or a create that keeps failing on a key
                # that reads as absent) must not hold the main loop: past the deadline the
                # cycle fails and the next one tries again, with SIGTERM seen in between.
                if self.clock.monotonic() > deadline:
                    raise CoordinationError(
                        f"could not write this node's record {key} within "
                        f"{2 * self.settings.lease_ttl + 1:g} s; retrying")
                self.clock.sleep(0.05)
            retry = True
            if not self.keeper.running:
                self.keeper.step()  # waiting for our id must not cost our own lease
            lease = self.keeper.lease
            if lease is None:
                return
            if self.coord.create(key, self._record(lease).encode(), lease):
                break
            existing = self.coord.get(key)
            if existing is None:
                continue
            try:
                other = decode_node(existing.value, existing.key, self.keys)
            except records.RecordError as exc:
                # Its lease may be anyone's (whoever wrote it chose it): delete, never revoke.
                log.warning("replacing unreadable record of this node: %s", exc)
                self.coord.delete(key)
                continue
            if other.incarnation == self.incarnation or self._is_dead_local(other):
                # Our own earlier lease, or a crashed earlier daemon on this host: take over.
                if existing.lease and existing.lease != lease:
                    self.coord.revoke_lease(existing.lease)
                else:
                    self.coord.delete(key)
                continue
            if not wait_for_id or self.clock.monotonic() > deadline:
                raise NodeIdInUse(
                    f"node id {self.settings.node_id!r} is held by a live daemon "
                    f"(host {other.hostname}, pid {other.pid}); give this node another "
                    "--node-id, or stop the other daemon")
            self.clock.sleep(0.25)
            retry = False  # a live holder: its own deadline above (NodeIdInUse) applies
        self.health.ok()
        self.registered_lease = lease
        self._last_heartbeat = self.clock.monotonic()
        self._published_sentence = self.sentence
        self.membership.nodes[self.settings.node_id] = self._record(lease)
        if self.state is NodeState.FENCED:
            self.state = NodeState.UP
            self._put_record(lease)
        self.events.record(Event("joined", self.settings.node_id, lease, self.clock.wall(),
                                 self.settings.node_id, "registered"))
        self._notes.append(f"registered as {self.settings.node_id} with lease {lease:x}")

    @staticmethod
    def _is_dead_local(other: NodeRecord) -> bool:
        return other.hostname == socket.gethostname() and not psutil.pid_exists(other.pid)
