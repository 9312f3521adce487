"""Every agent's copy of the rendezvous' control keys, fed by one etcd watch.

The control keys are the ``native/round`` prefix (:mod:`.records`): the last closed round, the
closer's election key, its waiting summary, and the closed marker. Every agent watches that
prefix and nothing else of the rendezvous, so a round costs it a few watch events however many
nodes join; waiting and ``num_nodes_waiting`` read this copy rather than etcd.
"""

from __future__ import annotations

import logging
import threading

from elasticd.clock import Clock
from elasticd.coordination.api import EventType, KeyValue, WatchEvent
from elasticd.rendezvous.records import RecordError, RoundRecord, Waiting

# The handler's logger: a bad record is the handler's to report.
log = logging.getLogger("elasticd.rendezvous.handler")


class Control:
    """The agent's copy of ``<rdzv>/native/round*``; one lock and condition.

    Attributes:
        round: the last closed round, or None.
        round_revision: the round key's ``mod_revision`` (0: absent), for the close's CAS.
        round_error: why the stored round record was refused, if it was.
        waiting: the closer's summary, or None.
        closer: the closer's election key (value: its node id), or None.
        closed: whether the rendezvous is closed.
        revision: the etcd revision this copy reflects.
        version: bumped by every change, so a waiter sleeps only if nothing changed.
    """

    def __init__(self, native: bytes, clock: Clock) -> None:
        self.nodes_prefix = native + b"nodes/"
        self.round_key = native + b"round"
        self.closer_key = native + b"round.closer"
        self.waiting_key = native + b"round.waiting"
        self.closed_key = native + b"round.closed"
        self._clock = clock
        self.cond = threading.Condition()
        self.round: RoundRecord | None = None
        self.round_revision = 0
        self.round_error = ""
        self.waiting: Waiting | None = None
        self.closer: KeyValue | None = None
        self.closed = False
        self.revision = 0
        self.version = 0
        self._warned: set[bytes] = set()

    def load(self, kvs: list[KeyValue], revision: int) -> None:
        """Replaces the copy by a full listing of the prefix."""
        with self.cond:
            self.round, self.round_revision, self.round_error = None, 0, ""
            self.waiting, self.closer, self.closed = None, None, False
            for kv in kvs:
                self._put(kv)
            self.revision = revision
            self._changed()

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
            self._changed()

    def set(self, kv: KeyValue) -> None:
        """Takes this node's own write before the watch brings it (without moving
        :attr:`revision`: events before it may still be on their way)."""
        with self.cond:
            self._put(kv)
            self._changed()

    def _changed(self) -> None:
        self.version += 1
        self.cond.notify_all()

    def _put(self, kv: KeyValue) -> None:
        if kv.key == self.round_key:
            if kv.mod_revision < self.round_revision:
                return  # older than what this node wrote itself
            try:
                self.round = RoundRecord.decode(kv.value)
                self.round_error = ""
            except RecordError as exc:
                self.round, self.round_error = None, str(exc)
            self.round_revision = kv.mod_revision
        elif kv.key == self.waiting_key:
            try:
                self.waiting = Waiting.decode(kv.value)
            except RecordError as exc:
                self.waiting = None
                self._warn(kv.key, exc)
        elif kv.key == self.closer_key:
            if self.closer is None or kv.mod_revision >= self.closer.mod_revision:
                self.closer = kv
        elif kv.key == self.closed_key:
            self.closed = True

    def _delete(self, key: bytes) -> None:
        if key == self.round_key:
            self.round, self.round_revision, self.round_error = None, 0, ""
        elif key == self.waiting_key:
            self.waiting = None
        elif key == self.closer_key:
            self.closer = None
        elif key == self.closed_key:
            self.closed = False

    def _warn(self, key: bytes, exc: Exception) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("ignoring %s: %s", key.decode(errors="replace"), exc)

    def closer_node(self) -> str | None:
        """The node id in the closer's key (None: no closer)."""
        with self.cond:
            return self.closer.value.decode(errors="replace") if self.closer else None
