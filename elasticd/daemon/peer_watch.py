"""The daemon's view of its peers: the node records under ``nodes/``, listed and then watched.

It lists the prefix, watches from the revision after, decodes each record (a bad one is logged
once and ignored) and hands the membership what it saw; the daemon acts on the observations the
membership answers. It also keeps the two flags a watch can raise: the view may be stale (the
watch broke, or re-created itself after etcd lost its data: re-list), and this node's own record
went while its lease lives (write it again).
"""

from __future__ import annotations

import logging
from typing import Callable

from elasticd.clock import Clock
from elasticd.cluster.membership import Membership, NodeRecord, Observation, decode_node
from elasticd.coordination import records
from elasticd.coordination.api import Coordinator, EventType
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.watch_feed import WatchFeed

log = logging.getLogger("elasticd.daemon.daemon")


class PeerWatch:
    """The node records, listed and watched, as membership observations.

    Args:
        node_id: this node (a deletion of its own record raises :attr:`own_record_gone`).
        clock: injected time (the wall clock of a failure's observation).
        wake: called when a watch batch arrives (wakes the daemon's loop).

    Attributes:
        stale: the view may be stale: the daemon re-lists (after looking for a data loss).
        own_record_gone: this node's record was deleted; the daemon writes it again.
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace,
                 membership: Membership, clock: Clock, wake: Callable[[], None]) -> None:
        self.node_id = node_id
        self.coord = coord
        self.keys = keys
        self.membership = membership
        self.clock = clock
        self._feed = WatchFeed(wake=wake)
        self.stale = False
        self.own_record_gone = False
        self.complaints = records.Complaints(log)

    def start(self) -> list[Observation]:
        """Lists the records and watches from the revision after."""
        recs, revision = self.list()
        obs = self.membership.reset(recs, self.clock.monotonic(), self.clock.wall(), False)
        # No prev_kv: a DELETE's previous record (which tells a departure from a failure) is
        # the membership's own copy, kept from the listing and every PUT since; etcd would read
        # it from its backend for every event to every daemon (N² reads at a cold start).
        self._feed.start(self.coord, self.keys.nodes, revision + 1)
        return obs

    def close(self) -> None:
        self._feed.close()

    def empty(self) -> bool:
        """Whether no watch batch waits."""
        return self._feed.empty()

    def list(self) -> tuple[list[NodeRecord], int]:
        """Every readable node record, and the listing's revision."""
        kvs, revision = self.coord.get_prefix(self.keys.nodes)
        return [rec for kv in kvs if (rec := self._decode(kv.key, kv.value)) is not None], revision

    def reset(self, recs: list[NodeRecord], now: float, cut_off: bool) -> list[Observation]:
        """Reconciles the view with a listing; the view is current again."""
        self.stale = False
        return self.membership.reset(recs, now, self.clock.wall(), cut_off)

    def take(self, now: float, cut_off: bool, leaving: bool) -> list[Observation]:
        """What the watch delivered since the last call, as observations.

        Args:
            cut_off: this node was cut off from etcd long enough for a peer's record to expire
                unseen (a deletion then may be our own outage, not the peer's failure).
            leaving: this node is leaving (its own record's deletion is expected).
        """
        events, stale = self._feed.take()
        # A broken watch re-creates itself, from the revision after the last event; if etcd
        # came back empty that revision is in the old cluster's past and the stream stays
        # silent: re-list (which also looks for a data loss).
        self.stale |= stale
        out: list[Observation] = []
        for ev in events:
            if ev.type is EventType.PUT:
                rec = self._decode(ev.kv.key, ev.kv.value)
                if rec is not None:
                    out += self.membership.on_put(rec)
                continue
            try:
                node = self.keys.node_of(ev.kv.key)
            except ValueError:
                continue  # never a node: its record was ignored when it was written
            if node == self.node_id and not leaving:
                self.own_record_gone = True
            out += self.membership.on_delete(node, now, self.clock.wall(), cut_off)
        return out

    def _decode(self, key: bytes, value: bytes) -> NodeRecord | None:
        """A peer's record, or None (a bad one is logged once and ignored)."""
        try:
            return decode_node(value, key, self.keys)
        except records.RecordError as exc:
            self.complaints.warn(key, value, "ignoring node record: %s", exc)
            return None
