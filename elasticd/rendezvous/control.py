"""Every agent's copy of the rendezvous' control keys, fed by one etcd watch.

The control keys are the ``native/round`` prefix (:mod:`.records`): the last closed round, the
closer's election key, its waiting summary, and the closed marker. Every agent watches that
prefix and nothing else of the rendezvous, so a round costs it a few watch events however many
nodes join; waiting and ``num_nodes_waiting`` read this copy (:class:`Control`) rather than
etcd. :class:`ControlWatch` lists the prefix into it and follows it: the copy is re-listed only
when the watch cannot be trusted (a watch error, a lost or replaced lease), and a listing whose
revision went back (etcd lost its data) re-creates the watch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from elasticd.clock import Clock
from elasticd.coordination.api import (
    Compacted,
    CoordinationError,
    Coordinator,
    EventType,
    KeyValue,
    Watch,
    WatchEvent,
)
from elasticd.coordination.records import Complaints
from elasticd.rendezvous.data_loss import restore_round
from elasticd.rendezvous.grace import OutageGrace
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
        revision: the etcd revision this copy reflects.
        version: bumped by every change, so a waiter sleeps only if nothing changed.
        listeners: called (under :attr:`cond`: they must not block) after every change; an
            in-process agent wakes its monitor so (:mod:`elasticd.agent.in_process_agent`).
    """

    def __init__(self, native: bytes, clock: Clock) -> None:
        self.native = native
        self.nodes_prefix = native + b"nodes/"
        self.round_key = native + b"round"
        self.closer_key = native + b"round.closer"
        self.waiting_key = native + b"round.waiting"
        self.closed_key = native + b"round.closed"
        self._clock = clock
        self.cond = threading.Condition()
        self.listeners: list[Callable[[], None]] = []
        self.round: RoundRecord | None = None
        self.round_revision = 0
        self.round_error = ""
        self.waiting: Waiting | None = None
        self.closer: KeyValue | None = None
        self.closed = False
        self.revision = 0
        self.version = 0
        self._complaints = Complaints(log)

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
        for fn in self.listeners:
            fn()

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
                self._complaints.warn(kv.key, b"", "ignoring %s: %s",
                                      kv.key.decode(errors="replace"), exc)
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

    def closer_node(self) -> str | None:
        """The node id in the closer's key (None: no closer)."""
        with self.cond:
            return self.closer.value.decode(errors="replace") if self.closer else None


@dataclasses.dataclass(frozen=True)
class AgentContext:
    """What the agent's parts that follow etcd share: the control watch, the election, the
    closer and its node watch.

    Attributes:
        distrust: called with a reason when a watch failed (the view may be stale).
        wake: called when the duty thread must step (a watch event, a copy to re-list).
    """

    coord: Coordinator
    control: Control
    grace: OutageGrace
    clock: Clock
    me: str
    distrust: Callable[[str], None]
    wake: Callable[[], None]


class ControlWatch:
    """Lists the control keys into ``agent.control`` and follows them with a watch (a member
    of the round the copy keeps, ``agent.me``, writes it back after a loss).

    Attributes:
        stale: set when the copy must be re-listed before it is trusted again.
        events: watch events received: for benches.
    """

    def __init__(self, agent: AgentContext) -> None:
        self._coord, self._control, self._grace = agent.coord, agent.control, agent.grace
        self._me, self._distrust, self._wake = agent.me, agent.distrust, agent.wake
        self._watch: Watch | None = None
        self.stale = threading.Event()
        self.events = 0

    def relist_if_stale(self) -> None:
        """Re-lists when :attr:`stale` is set (it stays set if the listing fails)."""
        if self.stale.is_set():
            self.stale.clear()
            try:
                self.relist()
            except Exception:
                self.stale.set()  # the duty thread tries again in a second
                raise

    def relist(self) -> None:
        """Lists the control keys; watches them first, and afresh when etcd's revision went
        back."""
        control = self._control
        with control.cond:
            seen = control.revision
        kvs, revision = self._grace.call(lambda: self._coord.get_prefix(control.round_key),
                                         "listing the rendezvous")
        with control.cond:
            before, kept = control.revision, control.round
        # Went back: older than what this copy had before the listing was asked for. Older
        # only than what the watch brought while the listing was on its way is a race, not a
        # loss (at N = 1,000 it raised 24 false alarms in one run): the load drops those
        # events, so the watch starts again from the listing, without the alarm.
        wiped = revision < seen
        raced = revision < before
        # No round while this node trains in one: etcd lost it (nothing deletes a round). The
        # revision need not have gone back: the daemons' re-writes can carry a wiped etcd past
        # it before this listing.
        if kept is not None and self._me in kept.members \
                and not any(kv.key == control.round_key for kv in kvs):
            kvs = [*kvs, restore_round(self._coord, self._grace, control.round_key, kept)]
        control.load(kvs, revision)
        if wiped or raced or self._watch is None:
            if wiped:
                log.warning("etcd's revision went back (%d < %d): its data was lost; watching "
                            "the rendezvous afresh", revision, before)
            self.stop()
            self._watch = self._grace.call(
                lambda: self._coord.watch_prefix(control.round_key, self._on_watch,
                                                 revision + 1),
                "watching the rendezvous")

    def _on_watch(self, batch: Any) -> None:
        if isinstance(batch, CoordinationError):
            if not isinstance(batch, Compacted):
                self._distrust(f"rendezvous watch: {batch}")
            self.stale.set()
            self._wake()
            return
        events = list(batch)
        self.events += len(events)
        self._control.apply(events)

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
