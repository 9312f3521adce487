"""The handler's copy of the rendezvous keys (``<rdzv>/native/``), fed by its etcd watch, so
waiting and ``num_nodes_waiting`` read memory rather than etcd."""

from __future__ import annotations

import logging
import threading

from elasticd.clock import Clock
from elasticd.coordination.api import EventType, KeyValue, WatchEvent
from elasticd.coordination.rendezvous_rounds import NodeRecord, RecordError, RoundRecord

# The handler's logger: a bad record is the handler's to report.
log = logging.getLogger("elasticd.coordination.rendezvous_handler")


class Mirror:
    """The handler's copy of ``<rdzv>/native/``, fed by the watch; one lock and condition.

    Attributes:
        nodes: live node records by id.
        round: the last closed round, or None.
        round_revision: the round key's ``mod_revision`` (0: absent), for the CAS.
        round_error: why the stored round record was refused, if it was.
        closed: whether the rendezvous is closed.
        revision: the etcd revision this mirror reflects.
        absent_since: monotonic time each member of ``round`` was first seen absent.
    """

    def __init__(self, prefix: bytes, clock: Clock) -> None:
        self.prefix = prefix
        self.nodes_prefix = prefix + b"nodes/"
        self.round_key = prefix + b"round"
        self.closed_key = prefix + b"closed"
        self._clock = clock
        self.cond = threading.Condition()
        self.nodes: dict[str, NodeRecord] = {}
        self.round: RoundRecord | None = None
        self.round_revision = 0
        self.round_error = ""
        self.closed = False
        self.revision = 0
        self.absent_since: dict[str, float] = {}
        #: Bumped by every change, so a waiter sleeps only if nothing changed since it looked.
        self.version = 0
        self._warned: set[bytes] = set()

    def load(self, kvs: list[KeyValue], revision: int) -> None:
        """Replaces the mirror by a full listing."""
        with self.cond:
            self.nodes, self.round, self.round_revision, self.closed = {}, None, 0, False
            self.round_error = ""
            for kv in kvs:
                self._put(kv)
            self.revision = revision
            now = self._clock.monotonic()
            for m in self.round.members if self.round else ():
                if m not in self.nodes:
                    self.absent_since.setdefault(m, now)
                else:
                    self.absent_since.pop(m, None)
            self.version += 1
            self.cond.notify_all()

    def apply(self, events: list[WatchEvent]) -> None:
        with self.cond:
            for e in events:
                if e.kv.mod_revision <= self.revision:
                    continue  # already in a listing that raced the watch
                if e.type is EventType.PUT:
                    self._put(e.kv)
                else:
                    self._delete(e.kv.key)
                self.revision = e.kv.mod_revision
            self.version += 1
            self.cond.notify_all()

    def set_round(self, kv: KeyValue) -> None:
        """Takes this node's own write of the round key before the watch brings it (without
        moving :attr:`revision`: events before it may still be on their way)."""
        with self.cond:
            self._put(kv)
            self.version += 1
            self.cond.notify_all()

    def _put(self, kv: KeyValue) -> None:
        if kv.key.startswith(self.nodes_prefix):
            name = kv.key[len(self.nodes_prefix):].decode(errors="replace")
            try:
                rec = NodeRecord.decode(kv.value, kv.create_revision)
            except RecordError as exc:
                if kv.key not in self._warned:
                    self._warned.add(kv.key)
                    log.warning("ignoring node record %s: %s", kv.key.decode(errors="replace"),
                                exc)
                return
            self.nodes[name] = rec
            self.absent_since.pop(name, None)
        elif kv.key == self.round_key:
            if kv.mod_revision < self.round_revision:
                return  # older than what this node wrote itself
            try:
                self.round = RoundRecord.decode(kv.value)
                self.round_error = ""
            except RecordError as exc:
                self.round, self.round_error = None, str(exc)
            self.round_revision = kv.mod_revision
            now = self._clock.monotonic()
            members = set(self.round.members) if self.round else set()
            self.absent_since = {m: t for m, t in self.absent_since.items() if m in members}
            for m in members - self.nodes.keys():
                self.absent_since.setdefault(m, now)
        elif kv.key == self.closed_key:
            self.closed = True

    def _delete(self, key: bytes) -> None:
        if key.startswith(self.nodes_prefix):
            name = key[len(self.nodes_prefix):].decode(errors="replace")
            self.nodes.pop(name, None)
            if self.round is not None and name in self.round.members:
                self.absent_since.setdefault(name, self._clock.monotonic())
        elif key == self.round_key:
            self.round, self.round_revision, self.round_error = None, 0, ""
        elif key == self.closed_key:
            self.closed = False
