"""elasticd's own torch ``RendezvousHandler`` on etcd v3: per-node keys, one elected closer.

torch's dynamic rendezvous keeps every participant in one pickled blob that every heartbeat
rewrites whole and every agent re-reads: quadratic traffic, compare-and-set storms, and code
execution for whoever can write the key (docs/scale.md). This handler implements torch's
interface (``torch/distributed/elastic/rendezvous/api.py``) on its own keys (:mod:`.records`):

* **Joining** writes one JSON record, ``native/nodes/<node>``, bound to the agent's own etcd
  lease. The lease *is* the heartbeat: it is kept alive every TTL/3 and nothing is rewritten on
  a timer. The record is rewritten only to ask for a new round, or when the lease was lost and
  re-granted (an etcd outage past the TTL). It carries a port this node holds free for its
  workers' store, so the round record names the workers' ``MASTER_ADDR``/``MASTER_PORT`` and
  no agent asks the store for them.
* **One closer** (:mod:`.closer`), elected under its lease by creating ``native/round.closer``
  only if absent (:mod:`.election`), follows the node records and closes each round with one
  transaction that also compares its own election key: a deposed closer cannot write. It also
  writes the waiting summary ``num_nodes_waiting`` reads. When its key goes, the others take
  turns in rank order (:func:`~.rounds.election_delay`): one takes over, nobody stampedes.
* **Watching**, not polling, and O(1) events per agent per round: every agent watches only
  the control keys (``native/round*``, :mod:`.control`); the closer alone watches the node
  records. ``num_nodes_waiting()``, which torch's agent calls every monitor interval while
  the workers train, reads that copy and makes no etcd request. The copy is re-listed only
  when the watch cannot be trusted: after a watch error or a lost or replaced lease, which
  also covers an etcd data loss (the revision went back: the watch is made afresh).
* **Outage grace.** Every write retries for ``etcd_grace_period`` on an unreachable etcd
  (:mod:`.grace`); the watches re-create themselves. ``num_nodes_waiting`` never fails.
* **Provisional expiry.** An etcd paused past the TTL expires every lease when it resumes; each
  agent re-grants and re-writes its record within a keep-alive period. A member whose record is
  absent counts as dead only after ``liveness_confirm`` seconds while the closer trusts its
  view, and an agent whose own keep-alive failed, whose lease was lost or whose watch broke
  counts nobody as dead for 2 x TTL.
* **Store.** ``next_rendezvous`` returns the etcd-backed store of :mod:`.store` under a
  per-round prefix (torch's ``torch.rendezvous.<run>.<round>``). ``use_agent_store`` is False:
  workers host their own TCPStore at the rank-0 node's address and port, as with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/facts.md: sharing the agent's store across
  restarts let workers read dead peers' addresses). A blocking wait in the store ends at once
  when a member of the round is dead: torch's rank assignment waits for what the agent of rank
  0 writes, and a member that left after the round closed never writes it.
* **Join gate.** ``join_gate``, when set, runs before this node writes its join record; under
  a daemon it fences a node whose daemon was declared dead before it can enter a round.
* **Commit gate.** Under the ``interval:MIN`` grow policy a newcomer takes free room only while
  the job is at a committed step. ``commit_gate``, when set, says whether it is (under a
  daemon, from a watch on the job's replication records: :mod:`elasticd.agent.commit_watch`);
  this layer cannot read those records itself. Unset (plain torchrun: no daemon, no commit
  records), the interval alone decides.

Registered as torchrun's ``etcd-v3`` backend (:mod:`.plugin`). Its rdzv-conf keys are those of
:mod:`.config` (``liveness_ttl`` is this lease's TTL); the keys of torch's dynamic rendezvous
(``keep_alive_*``, ...) are accepted and ignored. No pickle is read or written.
"""

from __future__ import annotations

import datetime
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
from elasticd.coordination.api import Compacted, CoordinationError, Coordinator
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.lease import LeaseKeeper
from elasticd.rendezvous.closer import Closer
from elasticd.rendezvous.config import (
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_LAST_CALL_TIMEOUT,
    RendezvousConfig,
)
from elasticd.rendezvous.control import Control
from elasticd.rendezvous.election import Election
from elasticd.rendezvous.grace import OutageGrace
from elasticd.rendezvous.port import HeldPort
from elasticd.rendezvous.data_loss import restore_round
from elasticd.rendezvous.records import NodeRecord, RoundRecord, node_id
from elasticd.rendezvous.rounds import grow_interval, next_round, num_waiting
from elasticd.rendezvous.store import EtcdV3Store

log = logging.getLogger(__name__)

#: While a rendezvous waits, look again at least this often, seconds (a wake-up bound, not a
#: re-list: the copy is re-listed only after a watch error or a lost lease).
WAKE_INTERVAL = 30.0


class EtcdNativeRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` on per-node etcd keys (see the module docstring).

    Args:
        coordinator: the etcd connection (owned: closed by :meth:`shutdown`).
        prefix: the rendezvous' key directory, ``<prefix>/jobs/<run_id>/rdzv/``.
        run_id: ``--rdzv-id``.
        min_nodes, max_nodes: ``--nnodes MIN:MAX``.
        addr: this node's address (``--local-addr`` or the host name).
        backend_name: what :meth:`get_backend` returns (the entry point's name).
        grace: retry policy for etcd outages.
        ttl: the agent lease's TTL, whole seconds.
        confirm: seconds a member's record must be absent before it counts as dead.
        join_timeout: seconds ``next_rendezvous`` waits for a round that includes this node
            (not while it is the spare of a full, running round).
        last_call: seconds a job's first round stays open after ``min`` nodes joined.
        store_timeout: how long the store's ``get``/``wait`` block.
        grow: the grow policy for nodes beyond a running round (:mod:`.rounds`).
        close_on_failure: whether :meth:`shutdown` during an exception closes the rendezvous.
        clock: time source for the lease, trust and absences.

    Raises:
        ValueError: bad sizes.
    """

    _count = 0
    _count_lock = threading.Lock()

    def __init__(self, coordinator: Coordinator, prefix: bytes, run_id: str, min_nodes: int,
                 max_nodes: int, addr: str, backend_name: str, grace: OutageGrace | None = None,
                 ttl: int = 3, confirm: float = 1.0,
                 join_timeout: float = DEFAULT_JOIN_TIMEOUT,
                 last_call: float = DEFAULT_LAST_CALL_TIMEOUT,
                 store_timeout: datetime.timedelta | None = None, grow: str = "immediate",
                 close_on_failure: bool = True, clock: Clock | None = None) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"--nnodes {min_nodes}:{max_nodes}: need 1 <= MIN <= MAX")
        with self._count_lock:
            EtcdNativeRendezvousHandler._count += 1
            local_id = EtcdNativeRendezvousHandler._count
        self._coord = coordinator
        self._run_id = run_id
        self._max = max_nodes
        self.addr = addr
        self.me = node_id(addr, os.getpid(), local_id)
        self._backend = backend_name
        self._grace = grace or OutageGrace()
        self._clock = clock or SystemClock()
        self._ttl = ttl
        self._join_timeout = join_timeout
        self._close_on_failure = close_on_failure
        self._grow = grow
        self._grow_interval = grow_interval(grow)
        self._control = Control(prefix + b"native/", self._clock)
        self._store = EtcdV3Store(coordinator, prefix + b"store/", timeout=store_timeout,
                                  grace=self._grace, abort=self._round_left)
        self._keeper = LeaseKeeper(coordinator, ttl, EtcdHealth(describe="etcd (rendezvous)"),
                                   on_change=self._lease_changed, clock=self._clock,
                                   on_failure=lambda: self._distrust("etcd call failed"))
        self._election = Election(
            coordinator, self._control, self._keeper, self._grace, self.me,
            lambda revision: Closer(coordinator, self._control, self.me, revision, min_nodes,
                                    max_nodes, last_call, confirm, self._grace, self._clock,
                                    self._distrust, self._kick, prefix + b"store/", run_id))
        self._lock = threading.Lock()
        self._record: NodeRecord | None = None
        self._port = HeldPort()
        self._watch = None
        self._started = False
        self._stopped = False
        self._relist = threading.Event()
        self._kicked = False
        self._duty: threading.Thread | None = None
        self._untrusted_until = float("-inf")
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
        #: Rounds this handler entered: (round number, seconds next_rendezvous took), and the
        #: monotonic time it last returned; control-key watch events received. For benches.
        self.rounds: list[tuple[int, float]] = []
        self.seen_at = 0.0
        self.control_events = 0

    # -- lifecycle ------------------------------------------------------------------------

    def _start(self) -> None:
        """Grants the lease, lists the control keys, watches them and starts the duty thread
        (first call only)."""
        if self._started:
            return
        self._grace.call(self._keeper.grant, "granting the rendezvous lease")
        self._keeper.start()
        self._relist_now(initial=True)
        self._started = True
        self._duty = threading.Thread(target=self._duty_loop, name="rendezvous-duty",
                                      daemon=True)
        self._duty.start()

    def _relist_now(self, initial: bool = False) -> None:
        """Re-lists the control keys; re-creates the watch when etcd's revision went back."""
        control = self._control
        kvs, revision = self._grace.call(lambda: self._coord.get_prefix(control.round_key),
                                         "listing the rendezvous")
        with control.cond:
            before, kept = control.revision, control.round
        wiped = revision < before
        # No round while this node trains in one: etcd lost it (nothing deletes a round). The
        # revision need not have gone back: the daemons' re-writes can carry a wiped etcd past
        # it before this listing.
        if kept is not None and self.me in kept.members \
                and not any(kv.key == control.round_key for kv in kvs):
            kvs = [*kvs, restore_round(self._coord, self._grace, control.round_key, kept)]
        control.load(kvs, revision)
        if initial or wiped or self._watch is None:
            if wiped:
                log.warning("etcd's revision went back (%d < %d): its data was lost; watching "
                            "the rendezvous afresh", revision, before)
            if self._watch is not None:
                self._watch.cancel()
            self._watch = self._grace.call(
                lambda: self._coord.watch_prefix(control.round_key, self._on_watch,
                                                 revision + 1),
                "watching the rendezvous")

    def _on_watch(self, batch: object) -> None:
        if isinstance(batch, CoordinationError):
            if not isinstance(batch, Compacted):
                self._distrust(f"rendezvous watch: {batch}")
            self._relist.set()
            self._kick()
            return
        events = list(batch)  # type: ignore[call-overload]
        self.control_events += len(events)
        self._control.apply(events)

    def _kick(self) -> None:
        with self._control.cond:
            self._kicked = True
            self._control.cond.notify_all()

    def _lease_changed(self) -> None:
        """The keeper lost or replaced the lease: re-write this node's record under the new
        one (a provisional rejoin), and re-list (the watch may have missed the outage)."""
        lease = self._keeper.lease
        self._relist.set()
        self._kick()
        if lease is None:
            self._distrust("the rendezvous lease was lost")
            return
        with self._lock:
            record = self._record
        if record is None or self._stopped:
            return
        try:
            self._coord.put(self._node_key(), record.encode(), lease=lease)
            log.info("rendezvous lease re-granted: node record %s re-written", self.me)
        except CoordinationError as exc:  # the keeper retries and calls us again
            log.warning("could not re-write node record %s: %s", self.me, exc)

    def _distrust(self, reason: str) -> None:
        until = self._clock.monotonic() + 2 * self._ttl
        if self._untrusted_until < self._clock.monotonic():
            log.info("rendezvous: counting no member as dead for %ds (%s)", 2 * self._ttl,
                     reason)
        self._untrusted_until = max(self._untrusted_until, until)

    def _node_key(self) -> bytes:
        return self._control.nodes_prefix + self.me.encode()

    def _write_record(self, target: int) -> None:
        port = self._port.hold(self.addr)
        record = NodeRecord(self.me, target, self.addr, port)
        with self._lock:
            self._record = record

        # A lease lost just now (or lost with etcd's data) is replaced: not a failed agent.
        self._grace.call(lambda: self._keeper.put(self._node_key(), record.encode()),
                         "writing this node's rendezvous record")

    # -- the duty thread: the election and, while this node is the closer, the closer's duty --

    def _duty_loop(self) -> None:
        cond, seen, wake_at = self._control.cond, -1, 0.0
        while True:
            with cond:
                while not self._stopped and not self._kicked and self._control.version == seen:
                    timeout = min(WAKE_INTERVAL, wake_at - self._clock.monotonic())
                    if timeout <= 0:
                        break
                    cond.wait(timeout)
                if self._stopped:
                    return
                self._kicked, seen = False, self._control.version
            try:
                due = self._duty_step()
            except Exception as exc:  # noqa: BLE001 - the duty must go on (torch's agent too)
                log.warning("rendezvous duty: %s", exc)
                due = self._clock.monotonic() + 1.0
            wake_at = due if due is not None else self._clock.monotonic() + WAKE_INTERVAL

    def _duty_step(self) -> float | None:
        """One pass: re-list if asked, then the election's step (:mod:`.election`). Returns
        when to pass again."""
        if self._relist.is_set():
            self._relist.clear()
            try:
                self._relist_now()
            except Exception:
                self._relist.set()  # the loop tries again in a second
                raise
        now = self._clock.monotonic()
        return self._election.step(now, self._untrusted_until)

    # -- torch's interface ----------------------------------------------------------------

    def get_backend(self) -> str:
        return self._backend

    @property
    def use_agent_store(self) -> bool:
        """False: workers host their own TCPStore (see the module docstring)."""
        return False

    def get_run_id(self) -> str:
        return self._run_id

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
        self._start()
        control = self._control
        if self.join_gate is not None:  # may wait: the target is read after it
            self.join_gate()
        with control.cond:
            if control.closed:
                raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
            target = next_round(control.round)
        self._write_record(target)
        log.info("node %s joins round %d of rendezvous %r", self.me, target, self._run_id)
        deadline = started + self._join_timeout
        spare = False
        with control.cond:
            while True:
                if control.closed:
                    raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
                if control.round_error:
                    raise RendezvousStateError(
                        f"rendezvous {self._run_id!r}: {control.round_error}; or delete "
                        f"{control.round_key.decode(errors='replace')} to start afresh")
                last = control.round
                if last is not None and last.round >= target:
                    rank = last.rank_of(self.me)
                    if rank is not None:
                        break
                    # A round closed without this node: wait for the next one.
                    spare = len(last.members) >= self._max
                    log.info("round %d closed without node %s (%d members): waiting as %s",
                             last.round, self.me, len(last.members),
                             "a spare" if spare else "a late node")
                    target = last.round + 1
                    continue
                now = self._clock.monotonic()
                if not spare and now >= deadline:
                    raise RendezvousTimeoutError(
                        f"node {self.me} was not admitted to rendezvous {self._run_id!r} "
                        f"within join_timeout={self._join_timeout:g}s (closer: "
                        f"{control.closer_node() or 'none yet'}, waiting: {control.waiting})")
                control.cond.wait(min(WAKE_INTERVAL, deadline - now) if not spare
                                  else WAKE_INTERVAL)
        self._port.release()
        self.seen_at = self._clock.monotonic()
        took = self.seen_at - started
        self.rounds.append((last.round, took))
        log.info("node %s is rank %d of %d in round %d of rendezvous %r (%.2fs)", self.me, rank,
                 len(last.members), last.round, self._run_id, took)
        store = dist.PrefixStore(f"torch.rendezvous.{self._run_id}.{last.round}", self._store)
        if last.master_port:
            info = RendezvousStoreInfo(last.master_addr or self.addr, last.master_port)
        else:  # rank 0 held no port: ask the store, as torch's handlers do
            info = RendezvousStoreInfo.build(rank, store, local_addr=self.addr)
        return RendezvousInfo(store, rank, len(last.members), info)

    def _round_left(self) -> str | None:
        """Why a blocking wait in the store can stop now: a member of the round this node is
        in is dead (confirmed), so what it was to write (torch's rank assignment, written by
        the agent of rank 0) will never come. The agent then fails at once and is restarted
        into a new round, instead of after the store's timeout (60 s)."""
        if not self._started or self._stopped:
            return None
        gone = self.gone_members()
        with self._control.cond:
            current = self._control.round
        if not gone or current is None or self.me not in current.members:
            return None
        return f"member(s) {', '.join(gone)} of round {current.round} left the rendezvous"

    def gone_members(self) -> list[str]:
        """Members of the current round the closer counts as dead (empty while this node
        distrusts its own view)."""
        if self._clock.monotonic() < self._untrusted_until:
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
        if self._relist.is_set() and self._started and not self._stopped:
            self._kick()  # the duty thread re-lists; this call must not block
        gone = self.gone_members()
        with self._control.cond:
            current, waiting = self._control.round, self._control.waiting
        if current is not None and gone and self.on_round_broken is not None \
                and self.me in current.members:
            new = [g for g in gone if (current.round, g) not in self._reported_gone]
            if new:
                self._reported_gone.update((current.round, g) for g in new)
                self.on_round_broken(new)
        return num_waiting(current, waiting, self._max, gone, self._grow,
                           now=self._clock.wall(), at_commit=self._at_commit(current))

    def _at_commit(self, current: RoundRecord | None) -> bool:
        """The commit gate's answer, asked only when it can matter (``interval:MIN``, the
        interval over). A gate that fails answers no: the newcomer waits for the next ask."""
        if self.commit_gate is None or self._grow_interval is None or current is None \
                or self._clock.wall() - current.grew_at < self._grow_interval:
            return True
        try:
            return bool(self.commit_gate())
        except Exception as exc:  # noqa: BLE001 - the agent's monitor loop must go on
            log.warning("commit gate failed (%s): not growing now", exc)
            return False

    def is_closed(self) -> bool:
        with self._control.cond:
            if self._started:
                return self._control.closed
        return self._grace.call(lambda: self._coord.get(self._control.closed_key),
                                "reading whether the rendezvous is closed") is not None

    def set_closed(self) -> None:
        self._grace.call(lambda: self._coord.put(self._control.closed_key, b'{"v":2}'),
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
            if failing and not self._close_on_failure:
                log.info("agent ends with an error: leaving rendezvous %r open for its restart "
                         "(close_on_failure=false)", self._run_id)
            else:
                try:
                    self.set_closed()
                except Exception as exc:  # noqa: BLE001 - torch's handler also returns False
                    log.warning("could not close rendezvous %r: %s", self._run_id, exc)
                    closed = False
        finally:
            self.stop()
        return closed

    def stop(self) -> None:
        """Revokes the lease and stops the watches, without closing the rendezvous."""
        if self._stopped:
            return
        with self._control.cond:
            self._stopped = True
            self._control.cond.notify_all()
        if self._watch is not None:
            self._watch.cancel()
        self._election.stop()
        self._port.release()
        try:
            self._keeper.stop(revoke=self._started)
        except CoordinationError as exc:
            log.warning("could not revoke the rendezvous lease (it expires in %ds): %s",
                        self._ttl, exc)


def create_handler(params: RendezvousParameters, backend_name: str,
                   coordinator: Coordinator | None = None) -> EtcdNativeRendezvousHandler:
    """Builds the handler from torchrun's parameters.

    Args:
        params: ``--rdzv-endpoint``, ``--rdzv-id``, ``--nnodes`` and ``--rdzv-conf``.
        backend_name: the entry point's name.
        coordinator: an existing connection (tests); by default one to ``--rdzv-endpoint``.

    Raises:
        ValueError: a bad endpoint or rdzv-conf value (quoted).
    """
    from elasticd.coordination.etcd import EtcdCoordinator
    from elasticd.coordination.keys import Keyspace

    cfg = RendezvousConfig.from_params(params)
    if cfg.ignored:
        log.info("rdzv-conf %s: ignored (settings of torch's dynamic rendezvous; this one "
                 "keeps liveness by lease)", ", ".join(cfg.ignored))
    coordinator = coordinator or EtcdCoordinator(cfg.etcd)
    grace = OutageGrace(cfg.grace_period, where=cfg.etcd.describe())
    addr = params.local_addr or socket.getfqdn()
    return EtcdNativeRendezvousHandler(
        coordinator, Keyspace(cfg.key_prefix).job_rdzv(cfg.run_id), cfg.run_id,
        params.min_nodes, params.max_nodes, addr, backend_name, grace=grace,
        ttl=cfg.liveness_ttl, confirm=cfg.liveness_confirm, join_timeout=cfg.join_timeout,
        last_call=cfg.last_call, store_timeout=cfg.store_timeout, grow=cfg.grow,
        close_on_failure=cfg.close_on_failure)
