"""Who is in the cluster, and what a disappearing node record means.

This module decides and never does: it takes node records and their deletions (from the watch,
or from a full re-listing), and returns :class:`Observation` values that the daemon acts on
(writing events, counting metrics, restarting workers). Time comes in as an argument.

What a deleted node record means:

* the record said ``leaving``: the node left cleanly (it revoked its own lease);
* this observer was itself cut off from etcd around that moment: *provisional* — etcd may have
  expired every lease because it was paused or partitioned, not because the node died. The node
  gets ``provisional_seconds`` to re-register; if it does, nothing is recorded; if not, its
  failure is confirmed;
* otherwise: the node failed (its lease expired).
"""

from __future__ import annotations

import dataclasses
import enum

from elasticd.coordination import records
from elasticd.coordination.keys import Keyspace

KIND = "node"


def joined_sentence(node_id: str) -> str:
    """What a daemon logs (and serves as its first sentence) once it has joined: the line a
    supervisor or a test harness waits for in its log."""
    return f"joined the cluster as {node_id}"


class NodeState(str, enum.Enum):
    """A node's state in its own record.

    UP → LEAVING (clean shutdown, lease revoked next) | FENCED (declared dead, or etcd gone for
    longer than the outage grace: workers stopped) → UP (after re-registering).
    """

    UP = "up"
    LEAVING = "leaving"
    FENCED = "fenced"


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    """What a daemon publishes about itself under ``<prefix>/nodes/<node>``."""

    node: str
    state: str
    address: str
    hostname: str
    pid: int
    incarnation: str
    started_at: float
    heartbeat_at: float
    version: str
    lease: int = 0
    sentence: str = ""
    replication: str = ""  # HOST:PORT of the node's replica server ("" when off)

    def encode(self) -> bytes:
        return records.encode_dataclass(KIND, self)

    @classmethod
    def decode(cls, raw: bytes, key: bytes | str, node: str | None = None) -> "NodeRecord":
        """Reads a node record, checking its fields' types and values.

        Args:
            node: the node the key names; the record must name the same one (a record under
                ``nodes/n1x`` claiming to be ``n1`` is refused).

        Raises:
            records.CorruptRecord: malformed, or about another node than its key.
            records.UnsupportedRecordVersion: written by a newer elasticd.
        """
        rec = records.decode_dataclass(cls, raw, KIND, key)
        where = records.where_of(key)
        if node is not None and rec.node != node:
            raise records.CorruptRecord(f"{where}: the record names node {rec.node!r}, its key "
                                        f"{node!r}")
        if rec.pid < 0 or rec.lease < 0:
            raise records.CorruptRecord(f"{where}: negative pid or lease")
        if rec.replication:
            _, sep, port = rec.replication.rpartition(":")
            if not sep or not port.isdigit() or not 0 < int(port) < 65536:
                raise records.CorruptRecord(f"{where}: replication address "
                                            f"{rec.replication[:60]!r} is not HOST:PORT")
        return rec


def decode_node(raw: bytes, key: bytes, keys: Keyspace) -> NodeRecord:
    """A node record, which must name the node its key names."""
    try:
        node = keys.node_of(key)
    except ValueError as exc:
        raise records.CorruptRecord(f"{records.where_of(key)}: {exc}") from None
    return NodeRecord.decode(raw, key, node)


class ObservationKind(str, enum.Enum):
    JOINED = "joined"
    FAILED = "failed"
    DEPARTED = "departed"
    PROVISIONAL = "provisional"
    REJOINED = "rejoined"  # a provisional expiry resolved by the node re-registering


@dataclasses.dataclass(frozen=True)
class Observation:
    kind: ObservationKind
    node: str
    record: NodeRecord
    detection_seconds: float | None = None
    was_provisional: bool = False
    #: Why the lease ended before its TTL, when this node knows (its peer probe revoked it:
    #: :meth:`Membership.revoked`); "" for an expiry.
    cause: str = ""

    def describe(self) -> str:
        if self.kind is ObservationKind.FAILED and self.cause:
            return f"{self.node} failed ({self.cause}: lease {self.record.lease:x} revoked)"
        if self.kind is ObservationKind.FAILED:
            # detection_seconds is an upper bound (the lease TTL, or the record's age when
            # younger): the recovery's timeline places the failure from closer signs.
            return (f"{self.node} failed (lease {self.record.lease:x} expired: silent for at "
                    f"most {self.detection_seconds:.1f} s)")
        if self.kind is ObservationKind.PROVISIONAL:
            return f"{self.node}'s expiry is provisional: I was cut off from etcd"
        if self.kind is ObservationKind.REJOINED:
            return f"{self.node} re-registered after an etcd outage"
        return f"{self.node} {self.kind.value}"


@dataclasses.dataclass
class _Pending:
    record: NodeRecord
    deadline: float
    seen_at_wall: float


class Membership:
    """The set of live peers as seen by one node.

    Args:
        me: this node's id (its own record is tracked but never reported on).
        provisional_seconds: how long a provisional expiry waits for the node to come back.
        lease_ttl: the nodes' lease TTL, seconds: a failed node's last keep-alive came at most
            this long before its record went, so a detection time counts from no earlier
            (a record is not rewritten on a timer: its ``heartbeat_at`` may be much older).
            None: count from ``heartbeat_at``.
    """

    def __init__(self, me: str, provisional_seconds: float,
                 lease_ttl: float | None = None) -> None:
        self.me = me
        self.provisional_seconds = provisional_seconds
        self.lease_ttl = lease_ttl
        self.nodes: dict[str, NodeRecord] = {}
        self.pending: dict[str, _Pending] = {}
        #: lease -> why this node revoked it (:meth:`revoked`), until its record goes.
        self.causes: dict[int, str] = {}

    def revoked(self, lease: int, cause: str) -> None:
        """This node is about to revoke ``lease`` (its peer probe found the node's daemon
        refusing connections, :mod:`elasticd.daemon.peer_probe`): the failure its record's
        deletion brings says so, not that the lease expired; ``cause`` "": the revocation
        failed, the lease expires as usual. Any thread (a dict store or pop)."""
        if cause:
            self.causes[lease] = cause
        else:
            self.causes.pop(lease, None)

    def alive(self) -> list[str]:
        return sorted(self.nodes)

    def on_put(self, record: NodeRecord) -> list[Observation]:
        previous = self.nodes.get(record.node)
        self.nodes[record.node] = record
        if record.node == self.me:
            return []
        if record.node in self.pending:
            del self.pending[record.node]
            return [Observation(ObservationKind.REJOINED, record.node, record)]
        if previous is None or previous.lease != record.lease:
            return [Observation(ObservationKind.JOINED, record.node, record)]
        return []

    def on_delete(self, node: str, now: float, wall: float, cut_off: bool) -> list[Observation]:
        """A node record disappeared.

        Its last value is this mirror's copy (from the listing and every PUT since), so the
        watch needs no ``prev_kv``: a leaving record tells a departure from a failure.

        Args:
            now: monotonic time. wall: wall time (compared with the node's heartbeat stamp).
            cut_off: whether this observer was cut off from etcd around now.
        """
        record = self.nodes.pop(node, None)
        if node == self.me or record is None:
            return []
        if record.state == NodeState.LEAVING.value:
            return [Observation(ObservationKind.DEPARTED, node, record)]
        if cut_off:
            self.pending[node] = _Pending(record, now + self.provisional_seconds, wall)
            return [Observation(ObservationKind.PROVISIONAL, node, record)]
        return [self._failed(record, wall)]

    def tick(self, now: float) -> list[Observation]:
        """Confirms the provisional expiries whose grace ran out."""
        out = []
        for node, p in list(self.pending.items()):
            if now >= p.deadline:
                del self.pending[node]
                out.append(self._failed(p.record, p.seen_at_wall, was_provisional=True))
        return out

    def reset(self, records: list[NodeRecord], now: float, wall: float,
              cut_off: bool) -> list[Observation]:
        """Reconciles with a full listing (after a reconnect, a compaction, or periodically)."""
        out: list[Observation] = []
        listed = {r.node: r for r in records}
        for node in sorted(set(self.nodes) - set(listed)):
            out += self.on_delete(node, now, wall, cut_off)
        for record in records:
            out += self.on_put(record)
        return out

    def _failed(self, record: NodeRecord, wall: float,
                was_provisional: bool = False) -> Observation:
        since = max(0.0, wall - record.heartbeat_at)
        if self.lease_ttl is not None:
            since = min(since, self.lease_ttl)
        return Observation(ObservationKind.FAILED, record.node, record,
                           detection_seconds=since, was_provisional=was_provisional,
                           cause=self.causes.pop(record.lease, ""))
