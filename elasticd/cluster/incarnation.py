"""Recognising that etcd lost its data.

An etcd restarted on an empty data directory (a member's disk lost, a restore from nothing)
comes back with no keys, revisions restarting near 1, and possibly the same cluster id (it is
derived from the member URLs and the cluster token, which a restart may reuse). Nothing in the
protocol says so: a watch resumed from the old cluster's next revision simply delivers nothing
until the new cluster's revision passes that number, leases are "not found", and every record
is gone. Left alone, daemons then see their peers vanish (failures), their job specs vanish
(jobs stopped) and, once they re-list, fence one another.

So the cluster writes one key of its own, ``<prefix>/cluster``, a random incarnation id; what
a daemon that finds it gone or replaced (or the revision gone backwards) does, and when it
looks (never per cycle: one range read when something suggests a loss): docs/operations.md §8a.
The first daemon to notice writes a new incarnation, so the loss is counted once; the others
adopt it.
"""

from __future__ import annotations

import dataclasses
import uuid

from elasticd.clock import Clock, SystemClock
from elasticd.coordination import records
from elasticd.coordination.api import Coordinator, KeyValue
from elasticd.coordination.keys import Keyspace

KIND = "cluster"


@dataclasses.dataclass(frozen=True)
class DataLoss:
    """etcd lost its data since the previous look.

    Attributes:
        reason: what showed it, for the log line and the event.
        first: this daemon wrote the new incarnation (it records the cluster-wide event).
    """

    reason: str
    first: bool


class Incarnation:
    """Follows the cluster's incarnation key and the etcd revisions this daemon reads."""

    def __init__(self, coord: Coordinator, keys: Keyspace, node_id: str,
                 clock: Clock | None = None) -> None:
        self.coord, self.keys, self.node_id = coord, keys, node_id
        self.clock = clock or SystemClock()
        self.id: str | None = None
        self.max_revision = 0

    def observe(self, revision: int) -> bool:
        """Notes a revision this daemon read from etcd (a listing's header revision); True
        when it went backwards: etcd lost its data, :meth:`check` now."""
        back = revision < self.max_revision
        self.max_revision = revision if back else max(self.max_revision, revision)
        return back

    def check(self) -> DataLoss | None:
        """Looks at the incarnation key; creates it on a cluster that has none.

        Returns:
            The loss, when etcd lost its data since the previous look; else None.

        Raises:
            coordination errors: etcd is unreachable (the caller looks again later).
        """
        kvs, revision = self.coord.get_prefix(self.keys.cluster)
        kv = next((kv for kv in kvs if kv.key == self.keys.cluster), None)
        went_back = self.observe(revision)
        seen = self._decode(kv)
        if seen is not None and seen == self.id:
            return None
        new, first = (self._create(kv.mod_revision if kv is not None else 0) if seen is None
                      else (seen, False))
        known, self.id = self.id, new
        if known is None:
            return None  # the first look (a new cluster, or this daemon's start)
        reason = ("the cluster's incarnation key is gone" if seen is None
                  else "another daemon found the incarnation key gone and wrote it anew")
        if went_back:
            reason += f" (revisions went back to {revision})"
        return DataLoss(reason, first)

    def _create(self, mod_revision: int) -> tuple[str, bool]:
        """Writes a new incarnation over what ``mod_revision`` names (0: absent; else an
        unreadable value) unless another daemon just did; returns the id in force and
        whether this call wrote it."""
        new = uuid.uuid4().hex
        raw = records.encode(KIND, {"id": new, "node": self.node_id, "at": self.clock.wall()})
        if self.coord.compare_and_set(self.keys.cluster, raw, mod_revision):
            return new, True
        seen = self._decode(self.coord.get(self.keys.cluster))
        return (seen if seen is not None else new), False

    def _decode(self, kv: KeyValue | None) -> str | None:
        if kv is None:
            return None
        try:
            payload = records.decode(kv.value, KIND, kv.key)
        except records.RecordError:
            return None
        value = payload.get("id")
        return value if isinstance(value, str) and value else None
