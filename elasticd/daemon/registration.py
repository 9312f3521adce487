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
import uuid
from typing import Callable

import psutil

import elasticd
from elasticd.clock import Clock
from elasticd.cluster.events import Event, EventLog
from elasticd.cluster.membership import Membership, NodeRecord, NodeState, decode_node
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
    """This node's record in etcd and the lease it registered with (owned by the daemon).

    Args:
        health: etcd's health (a write that went through is a sign of it).
        membership: the cluster view (this node's own record goes in at once).
        lease_ttl: the lease's TTL (bounds the wait for a node id held by a crashed daemon).
        says: what the node is and does now: its state and its cycle sentence.
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace, keeper: LeaseKeeper,
                 health: EtcdHealth, events: EventLog, membership: Membership, clock: Clock,
                 lease_ttl: float, says: Callable[[], tuple[NodeState, str]],
                 replication_address: str = "") -> None:
        self._node = node_id
        self.coord = coord  # (a test swaps it for one that fails)
        self._keys = keys
        self._keeper = keeper
        self._health = health
        self._events = events
        self._membership = membership
        self._clock = clock
        self._lease_ttl = lease_ttl
        self._says = says
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = clock.wall()
        self.http_address = ""
        self.replication_address = replication_address
        #: The lease this node's record is bound to (None: not registered).
        self.lease: int | None = None
        self.last_write = 0.0  # monotonic time of the last write of the record
        self.published_sentence = ""
        self.leaving = False  # the node is leaving: its record says so from now on

    def record(self, lease: int) -> NodeRecord:
        state, sentence = self._says()
        return NodeRecord(
            node=self._node,
            state=state.value,
            address=self.http_address,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            incarnation=self.incarnation,
            started_at=self.started_at,
            heartbeat_at=self._clock.wall(),
            version=elasticd.__version__,
            lease=lease,
            sentence=sentence,
            replication=self.replication_address,
        )

    def put(self, lease: int | None) -> None:
        """Writes the record bound to ``lease`` (nothing without one)."""
        if lease is None:
            return
        try:
            record = self.record(lease)
            self.coord.put(self._keys.node(self._node), record.encode(), lease)
            self._health.ok()
            self.last_write = self._clock.monotonic()
            self.published_sentence = record.sentence
        except LeaseLost:
            self.lease = None  # the keeper will notice and re-grant

    def register(self, wait_for_id: bool, lift_fence: Callable[[], bool]) -> str | None:
        """Creates this node's record bound to the keeper's lease (only if the id is free).

        Args:
            wait_for_id: wait (a bounded time) for a live holder of the id to go.
            lift_fence: called once registered; True when the node was fenced (its record
                is written again, no longer saying so).

        Returns:
            the cycle's note, or None when there is no lease to register with yet.
        """
        lease = self._keeper.lease
        if lease is None:
            return None
        key = self._keys.node(self._node)
        deadline = self._clock.monotonic() + 2 * self._lease_ttl + 1
        retry = False
        while True:
            if retry:
                # A record that keeps coming back (or a create that keeps failing on a key
                # that reads as absent) must not hold the main loop: past the deadline the
                # cycle fails and the next one tries again, with SIGTERM seen in between.
                if self._clock.monotonic() > deadline:
                    raise CoordinationError(
                        f"could not write this node's record {key} within "
                        f"{2 * self._lease_ttl + 1:g} s; retrying")
                self._clock.sleep(0.05)
            retry = True
            if not self._keeper.running:
                self._keeper.step()  # waiting for our id must not cost our own lease
            lease = self._keeper.lease
            if lease is None:
                return None
            if self.coord.create(key, self.record(lease).encode(), lease):
                break
            existing = self.coord.get(key)
            if existing is None:
                continue
            try:
                other = decode_node(existing.value, existing.key, self._keys)
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
            if not wait_for_id or self._clock.monotonic() > deadline:
                raise NodeIdInUse(
                    f"node id {self._node!r} is held by a live daemon "
                    f"(host {other.hostname}, pid {other.pid}); give this node another "
                    "--node-id, or stop the other daemon")
            self._clock.sleep(0.25)
            retry = False  # a live holder: its own deadline above (NodeIdInUse) applies
        self._health.ok()
        self.lease = lease
        self.last_write = self._clock.monotonic()
        self.published_sentence = self._says()[1]
        self._membership.nodes[self._node] = self.record(lease)
        if lift_fence():
            self.put(lease)
        self._events.record(Event("joined", self._node, lease, self._clock.wall(),
                                  self._node, "registered"))
        return f"registered as {self._node} with lease {lease:x}"

    @staticmethod
    def _is_dead_local(other: NodeRecord) -> bool:
        return other.hostname == socket.gethostname() and not psutil.pid_exists(other.pid)
