"""The closer's duty: follow every node record, close each round, summarize who waits.

One agent of the run holds the closer's election key (``native/round.closer``, created only if
absent and bound to its lease, as in etcd's election recipe). While it does, it follows the node
records and the daemons' failure marks with watches of its own (:mod:`.node_watch`, which keeps
the counts of :class:`~.tally.Tally`, O(1) per node event; :mod:`.failures`), and asks the round decision
(:func:`~.rounds.decide_close`) only when the counts say the round may close. It closes a round
with one transaction that compares the round key's ``mod_revision`` *and* its own election key's
``create_revision``: a closer whose lease expired (and whose key someone else re-created) cannot
write. It writes the waiting summary the same way. Every other agent watches only the control
keys (:mod:`.control`).

This object does the I/O; its decisions are :mod:`.rounds` and :mod:`.tally`. The handler's
duty thread calls :meth:`Closer.step`; the node watch's thread calls
:meth:`~.node_watch.NodeWatch.on_nodes` and :meth:`~.node_watch.NodeWatch.on_marks`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from elasticd.coordination.api import Compare, CoordinationError, KeyValue, Put
from elasticd.rendezvous.control import AgentContext
from elasticd.rendezvous.node_watch import NodeWatch
from elasticd.rendezvous.records import NodeRecord, RoundRecord, Waiting
from elasticd.rendezvous.rounds import SUMMARY_REFRESH, decide_close, grew_at, next_round, \
    summary_news

if TYPE_CHECKING:  # config reads torch's parameters; the closer needs no torch
    from elasticd.rendezvous.config import HandlerSettings

log = logging.getLogger("elasticd.rendezvous.handler")


class Closer:
    """The closer's duty while this agent holds the election key.

    Args:
        election: the election key's ``create_revision`` (what every write compares).
        settings: the run's id, sizes, ``last_call`` and ``liveness_confirm``.
        store_prefix: the run's store directory; the closer deletes stores two rounds old.
    """

    def __init__(self, agent: AgentContext, election: int, settings: HandlerSettings,
                 store_prefix: bytes = b"") -> None:
        self._coord, self._control, self.me = agent.coord, agent.control, agent.me
        self.election, self._settings = election, settings
        self._grace, self._clock, self._store_prefix = agent.grace, agent.clock, store_prefix
        #: The node records, listed and watched (its ``events`` and ``cpu``: for benches).
        self.nodes = NodeWatch(agent)
        self._round_revision = -1  # the round record the counts are for
        self._min_since: float | None = None
        self._written: Waiting | None = None
        self._written_at = float("-inf")
        #: CPU seconds :meth:`step` took (by thread time, added by its caller): for benches.
        self.cpu = 0.0

    def stop(self) -> None:
        self.nodes.stop()

    # -- the duty -------------------------------------------------------------------------

    def step(self, trusted: bool) -> float | None:
        """Closes the round when it may, writes the summary when it says something new.

        Args:
            trusted: whether this agent trusts its view of etcd now (else nobody is dead).

        Returns:
            The monotonic time to step again at the latest (None: at the next event).
        """
        self.nodes.refresh()
        try:
            return self._duty(trusted)
        finally:  # after the first close attempt (a takeover's), not before it
            self.nodes.follow()

    def _duty(self, trusted: bool) -> float | None:
        now = self._clock.monotonic()
        with self._control.cond:
            last, revision = self._control.round, self._control.round_revision
            halted = self._control.closed or bool(self._control.round_error)
        if halted:
            return None
        wakes: list[float] = []
        members: tuple[str, ...] | None = None
        with self.nodes.counts() as tally:
            if revision != self._round_revision:
                tally.new_round(last, now)
                self._round_revision, self._min_since = revision, None
                self._written, self._written_at = None, float("-inf")
            s = self._settings
            if tally.may_close(s.min_nodes):
                over = self._min_since is not None and now - self._min_since >= s.last_call
                decision = decide_close(tally.nodes, last, s.min_nodes, s.max_nodes, over)
                if decision.members is not None:
                    members = decision.members
                    master = tally.nodes.get(members[0])
                elif decision.last_call:
                    self._min_since = now if self._min_since is None else self._min_since
                    wakes.append(self._min_since + s.last_call)
            else:
                self._min_since = None
            summary = tally.waiting(tally.dead(now, s.liveness_confirm, trusted))
            due = tally.next_confirm(now, s.liveness_confirm)
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
            ok, written = self._guarded(self._control.waiting_key, None, summary.encode())
            if ok:
                self._written, self._written_at = summary, now
                self._control.set(KeyValue(self._control.waiting_key, summary.encode(),
                                           create_revision=written, mod_revision=written))
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
            run = self._settings.run_id
            old = self._store_prefix + f"torch.rendezvous.{run}.{number - 2}/".encode()
            try:
                self._coord.delete_prefix(old)
            except CoordinationError as exc:
                log.debug("could not delete the store of round %d: %s", number - 2, exc)
