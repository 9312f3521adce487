"""The closer's view of the node records: listed once, then followed by a watch of its own.

It keeps the counts of :class:`~.tally.Tally` (O(1) per event) under its lock; the closer reads
them through :meth:`NodeWatch.counts`. A watch error raises the re-list flag (and, unless the
watch was only compacted, makes the agent distrust its view); a listing whose revision went
back (etcd lost its data) re-creates the watch.
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
from elasticd.rendezvous.records import NodeRecord, RecordError
from elasticd.rendezvous.tally import Tally

log = logging.getLogger("elasticd.rendezvous.handler")


class NodeWatch:
    """The node records under ``prefix``, counted.

    Attributes:
        events: watch events handled.
        cpu: CPU seconds the watch callback took (by thread time): for benches.
    """

    def __init__(self, agent: AgentContext) -> None:
        self._coord, self._grace, self._clock = agent.coord, agent.grace, agent.clock
        self._prefix, self._distrust = agent.control.nodes_prefix, agent.distrust
        self._wake = agent.wake
        self._lock = threading.Lock()
        self._tally = Tally()
        self._revision = 0  # of the node listing and the events applied since
        self._watch: Watch | None = None
        self._relist = True
        self._complaints = Complaints(log)  # once a key, and bounded: keys are anyone's
        self.events = 0
        self.cpu = 0.0

    @contextlib.contextmanager
    def counts(self) -> Iterator[Tally]:
        """The counts, under the lock the watch callback takes."""
        with self._lock:
            yield self._tally

    def refresh(self) -> None:
        """Lists the records (and watches them) when asked: first, and after a watch error."""
        if not self._relist:
            return
        self._relist = False
        kvs, revision = self._grace.call(lambda: self._coord.get_prefix(self._prefix),
                                         "listing the rendezvous nodes")
        now = self._clock.monotonic()
        with self._lock:
            wiped = revision < self._revision
            self._tally.load([r for kv in kvs if (r := self._decode(kv)) is not None], now)
            self._revision = revision
        if self._watch is None or wiped:
            if self._watch is not None:
                self._watch.cancel()
            self._watch = self._grace.call(
                lambda: self._coord.watch_prefix(self._prefix, self.on_nodes, revision + 1),
                "watching the rendezvous nodes")

    def on_nodes(self, batch: Any) -> None:
        """The watch's callback: O(1) per event."""
        if isinstance(batch, CoordinationError):
            if not isinstance(batch, Compacted):
                self._distrust(f"rendezvous node watch: {batch}")
            self._relist = True
            self._wake()
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

    def _decode(self, kv: KeyValue) -> NodeRecord | None:
        try:
            rec = NodeRecord.decode(kv.value, kv.create_revision)
        except RecordError as exc:
            self._complaints.warn(kv.key, b"", "refusing rendezvous node %s: %s",
                                  kv.key.decode(errors="replace"), exc)
            return None
        name = kv.key[len(self._prefix):].decode(errors="replace")
        return rec if rec.node == name else None

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
