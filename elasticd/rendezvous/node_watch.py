"""The closer's view of the node records: listed once, then followed by a watch of its own.

It keeps the counts of :class:`~.tally.Tally` (O(1) per event) under its lock; the closer reads
them through :meth:`NodeWatch.counts`. The daemons' failure marks (``native/failed/``,
:mod:`.failures`) are listed and followed beside the records, by a second watch: a mark drops
the records it dooms the moment it is created, before its writer's deletes of them arrive. The
two watches are two streams (no order between them): what a mark drops is decided by
revision (a record written before the mark's creation), not by which event came first.
A watch error raises the re-list flag (and, unless the watch was only compacted, makes the
agent distrust its view); a listing whose revision went back (etcd lost its data) re-creates
the watches.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator

from elasticd.clock import thread_cpu
from elasticd.coordination.api import Compacted, CoordinationError, EventType, KeyValue, Watch
from elasticd.coordination.records import Complaints
from elasticd.rendezvous.control import AgentContext
from elasticd.rendezvous.failures import mark_prefix, marked_members, parse_mark_key
from elasticd.rendezvous.records import NodeRecord, RecordError
from elasticd.rendezvous.tally import Tally

log = logging.getLogger("elasticd.rendezvous.handler")


class NodeWatch:
    """The node records under ``prefix``, counted, and the failure marks beside them.

    Attributes:
        events: watch events of the node records handled.
        cpu: CPU seconds the watch callbacks took (by thread time): for benches.
    """

    def __init__(self, agent: AgentContext) -> None:
        self._coord, self._grace, self._clock = agent.coord, agent.grace, agent.clock
        self._prefix, self._distrust = agent.control.nodes_prefix, agent.distrust
        self._native = agent.control.native
        self._wake = agent.wake
        self._lock = threading.Lock()
        self._tally = Tally()
        self._revision = 0  # of the node listing and the events applied since
        self._watch: Watch | None = None
        self._marks_revision = 0  # of the marks' listing and the events applied since
        self._marks_watch: Watch | None = None
        self._relist = True
        self._unwatched = (0, 0)  # the revisions a listing asked the watches to start from
        self._complaints = Complaints(log)  # once a key, and bounded: keys are anyone's
        self.events = 0
        self.cpu = 0.0

    @contextlib.contextmanager
    def counts(self) -> Iterator[Tally]:
        """The counts, under the lock the watch callback takes."""
        with self._lock:
            yield self._tally

    def refresh(self) -> None:
        """Lists the records and the marks when asked: first, and after a watch error. The
        watches follow in :meth:`follow`, after the closer's first look at the listing: a new
        closer whose listing already holds a closable round (a closer's takeover, the victim's
        record gone with its lease) closes it two watch creations sooner."""
        if not self._relist:
            return
        self._relist = False
        kvs, revision = self._grace.call(lambda: self._coord.get_prefix(self._prefix),
                                         "listing the rendezvous nodes")
        prefix = mark_prefix(self._native)
        marks, marks_revision = self._grace.call(lambda: self._coord.get_prefix(prefix),
                                                 "listing the rendezvous' failure marks")
        now = self._clock.monotonic()
        with self._lock:
            wiped = revision < self._revision or marks_revision < self._marks_revision
            self._tally.load_marks(m for kv in marks if (m := self._decode_mark(kv)) is not None)
            self._tally.load([r for kv in kvs if (r := self._decode(kv)) is not None], now)
            self._revision, self._marks_revision = revision, marks_revision
        # From the listing's revision on: nothing written after it is missed, however late
        # the watches are created.
        self._unwatched = (revision + 1 if self._watch is None or wiped else 0,
                           marks_revision + 1 if self._marks_watch is None or wiped else 0)

    def follow(self) -> None:
        """Creates the watches a listing asked for (from the revision after it)."""
        (nodes_from, marks_from), self._unwatched = self._unwatched, (0, 0)
        if nodes_from:
            if self._watch is not None:
                self._watch.cancel()
            self._watch = self._grace.call(
                lambda: self._coord.watch_prefix(self._prefix, self.on_nodes, nodes_from),
                "watching the rendezvous nodes")
        if marks_from:
            prefix = mark_prefix(self._native)
            if self._marks_watch is not None:
                self._marks_watch.cancel()
            self._marks_watch = self._grace.call(
                lambda: self._coord.watch_prefix(prefix, self.on_marks, marks_from),
                "watching the rendezvous' failure marks")

    def _failed_watch(self, what: str, error: CoordinationError) -> None:
        if not isinstance(error, Compacted):
            self._distrust(f"rendezvous {what} watch: {error}")
        self._relist = True
        self._wake()

    def on_nodes(self, batch: Any) -> None:
        """The node watch's callback: O(1) per event."""
        if isinstance(batch, CoordinationError):
            self._failed_watch("node", batch)
            return
        now, cpu = self._clock.monotonic(), thread_cpu()
        with self._lock:
            for e in batch:
                if e.kv.mod_revision <= self._revision:
                    continue  # in the listing already
                self._revision = e.kv.mod_revision
                self.events += 1
                node = e.kv.key[len(self._prefix):].decode(errors="replace")
                if e.type is EventType.PUT:
                    rec = self._decode(e.kv)
                    if rec is not None:
                        self._tally.put(rec, now)
                else:
                    self._tally.delete(node, now)
            self.cpu += thread_cpu() - cpu
        self._wake()

    def on_marks(self, batch: Any) -> None:
        """The marks watch's callback: a mark created (or rewritten with the members its
        writer deleted) drops what it dooms, O(N) once a failure; a mark gone is forgotten."""
        if isinstance(batch, CoordinationError):
            self._failed_watch("failure mark", batch)
            return
        now, cpu = self._clock.monotonic(), thread_cpu()
        with self._lock:
            before = set(self._tally.failed)
            for e in batch:
                if e.kv.mod_revision <= self._marks_revision:
                    continue  # in the listing already
                self._marks_revision = e.kv.mod_revision
                if e.type is EventType.PUT:
                    mark = self._decode_mark(e.kv)
                    if mark is not None:
                        self._tally.mark(*mark, now)
                elif (of := parse_mark_key(self._native, e.kv.key)) is not None:
                    self._tally.unmark(*of)
            found = sorted(self._tally.failed - before)
            self.cpu += thread_cpu() - cpu
        if found:
            log.info("member(s) %s: their node was recorded failed; gone without waiting for "
                     "liveness_confirm", ", ".join(found))
        self._wake()

    def _decode_mark(self, kv: KeyValue) -> tuple[str, int, int, set[str]] | None:
        """(daemon, lease, the revision that created the mark, the members it names)."""
        of = parse_mark_key(self._native, kv.key)
        if of is None:
            return None
        return of[0], of[1], kv.create_revision, marked_members(kv.value)

    def _decode(self, kv: KeyValue) -> NodeRecord | None:
        try:
            rec = NodeRecord.decode(kv.value, kv.create_revision, kv.mod_revision)
        except RecordError as exc:
            self._complaints.warn(kv.key, b"", "refusing rendezvous node %s: %s",
                                  kv.key.decode(errors="replace"), exc)
            return None
        name = kv.key[len(self._prefix):].decode(errors="replace")
        return rec if rec.node == name else None

    def stop(self) -> None:
        for watch in (self._watch, self._marks_watch):
            if watch is not None:
                watch.cancel()
        self._watch = self._marks_watch = None
