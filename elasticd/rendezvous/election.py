"""Who closes the rounds: this agent's part in the closer's election, and the closer's duty while
it holds the key.

The closer's key (``native/round.closer``) is taken only if absent, under the agent's lease, as
in etcd's election recipe. When it goes, the others take turns in rank order
(:func:`~.rounds.election_delay`, the closer that went skipped): one takes over, nobody
stampedes. While the key is this
agent's (its value this node, its ``create_revision`` the one this agent wrote), a
:class:`~.closer.Closer` does the duty; it is dropped as soon as the key is not.
"""

from __future__ import annotations

import logging
import random
from typing import Callable

from elasticd.clock import thread_cpu
from elasticd.coordination.api import Compare, KeyValue, Put
from elasticd.coordination.lease import LeaseKeeper
from elasticd.rendezvous.closer import Closer
from elasticd.rendezvous.control import AgentContext
from elasticd.rendezvous.rounds import ELECTION_STEP, election_delay

log = logging.getLogger("elasticd.rendezvous.handler")


class Election:
    """Takes the closer's key when it is free and this agent's turn has come; holds the duty.

    Args:
        keeper: the agent's lease (the key is bound to it).
        closer: makes the closer's duty for the election key's ``create_revision``.

    Attributes:
        closer: the closer's duty while this agent holds the key, else None.
    """

    def __init__(self, agent: AgentContext, keeper: LeaseKeeper,
                 closer: Callable[[int], Closer]) -> None:
        self._coord, self._control, self._keeper = agent.coord, agent.control, keeper
        self._grace, self._me, self._make = agent.grace, agent.me, closer
        self.closer: Closer | None = None
        self._won: int | None = None  # create_revision of our election key
        self._turn_at: float | None = None
        self._last_closer: str | None = None  # the node whose key this agent saw last

    def step(self, now: float, untrusted_until: float) -> float | None:
        """Drops the duty when the key is not ours, takes the key when it is free and our turn
        has come, and does the duty while it is ours (counting nobody dead while this agent
        distrusts its view, until ``untrusted_until``). Returns when to step again (None: at
        the next change of the control keys)."""
        control = self._control
        with control.cond:
            held, last, closed = control.closer, control.round, control.closed
        leading = (held is not None and held.create_revision == self._won
                   and held.value == self._me.encode())
        if not leading and self.closer is not None:
            log.info("node %s is no longer the rendezvous closer", self._me)
            self.closer.stop()
            self.closer = None
        if closed:
            return None
        if held is not None:
            self._last_closer = held.value.decode(errors="replace")
        if held is None:
            if self._turn_at is None:
                self._turn_at = now + election_delay(self._me, last, random.random(),
                                                     self._last_closer)
            if now < self._turn_at:
                return self._turn_at
            self._turn_at = None
            self._elect()  # won: the key's write wakes the duty; lost: the winner's does
            return now + ELECTION_STEP
        self._turn_at = None
        if not leading:
            return None
        if self.closer is None:
            log.info("node %s is the rendezvous closer", self._me)
            self.closer = self._make(held.create_revision)
        cpu = thread_cpu()
        due = self.closer.step(trusted=now >= untrusted_until)
        self.closer.cpu += thread_cpu() - cpu
        if now < untrusted_until:  # look again once the view is trusted
            due = min(due or untrusted_until, untrusted_until)
        return due

    def _elect(self) -> None:
        """Takes the closer's key if it is still free (create-if-absent, under our lease)."""
        lease = self._keeper.lease
        if lease is None:
            return
        key = self._control.closer_key
        ok, revision = self._grace.call(
            lambda: self._coord.transaction([Compare(key, 0)],
                                            [Put(key, self._me.encode(), lease)]),
            "taking the rendezvous closer's key")
        if ok:
            self._won = revision
            self._control.set(KeyValue(key, self._me.encode(), create_revision=revision,
                                       mod_revision=revision, lease=lease))

    def stop(self) -> None:
        """Stops the closer's watch (the key goes with the lease)."""
        if self.closer is not None:
            self.closer.stop()
