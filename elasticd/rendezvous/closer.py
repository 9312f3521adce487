"""The closer's duty: follow every node record, close each round, summarize who waits.

One agent of the run holds the closer's election key (``native/round.closer``, created only if
absent and bound to its lease, as in etcd's election recipe). While it does, it lists the node
records once, follows them with a watch of its own, keeps the counts of :class:`~.tally.Tally`
(O(1) per event), and asks the round decision (:func:`~.rounds.decide_close`) only when the
counts say the round may close. It closes a round with one transaction that compares the round
key's ``mod_revision`` *and* its own election key's ``create_revision``: a closer whose lease
expired (and whose key someone else re-created) cannot write. It writes the waiting summary
the same way. Every other agent watches only the control keys (:mod:`.control`).

This object does the I/O; its decisions are :mod:`.rounds` and :mod:`.tally`. The handler's
duty thread calls :meth:`Closer.step`; the node watch's thread calls :meth:`Closer.on_nodes`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from elasticd.clock import Clock, thread_cpu
from elasticd.coordination.api import (
    Compacted,
    Compare,
    CoordinationError,
    Coordinator,
    EventType,
    KeyValue,
    Put,
    Watch,
)
from elasticd.rendezvous.control import Control
from elasticd.rendezvous.grace import OutageGrace
from elasticd.rendezvous.records import NodeRecord, RecordError, RoundRecord, Waiting
from elasticd.rendezvous.rounds import SUMMARY_REFRESH, decide_close, grew_at, next_round, \
    summary_news
from elasticd.rendezvous.tally import Tally

log = logging.getLogger("elasticd.rendezvous.handler")


class Closer:
    """The closer's duty while this agent holds the election key.

    Args:
        coord: the agent's etcd connection.
        control: the agent's copy of the control keys.
        me: this agent's node id.
        election: the election key's ``create_revision`` (what every write compares).
        min_nodes, max_nodes: ``--nnodes MIN:MAX``.
        last_call: seconds a first round stays open after ``min`` joined.
        confirm: seconds a member's record must be absent before it counts as dead.
        grace: retry policy for etcd outages.
        clock: time source.
        distrust: called with a reason when the node watch failed (the view may be stale).
        wake: called when a watch event arrived (the duty thread then steps).
        store_prefix: the run's store directory; the closer deletes stores two rounds old.
        run_id: the run's id (names the per-round store prefix).
    """

    def __init__(self, coord: Coordinator, control: Control, me: str, election: int,
                 min_nodes: int, max_nodes: int, last_call: float, confirm: float,
                 grace: OutageGrace, clock: Clock, distrust: Callable[[str], None],
                 wake: Callable[[], None], store_prefix: bytes = b"", run_id: str = "") -> None:
        self._coord, self._control, self.me = coord, control, me
        self.election = election
        self._min, self._max = min_nodes, max_nodes
        self._last_call, self._confirm = last_call, confirm
        self._grace, self._clock = grace, clock
        self._distrust, self._wake = distrust, wake
        self._store_prefix, self._run_id = store_prefix, run_id
        self._lock = threading.Lock()
        self._tally = Tally()
        self._revision = 0  # of the node listing and the events applied since
        self._round_revision = -1  # the round record the tally counts for
        self._watch: Watch | None = None
        self._relist = True
        self._min_since: float | None = None
        self._written: Waiting | None = None
        self._written_at = float("-inf")
        self._warned: set[bytes] = set()
        #: Node watch events this closer handled, and the CPU seconds its own work took (the
        #: watch callback and :meth:`step`, by thread time): for benches.
        self.events = 0
        self.cpu = 0.0

    # -- the node watch -------------------------------------------------------------------

    def _list(self) -> None:
        prefix = self._control.nodes_prefix
        kvs, revision = self._grace.call(lambda: self._coord.get_prefix(prefix),
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
                lambda: self._coord.watch_prefix(prefix, self.on_nodes, revision + 1),
                "watching the rendezvous nodes")

    def on_nodes(self, batch: Any) -> None:
        """The node watch's callback: O(1) per event."""
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
                node = e.kv.key[len(self._control.nodes_prefix):].decode(errors="replace")
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
            if kv.key not in self._warned:
                self._warned.add(kv.key)
                log.warning("refusing rendezvous node %s: %s",
                            kv.key.decode(errors="replace"), exc)
            return None
        name = kv.key[len(self._control.nodes_prefix):].decode(errors="replace")
        return rec if rec.node == name else None

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # -- the duty -------------------------------------------------------------------------

    def step(self, trusted: bool) -> float | None:
        """Closes the round when it may, writes the summary when it says something new.

        Args:
            trusted: whether this agent trusts its view of etcd now (else nobody is dead).

        Returns:
            The monotonic time to step again at the latest (None: at the next event).
        """
        if self._relist:
            self._relist = False
            self._list()
        now = self._clock.monotonic()
        with self._control.cond:
            last, revision = self._control.round, self._control.round_revision
            halted = self._control.closed or bool(self._control.round_error)
        if halted:
            return None
        wakes: list[float] = []
        members: tuple[str, ...] | None = None
        with self._lock:
            tally = self._tally
            if revision != self._round_revision:
                tally.new_round(last, now)
                self._round_revision, self._min_since = revision, None
                self._written, self._written_at = None, float("-inf")
            if tally.may_close(self._min):
                over = self._min_since is not None and now - self._min_since >= self._last_call
                decision = decide_close(tally.nodes, last, self._min, self._max, over)
                if decision.members is not None:
                    members = decision.members
                    master = tally.nodes.get(members[0])
                elif decision.last_call:
                    self._min_since = now if self._min_since is None else self._min_since
                    wakes.append(self._min_since + self._last_call)
            else:
                self._min_since = None
            summary = tally.waiting(tally.dead(now, self._confirm, trusted))
            due = tally.next_confirm(now, self._confirm)
        if members is not None:
            self._close(last, revision, members, master)
            return now
        if due is not None:
            wakes.append(due)
        # Before the first round nobody trains: no summary (a member that lost the round
        # record re-rendezvous without one, see rounds.num_waiting).
        refresh = summary.round >= 0 and summary != (self._written or Waiting(summary.round))
        if summary.round < 0:
            pass
        elif summary_news(self._written, summary) or (
                refresh and now - self._written_at >= SUMMARY_REFRESH):
            self._write_summary(summary, now)
        elif refresh:
            wakes.append(self._written_at + SUMMARY_REFRESH)
        return min(wakes) if wakes else None

    def _guarded(self, key: bytes, revision: int | None, value: bytes) -> tuple[bool, int]:
        """One write compared with this closer's election key (and ``key``'s revision)."""
        compares = [Compare(self._control.closer_key, self.election, "create")]
        if revision is not None:
            compares.append(Compare(key, revision))
        return self._grace.call(
            lambda: self._coord.transaction(compares, [Put(key, value)]),
            "writing the rendezvous " + key.rsplit(b"/", 1)[-1].decode(errors="replace"))

    def _close(self, last: RoundRecord | None, revision: int, members: tuple[str, ...],
               master: NodeRecord | None) -> None:
        number = next_round(last)
        record = RoundRecord(number, members, closed_by=self.me,
                             grew_at=grew_at(members, last, self._clock.wall()),
                             master_addr=master.addr if master else "",
                             master_port=master.port if master else 0)
        ok, new_revision = self._guarded(self._control.round_key, revision, record.encode())
        if not ok:
            # Deposed, or the round moved: the control watch brings what happened.
            log.info("node %s could not close round %d (no longer the closer, or the round "
                     "moved)", self.me, number)
            return
        log.info("node %s closed round %d with %d node(s)", self.me, number, len(members))
        self._control.set(KeyValue(self._control.round_key, record.encode(),
                                   create_revision=new_revision, mod_revision=new_revision))
        if number >= 2 and self._store_prefix:  # no agent reads the store of a round two behind
            old = self._store_prefix + f"torch.rendezvous.{self._run_id}.{number - 2}/".encode()
            try:
                self._coord.delete_prefix(old)
            except CoordinationError as exc:
                log.debug("could not delete the store of round %d: %s", number - 2, exc)

    def _write_summary(self, summary: Waiting, now: float) -> None:
        ok, revision = self._guarded(self._control.waiting_key, None, summary.encode())
        if ok:
            self._written, self._written_at = summary, now
            self._control.set(KeyValue(self._control.waiting_key, summary.encode(),
                                       create_revision=revision, mod_revision=revision))
