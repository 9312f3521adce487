"""elasticd's own torch ``RendezvousHandler`` on etcd v3: per-node keys, one elected closer.

torch's dynamic rendezvous keeps every participant in one pickled blob that every heartbeat
rewrites whole and every agent re-reads: quadratic traffic, compare-and-set storms, and code
execution for whoever can write the key (docs/scale.md). This handler implements torch's
interface (``torch/distributed/elastic/rendezvous/api.py``) on its own keys (:mod:`.records`):

* **Joining** writes one JSON record under the agent's own etcd lease (:mod:`.join`). The lease
  *is* the heartbeat: nothing is rewritten on a timer. The record names a port this node holds
  free for its workers' store, so the round record names the workers' ``MASTER_ADDR``/``PORT``.
* **One closer**, elected under its lease (:mod:`.election`), closes each round with one
  transaction that also compares its own election key (:mod:`.closer`), and writes the waiting
  summary ``num_nodes_waiting`` reads.
* **Watching**, not polling, and O(1) events per agent per round: every agent watches only
  the control keys (:mod:`.control`); the closer alone watches the node records.
  ``num_nodes_waiting()``, which torch's agent calls every monitor interval, makes no request.
* **Outage grace** (:mod:`.grace`, :mod:`.plugin`) and **provisional expiry** (:mod:`.trust`,
  :mod:`.rounds`' Dead rule).
* **Store.** ``next_rendezvous`` returns the etcd-backed store of :mod:`.store` under a
  per-round prefix (torch's ``torch.rendezvous.<run>.<round>``). ``use_agent_store`` is False:
  workers host their own TCPStore at the rank-0 node's address and port (:mod:`.plugin`). A
  blocking wait in the store ends at once when a member of the round is dead: torch's rank
  assignment waits for what the agent of rank 0 writes, which a member that left never writes.
* **Gates.** ``join_gate`` runs before this node writes its join record (under a daemon, it
  fences a node declared dead); ``commit_gate`` says whether the job is at a committed step,
  which the ``interval:MIN`` grow policy waits for (unset, the interval alone decides).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elasticd.clock import Clock, SystemClock
from elasticd.coordination.api import CoordinationError, Coordinator
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.lease import LeaseKeeper
from elasticd.rendezvous.closer import Closer
from elasticd.rendezvous.config import HandlerSettings, RendezvousConfig
from elasticd.rendezvous.control import AgentContext, Control, ControlWatch
from elasticd.rendezvous.duty import WAKE_INTERVAL, Duty
from elasticd.rendezvous.election import Election
from elasticd.rendezvous.grace import OutageGrace
from elasticd.rendezvous.join import JoinRecord
from elasticd.rendezvous.records import RoundRecord, Waiting, node_id
from elasticd.rendezvous.rounds import next_round, num_waiting
from elasticd.rendezvous.store import EtcdV3Store
from elasticd.rendezvous.trust import Trust

log = logging.getLogger(__name__)


class EtcdNativeRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` on per-node etcd keys (see the module docstring), over its
    parts: the control copy and its watch, the join record, the duty thread, the trust.

    Args (``coordinator`` and ``settings`` are kept as public attributes, for the duties a
    daemon's agent adds, :mod:`elasticd.agent.torchrun`):
        coordinator: the etcd connection (owned: closed by :meth:`shutdown`).
        prefix: the rendezvous' key directory, ``<prefix>/jobs/<run_id>/rdzv/``.
        addr: this node's address (``--local-addr`` or the host name).
        clock: time source for the lease, trust and absences.
    """

    _count = 0
    _count_lock = threading.Lock()

    def __init__(self, coordinator: Coordinator, prefix: bytes, settings: HandlerSettings,
                 addr: str, grace: OutageGrace | None = None,
                 clock: Clock | None = None) -> None:
        with self._count_lock:
            EtcdNativeRendezvousHandler._count += 1
            local_id = EtcdNativeRendezvousHandler._count
        self.coordinator, self.settings = coordinator, settings
        self.addr = addr
        self.me = me = node_id(addr, os.getpid(), local_id)
        self._grace = grace = grace or OutageGrace()
        self._clock = clock = clock or SystemClock()
        self._trust = Trust(settings.liveness_ttl, clock)
        self._control = control = Control(prefix + b"native/", clock)
        self._duty = Duty(control, clock, self._duty_step)
        agent = AgentContext(coordinator, control, grace, clock, me, self._trust.distrust,
                             self._duty.kick)
        self._control_watch = ControlWatch(agent)
        self._store = EtcdV3Store(coordinator, prefix + b"store/", timeout=settings.store_timeout,
                                  grace=grace, abort=self._round_left)
        self._keeper = LeaseKeeper(coordinator, settings.liveness_ttl,
                                   EtcdHealth(describe="etcd (rendezvous)"),
                                   on_change=self._lease_changed, clock=clock,
                                   on_failure=lambda: self._trust.distrust("etcd call failed"))
        self._join = JoinRecord(coordinator, self._keeper, grace,
                                control.nodes_prefix + me.encode(), me, addr)
        self._election = Election(agent, self._keeper, lambda revision: Closer(
            agent, revision, settings, prefix + b"store/"))
        self._reported_gone: set[tuple[int, str]] = set()
        #: Called with the ids of members of this node's current round once they are dead
        #: (confirmed). Under a daemon, restarts this node's workers (see plugin.py).
        self.on_round_broken: Callable[[list[str]], None] | None = None
        #: Called before this node writes its join record; may block, or end the process.
        #: Under a daemon, fences a node whose daemon was declared dead (see plugin.py).
        self.join_gate: Callable[[], object] | None = None
        #: Whether the job is at a committed step now (``interval:MIN`` grow policy only);
        #: called from ``num_nodes_waiting``, so it must answer without blocking.
        self.commit_gate: Callable[[], bool] | None = None
        #: Rounds this handler entered: (round number, seconds next_rendezvous took). For
        #: benches.
        self.rounds: list[tuple[int, float]] = []
        #: Monotonic moments of the last next_rendezvous: ``called``, ``gated`` (the join
        #: gate let it through), ``joined`` (this node's record written), ``returned``. For
        #: benches: where a round's time went (the in-process path's timeline).
        self.moments: dict[str, float] = {}

    # -- lifecycle ------------------------------------------------------------------------

    def _start(self) -> None:
        """Grants the lease, lists the control keys, watches them and starts the duty thread
        (first call only)."""
        if self._duty.started:
            return
        self._grace.call(self._keeper.grant, "granting the rendezvous lease")
        self._keeper.start()
        self._control_watch.relist()
        self._duty.start()

    def _lease_changed(self) -> None:
        """The keeper lost or replaced the lease: re-write this node's record under the new
        one (a provisional rejoin), and re-list (the watch may have missed the outage)."""
        lease = self._keeper.lease
        self._control_watch.stale.set()
        self._duty.kick()
        if lease is None:
            self._trust.distrust("the rendezvous lease was lost")
        elif not self._duty.stopped:
            self._join.rewrite(lease)

    def _duty_step(self) -> float | None:
        """One pass of the duty thread: re-list if asked, then the election's step
        (:mod:`.election`). Returns when to pass again."""
        self._control_watch.relist_if_stale()
        return self._election.step(self._clock.monotonic(), self._trust.until)

    # -- torch's interface ----------------------------------------------------------------

    def get_backend(self) -> str:
        return self.settings.backend

    @property
    def use_agent_store(self) -> bool:
        """False: workers host their own TCPStore (see the module docstring)."""
        return False

    def get_run_id(self) -> str:
        return self.settings.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Joins the next round and blocks until a round that includes this node closes.

        Raises:
            RendezvousClosedError: the rendezvous is closed.
            RendezvousTimeoutError: no round took this node within ``join_timeout`` (a spare of
                a full running round waits without limit).
            RendezvousStateError: the stored round record is not one this code reads.
            RendezvousConnectionError: etcd unreachable for longer than the grace period.
        """
        started = self._clock.monotonic()
        self.moments = {"called": started}
        self._start()
        control = self._control
        if self.join_gate is not None:  # may wait: the target is read after it
            self.join_gate()
        self.moments["gated"] = self._clock.monotonic()
        with control.cond:
            if control.closed:
                raise RendezvousClosedError(f"rendezvous {self.settings.run_id!r} is closed")
            target = next_round(control.round)
        self._join.write(target)
        self.moments["joined"] = self._clock.monotonic()
        log.info("node %s joins round %d of rendezvous %r", self.me, target, self.settings.run_id)
        deadline = started + self.settings.join_timeout
        spare = False
        with control.cond:
            while True:
                if control.closed:
                    raise RendezvousClosedError(f"rendezvous {self.settings.run_id!r} is closed")
                if control.round_error:
                    raise RendezvousStateError(
                        f"rendezvous {self.settings.run_id!r}: {control.round_error}; or delete "
                        f"{control.round_key.decode(errors='replace')} to start afresh")
                last = control.round
                if last is not None and last.round >= target:
                    rank = last.rank_of(self.me)
                    if rank is not None:
                        break
                    # A round closed without this node: wait for the next one.
                    spare = len(last.members) >= self.settings.max_nodes
                    log.info("round %d closed without node %s (%d members): waiting as %s",
                             last.round, self.me, len(last.members),
                             "a spare" if spare else "a late node")
                    target = last.round + 1
                    continue
                now = self._clock.monotonic()
                if not spare and now >= deadline:
                    raise RendezvousTimeoutError(
                        f"node {self.me} was not admitted to rendezvous {self.settings.run_id!r} "
                        f"within join_timeout={self.settings.join_timeout:g}s (closer: "
                        f"{control.closer_node() or 'none yet'}, waiting: {control.waiting})")
                control.cond.wait(min(WAKE_INTERVAL, deadline - now) if not spare
                                  else WAKE_INTERVAL)
        self._join.port.release()
        self.moments["returned"] = self._clock.monotonic()
        took = self.moments["returned"] - started
        self.rounds.append((last.round, took))
        log.info("node %s is rank %d of %d in round %d of rendezvous %r (%.2fs)", self.me, rank,
                 len(last.members), last.round, self.settings.run_id, took)
        store = dist.PrefixStore(f"torch.rendezvous.{self.settings.run_id}.{last.round}",
                                 self._store)
        if last.master_port:
            info = RendezvousStoreInfo(last.master_addr or self.addr, last.master_port)
        else:  # rank 0 held no port: ask the store, as torch's handlers do
            info = RendezvousStoreInfo.build(rank, store, local_addr=self.addr)
        return RendezvousInfo(store, rank, len(last.members), info)

    @property
    def daemon_of(self) -> Callable[[], tuple[str, int] | None] | None:
        """Names the elasticd node whose daemon runs this agent and that daemon's lease, in
        each join record, so that the daemons' ``failed`` record of it drops this member at
        once (:mod:`.failures`); None, or returning None: no daemon."""
        return self._join.daemon_of

    @daemon_of.setter
    def daemon_of(self, fn: Callable[[], tuple[str, int] | None] | None) -> None:
        self._join.daemon_of = fn

    @property
    def daemon_key(self) -> bytes | None:
        """The daemon's node record: when set, the join record is written only while that
        record is bound to the lease ``daemon_of`` names (else it is read, and the write goes
        again): ``daemon_of`` may then answer from a view instead of a read
        (:mod:`.join`)."""
        return self._join.daemon_key

    @daemon_key.setter
    def daemon_key(self, key: bytes | None) -> None:
        self._join.daemon_key = key

    def _round_left(self) -> str | None:
        """Why a blocking wait in the store can stop now: a member of the round this node is
        in is dead (confirmed), so what it was to write (torch's rank assignment, written by
        the agent of rank 0) will never come. The agent then fails at once and is restarted
        into a new round, instead of after the store's timeout (60 s)."""
        if not self._duty.running:
            return None
        gone = self.gone_members()
        with self._control.cond:
            current = self._control.round
        if not gone or current is None or self.me not in current.members:
            return None
        return f"member(s) {', '.join(gone)} of round {current.round} left the rendezvous"

    def on_change(self, fn: Callable[[], None]) -> None:
        """Calls ``fn`` after every change of this node's copy of the rendezvous state (a
        member's death confirmed, a round closed, a node waiting), from the watch's thread
        and under its lock: ``fn`` must not block. What :meth:`num_nodes_waiting` answers
        may have changed then: an in-process agent asks at once instead of at its next poll."""
        self._control.listeners.append(fn)

    def gone_members(self) -> list[str]:
        """Members of the current round the closer counts as dead (empty while this node
        distrusts its own view)."""
        if not self._trust.trusted():
            return []
        with self._control.cond:
            current, waiting = self._control.round, self._control.waiting
        if current is None or waiting is None or waiting.round != current.round:
            return []
        members = set(current.members)
        return sorted(m for m in waiting.dead if m in members)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to enter: rejoining members, and waiting nodes when the round has
        room. From the closer's summary: no etcd request, so an outage cannot fail it."""
        if self._control_watch.stale.is_set() and self._duty.running:
            self._duty.kick()  # the duty thread re-lists; this call must not block
        gone = self.gone_members()
        with self._control.cond:
            current, waiting = self._control.round, self._control.waiting
        if current is not None and gone and self.on_round_broken is not None \
                and self.me in current.members:
            new = [g for g in gone if (current.round, g) not in self._reported_gone]
            if new:
                self._reported_gone.update((current.round, g) for g in new)
                self.on_round_broken(new)
        return num_waiting(current, waiting, self.settings.max_nodes, gone, self.settings.grow,
                           now=self._clock.wall(), at_commit=self._at_commit(current, waiting))

    def _at_commit(self, current: RoundRecord | None, waiting: Waiting | None) -> bool:
        """The commit gate's answer, asked only when it can matter (``interval:MIN``, the
        interval over, a newcomer waiting: the gate watches etcd only while asked). A gate
        that fails answers no: the newcomer waits for the next ask."""
        interval = self.settings.grow_interval
        if self.commit_gate is None or interval is None or current is None \
                or waiting is None or waiting.round != current.round or not waiting.outsiders \
                or self._clock.wall() - current.grew_at < interval:
            return True
        try:
            return bool(self.commit_gate())
        except Exception as exc:  # noqa: BLE001 - the agent's monitor loop must go on
            log.warning("commit gate failed (%s): not growing now", exc)
            return False

    def is_closed(self) -> bool:
        with self._control.cond:
            if self._duty.started:
                return self._control.closed
        return self._grace.call(lambda: self.coordinator.get(self._control.closed_key),
                                "reading whether the rendezvous is closed") is not None

    def set_closed(self) -> None:
        self._grace.call(lambda: self.coordinator.put(self._control.closed_key, b'{"v":2}'),
                         "closing the rendezvous")
        with self._control.cond:
            self._control.closed = True
            self._control.cond.notify_all()

    def shutdown(self) -> bool:
        """Leaves: revokes the lease (deleting this node's record) and closes the rendezvous,
        unless this agent is ending with an error and ``close_on_failure`` is off (a daemon
        restarts it: one agent's error must not end every node's).

        Returns:
            True when the rendezvous was closed or deliberately left open, False when etcd
            could not be reached to close it.
        """
        failing = sys.exc_info()[0] is not None
        closed = True
        try:
            if failing and not self.settings.close_on_failure:
                log.info("agent ends with an error: leaving rendezvous %r open for its restart "
                         "(close_on_failure=false)", self.settings.run_id)
            else:
                try:
                    self.set_closed()
                except Exception as exc:  # noqa: BLE001 - torch's handler also returns False
                    log.warning("could not close rendezvous %r: %s", self.settings.run_id, exc)
                    closed = False
        finally:
            self.stop()
        return closed

    def stop(self) -> None:
        """Revokes the lease and stops the watches, without closing the rendezvous."""
        if self._duty.stopped:
            return
        self._duty.stop()
        self._control_watch.stop()
        self._election.stop()
        self._join.port.release()
        try:
            self._keeper.stop(revoke=self._duty.started)
        except CoordinationError as exc:
            log.warning("could not revoke the rendezvous lease (it expires in %ds): %s",
                        self.settings.liveness_ttl, exc)


def create_handler(params: RendezvousParameters, backend_name: str,
                   coordinator: Coordinator | None = None) -> EtcdNativeRendezvousHandler:
    """Builds the handler from torchrun's parameters (``backend_name``: the entry point's
    name; ``coordinator``: an existing connection, for tests, else one to ``--rdzv-endpoint``)."""
    from elasticd.coordination.etcd import EtcdCoordinator
    from elasticd.coordination.keys import Keyspace

    cfg = RendezvousConfig.from_params(params, backend_name)
    if cfg.ignored:
        log.info("rdzv-conf %s: ignored (settings of torch's dynamic rendezvous; this one "
                 "keeps liveness by lease)", ", ".join(cfg.ignored))
    coordinator = coordinator or EtcdCoordinator(cfg.etcd)
    grace = OutageGrace(cfg.grace_period, where=cfg.etcd.describe())
    addr = params.local_addr or socket.getfqdn()
    return EtcdNativeRendezvousHandler(
        coordinator, Keyspace(cfg.key_prefix).rendezvous(cfg.handler.run_id).prefix,
        cfg.handler, addr, grace=grace)
