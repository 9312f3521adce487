"""This node's join record: written under the agent's lease, written again under a new one.

The record (``native/nodes/<node>``, :class:`~.records.NodeRecord`) names the round this node
asks for and a port it holds free for its workers' store (:mod:`.port`). It lives as long as the
agent's lease; when the keeper re-grants a lost lease (an etcd outage past the TTL), the record
is written again under the new one: a provisional rejoin, not a new node.

Under a daemon the record names the daemon's node and the lease its node record is bound to
(``daemon_of``); the daemons' ``failed`` mark of that lease dooms the record
(:mod:`.failures`), so a record naming a lease the daemon's record no longer holds would never
be doomed by it. The agent names the lease as its watch on the daemon's record last saw it (no
read), and the write compares it with that record's lease in the same transaction
(``daemon_key``): a stale view fails the compare, and the write reads the record and goes again
unconditionally, as before (one read and one write; the view saves the read on every join).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from elasticd.coordination.api import Compare, CoordinationError, Coordinator
from elasticd.coordination.lease import LeaseKeeper
from elasticd.rendezvous.grace import OutageGrace
from elasticd.rendezvous.port import HeldPort
from elasticd.rendezvous.records import NodeRecord

log = logging.getLogger("elasticd.rendezvous.handler")


class JoinRecord:
    """This node's record at ``key``, and the port it names."""

    def __init__(self, coord: Coordinator, keeper: LeaseKeeper, grace: OutageGrace, key: bytes,
                 me: str, addr: str) -> None:
        self._coord, self._keeper, self._grace = coord, keeper, grace
        self.key, self._me, self._addr = key, me, addr
        self._lock = threading.Lock()  # the keeper's thread re-writes what next_rendezvous wrote
        self._record: NodeRecord | None = None
        self.port = HeldPort()
        #: The node and lease of the daemon that runs this agent (None: none), named in the
        #: record: the daemons' ``failed`` record of that lease drops it at once
        #: (:mod:`.failures`).
        self.daemon_of: Callable[[], tuple[str, int] | None] | None = None
        #: The daemon's node record, whose lease the write compares with the one named (None:
        #: ``daemon_of`` read it just now; the write is unconditional).
        self.daemon_key: bytes | None = None

    def _daemon(self) -> tuple[str, int] | None:
        if self.daemon_of is None:
            return None
        try:
            return self.daemon_of()
        except Exception as exc:  # noqa: BLE001 - the join goes on; confirm drops it instead
            log.warning("could not name this node's daemon in its join record: %s", exc)
            return None

    def write(self, target: int) -> None:
        """Asks for round ``target``, naming a newly held port (and the daemon that runs this
        agent, if one does: :attr:`daemon_of`)."""
        named = self._daemon()
        port = self.port.hold(self._addr)
        # A lease lost just now (or lost with etcd's data) is replaced: not a failed agent.
        self._grace.call(lambda: self._put(target, port, named),
                         "writing this node's rendezvous record")

    def _put(self, target: int, port: int, named: tuple[str, int] | None) -> None:
        key = self.daemon_key
        if named is not None and key is not None:
            record = self._keep(NodeRecord(self._me, target, self._addr, port,
                                           daemon=named[0], daemon_lease=named[1]))
            if self._keeper.put_if(self.key, record.encode(),
                                   [Compare(key, named[1], "lease")]):
                return
            # The daemon's record holds another lease now (re-granted), or is gone: name what
            # it holds, as read now.
            try:
                kv = self._coord.get(key)
            except CoordinationError as exc:  # as _daemon: the join goes on, unnamed
                log.warning("could not name this node's daemon in its join record: %s", exc)
                kv = None
            named = (named[0], kv.lease) if kv is not None and kv.lease else None
        node, lease = named or ("", 0)
        record = self._keep(NodeRecord(self._me, target, self._addr, port,
                                       daemon=node, daemon_lease=lease))
        self._keeper.put(self.key, record.encode())

    def _keep(self, record: NodeRecord) -> NodeRecord:
        with self._lock:
            self._record = record
        return record

    def rewrite(self, lease: int) -> None:
        """Writes the record again under ``lease`` (nothing if none was written yet)."""
        with self._lock:
            record = self._record
        if record is None:
            return
        try:
            self._coord.put(self.key, record.encode(), lease=lease)
            log.info("rendezvous lease re-granted: node record %s re-written", self._me)
        except CoordinationError as exc:  # the keeper retries and calls us again
            log.warning("could not re-write node record %s: %s", self._me, exc)
