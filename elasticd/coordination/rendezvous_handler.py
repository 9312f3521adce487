"""elasticd's own torch ``RendezvousHandler`` on etcd v3: per-node keys, one CAS per round.

torch's dynamic rendezvous keeps every participant in one pickled blob that every heartbeat
rewrites whole and every agent re-reads: quadratic traffic, compare-and-set storms, and code
execution for whoever can write the key (docs/scale.md). This handler implements torch's
interface (``torch/distributed/elastic/rendezvous/api.py``) on its own keys instead:

* **Joining** writes one JSON record, ``<rdzv>/native/nodes/<node>``, bound to the agent's own
  etcd lease. The lease *is* the heartbeat: it is kept alive every TTL/3 and nothing is
  rewritten on a timer. The record is rewritten only to ask for a new round, or when the lease
  was lost and re-granted (an etcd outage past the TTL).
* **Closing** a round is one compare-and-set on the small ``<rdzv>/native/round`` key, written by
  the node that will be rank 0 (others after a back-off, in case it died). The decisions (when a
  round may close, rank order, what counts as waiting) are the pure functions of
  :mod:`.rendezvous_rounds`.
* **Watching**, not polling: each handler mirrors ``<rdzv>/native/`` through one etcd watch.
  ``num_nodes_waiting()``, which torch's agent calls every monitor interval while the workers
  train, reads that mirror and makes no etcd request. The mirror is re-listed only when the
  watch cannot be trusted: at once after a watch error or a lost or replaced lease. That covers
  an etcd data loss (a watch resumed from the old revision delivers nothing: docs/facts.md),
  since a wiped etcd knows no lease and the keeper finds its own gone within TTL/3; so there
  is no periodic re-list. The mirror is :mod:`.rendezvous_mirror`.
* **Outage grace.** Every write retries for ``etcd_grace_period`` on an unreachable etcd
  (:mod:`.rendezvous_grace`); the watch re-creates itself. ``num_nodes_waiting`` never fails.
* **Provisional expiry.** An etcd paused past the TTL expires every lease when it resumes; each
  agent re-grants and re-writes its record within a keep-alive period. A member whose record is
  absent counts as gone only after ``liveness_confirm`` seconds, and only while this agent
  trusts its view: after its own keep-alive failed, its lease was lost or its watch broke, it
  counts nobody as gone for 2 x TTL.
* **Store.** ``next_rendezvous`` returns the etcd-backed store of :mod:`.rendezvous_store` under
  a per-round prefix (torch's ``torch.rendezvous.<run>.<round>``). ``use_agent_store`` is False:
  workers host their own TCPStore at the rank-0 node's address and a free port, as with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/facts.md: sharing the agent's store across restarts
  let workers read dead peers' addresses). A blocking wait in the store ends at once when a
  member of the round is gone (confirmed): torch's rank assignment waits for what the agent
  of rank 0 writes, and a member that left after the round closed never writes it.
* **Join gate.** ``join_gate``, when set, runs before this node writes its join record; under
  a daemon it fences a node whose daemon was declared dead before it can enter a round.
* **Commit gate.** Under the ``interval:MIN`` grow policy a newcomer takes free room only while
  the job is at a committed step. ``commit_gate``, when set, says whether it is (under a
  daemon, from a watch on the job's replication records: :mod:`elasticd.agent.commit_watch`);
  this layer cannot read those records itself. Unset (plain torchrun: no daemon, no commit
  records), the interval alone decides.

Registered as torchrun's ``etcd-v3`` backend (:mod:`elasticd.coordination.rendezvous`). Its
rdzv-conf keys are those of :mod:`.rendezvous_config` (``liveness_ttl`` is this lease's TTL);
the keys of torch's dynamic rendezvous (``keep_alive_*``, ...) are accepted and ignored. No
pickle is read or written.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
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
from elasticd.coordination.api import (
    Compacted,
    Compare,
    CoordinationError,
    Coordinator,
    KeyValue,
    Put,
)
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.lease import LeaseKeeper
from elasticd.coordination.rendezvous_config import (
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_LAST_CALL_TIMEOUT,
    RendezvousConfig,
)
from elasticd.coordination.rendezvous_grace import OutageGrace
from elasticd.coordination.rendezvous_mirror import Mirror
from elasticd.coordination.rendezvous_rounds import (
    NodeRecord,
    RoundRecord,
    closer,
    decide_close,
    grew_at,
    grow_interval,
    next_round,
    node_id,
    num_waiting,
)
from elasticd.coordination.rendezvous_store import EtcdV3Store

log = logging.getLogger(__name__)

#: While a rendezvous waits, look again at least this often, seconds (a wake-up bound, not a
#: re-list: the mirror is re-listed only after a watch error or a lost lease).
WAKE_INTERVAL = 30.0
#: A node that is not the expected closer of a closable round writes it after this many seconds
#: (plus up to as much again, at random): the expected closer may have died.
CLOSER_BACKOFF = 1.0


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
        confirm: seconds a member's record must be absent before it counts as gone.
        join_timeout: seconds ``next_rendezvous`` waits for a round that includes this node
            (not while it is the spare of a full, running round).
        last_call: seconds a job's first round stays open after ``min`` nodes joined.
        store_timeout: how long the store's ``get``/``wait`` block.
        grow: the grow policy for nodes beyond a running round (:mod:`.rendezvous_rounds`).
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
        self._min, self._max = min_nodes, max_nodes
        self.addr = addr
        self.me = node_id(addr, os.getpid(), local_id)
        self._backend = backend_name
        self._grace = grace or OutageGrace()
        self._clock = clock or SystemClock()
        self._ttl = ttl
        self._confirm = confirm
        self._join_timeout = join_timeout
        self._last_call = last_call
        self._close_on_failure = close_on_failure
        self._grow = grow
        self._grow_interval = grow_interval(grow)
        self._mirror = Mirror(prefix + b"native/", self._clock)
        self._store = EtcdV3Store(coordinator, prefix + b"store/", timeout=store_timeout,
                                  grace=self._grace, abort=self._round_left)
        self._store_prefix = prefix + b"store/"
        self._keeper = LeaseKeeper(coordinator, ttl, EtcdHealth(describe="etcd (rendezvous)"),
                                   on_change=self._lease_changed, clock=self._clock,
                                   on_failure=lambda: self._distrust("etcd call failed"))
        self._lock = threading.Lock()
        self._record: NodeRecord | None = None
        self._watch = None
        self._started = False
        self._stopped = False
        self._relist = threading.Event()
        self._untrusted_until = float("-inf")
        self._backoff = CLOSER_BACKOFF
        self._reported_gone: set[tuple[int, str]] = set()
        #: Called with the ids of members of this node's current round once they are gone
        #: (confirmed). Under a daemon, restarts this node's workers (see rendezvous.py).
        self.on_round_broken: Callable[[list[str]], None] | None = None
        #: Called before this node writes its join record; may block, or end the process.
        #: Under a daemon, fences a node whose daemon was declared dead (see rendezvous.py).
        self.join_gate: Callable[[], object] | None = None
        #: Whether the job is at a committed step now (``interval:MIN`` grow policy only);
        #: called from ``num_nodes_waiting``, so it must answer without blocking.
        self.commit_gate: Callable[[], bool] | None = None
        #: Per round this node joined: (round, seconds in next_rendezvous until it saw the
        #: round), and the monotonic time it last saw one. For benches and logs.
        self.rounds: list[tuple[int, float]] = []
        self.seen_at = 0.0

    # -- lifecycle ------------------------------------------------------------------------

    def _start(self) -> None:
        """Grants the lease, lists the mirror and starts the watch (first call only)."""
        if self._started:
            return
        self._grace.call(self._keeper.grant, "granting the rendezvous lease")
        self._keeper.start()
        self._relist_now(initial=True)
        self._started = True

    def _relist_now(self, initial: bool = False, patient: bool = True) -> None:
        """Re-lists the mirror; re-creates the watch when etcd's revision went back.

        Args:
            initial: the first listing (the watch starts after it).
            patient: retry through an outage for the grace period; else try once.
        """
        def get() -> tuple[list[KeyValue], int]:
            return self._coord.get_prefix(self._mirror.prefix)

        kvs, revision = self._grace.call(get, "listing the rendezvous") if patient else get()
        wiped = revision < self._mirror.revision
        self._mirror.load(kvs, revision)
        if initial or wiped or self._watch is None:
            if wiped:
                log.warning("etcd's revision went back (%d < %d): its data was lost; watching "
                            "the rendezvous afresh", revision, self._mirror.revision)
            if self._watch is not None:
                self._watch.cancel()
            def watch() -> object:
                return self._coord.watch_prefix(self._mirror.prefix, self._on_watch,
                                                revision + 1)

            self._watch = self._grace.call(watch, "watching the rendezvous") if patient \
                else watch()

    def _on_watch(self, batch: object) -> None:
        if isinstance(batch, CoordinationError):
            if not isinstance(batch, Compacted):
                self._distrust(f"rendezvous watch: {batch}")
            self._relist.set()
            with self._mirror.cond:
                self._mirror.cond.notify_all()
            return
        self._mirror.apply(list(batch))  # type: ignore[arg-type]

    def _lease_changed(self) -> None:
        """The keeper lost or replaced the lease: re-write this node's record under the new
        one (a provisional rejoin), and re-list (the watch may have missed the outage)."""
        lease = self._keeper.lease
        self._relist.set()
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
            log.info("rendezvous: counting no member as gone for %ds (%s)", 2 * self._ttl,
                     reason)
        self._untrusted_until = max(self._untrusted_until, until)

    def _node_key(self) -> bytes:
        return self._mirror.nodes_prefix + self.me.encode()

    def _write_record(self, target: int) -> None:
        record = NodeRecord(self.me, target, self.addr)
        with self._lock:
            self._record = record

        def put() -> int:
            lease = self._keeper.lease
            if lease is None:  # lost just now: the keeper re-grants and re-writes
                lease = self._keeper.grant()
            return self._coord.put(self._node_key(), record.encode(), lease=lease)

        self._grace.call(put, "writing this node's rendezvous record")

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
        mirror = self._mirror
        if self.join_gate is not None:  # may wait: the target is read after it
            self.join_gate()
        with mirror.cond:
            if mirror.closed:
                raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
            target = next_round(mirror.round)
        self._write_record(target)
        log.info("node %s joins round %d of rendezvous %r", self.me, target, self._run_id)
        deadline = started + self._join_timeout
        min_since: float | None = None
        closable_since: float | None = None
        spare = False
        while True:
            now = self._clock.monotonic()
            if self._relist.is_set():
                self._relist.clear()
                self._relist_now()
            with mirror.cond:
                if mirror.closed:
                    raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
                if mirror.round_error:
                    raise RendezvousStateError(
                        f"rendezvous {self._run_id!r}: {mirror.round_error}; delete "
                        f"{mirror.round_key.decode(errors='replace')} to start afresh")
                last, revision = mirror.round, mirror.round_revision
                nodes, seen = dict(mirror.nodes), mirror.version
                if last is not None and last.round >= target:
                    rank = last.rank_of(self.me)
                    if rank is not None:
                        break
                    # A round closed without this node: wait for the next one.
                    spare = len(last.members) >= self._max
                    log.info("round %d closed without node %s (%d members): waiting as %s",
                             last.round, self.me, len(last.members),
                             "a spare" if spare else "a late node")
                    target, min_since, closable_since = last.round + 1, None, None
                    continue
                if self.me not in nodes:  # our record is not in the mirror yet
                    decision = None
                else:
                    decision = decide_close(
                        nodes, last, self._min, self._max,
                        last_call_over=min_since is not None
                        and now - min_since >= self._last_call)
                    if decision.last_call and min_since is None:
                        min_since = now
                    elif not decision.last_call and decision.members is None:
                        min_since = None
            if decision is not None and decision.members is not None:
                first = closer(decision.members) == self.me
                if closable_since is None:
                    closable_since = now
                    self._backoff = CLOSER_BACKOFF * (1 + random.random())
                if first or now - closable_since >= self._backoff:
                    self._close_round(target, decision.members, revision)
                    continue
            else:
                closable_since = None
            if not spare and now >= deadline:
                raise RendezvousTimeoutError(
                    f"node {self.me} was not admitted to rendezvous {self._run_id!r} within "
                    f"join_timeout={self._join_timeout:g}s "
                    f"({decision.wait_for if decision else 'record not seen yet'})")
            wait = WAKE_INTERVAL
            if min_since is not None:
                wait = min(wait, max(0.01, min_since + self._last_call - now))
            if closable_since is not None:
                wait = min(wait, max(0.01, closable_since + self._backoff - now))
            if not spare:
                wait = min(wait, max(0.01, deadline - now))
            with mirror.cond:
                if mirror.version == seen and not self._relist.is_set():
                    mirror.cond.wait(wait)
        self.seen_at = self._clock.monotonic()
        took = self.seen_at - started
        self.rounds.append((last.round, took))
        log.info("node %s is rank %d of %d in round %d of rendezvous %r (%.2fs)", self.me, rank,
                 len(last.members), last.round, self._run_id, took)
        store = dist.PrefixStore(f"torch.rendezvous.{self._run_id}.{last.round}", self._store)
        info = RendezvousStoreInfo.build(rank, store, local_addr=self.addr)
        return RendezvousInfo(store, rank, len(last.members), info)

    def _close_round(self, number: int, members: tuple[str, ...], revision: int) -> None:
        with self._mirror.cond:
            last = self._mirror.round
        record = RoundRecord(number, members, closed_by=self.me,
                             grew_at=grew_at(members, last, self._clock.wall()))
        ok, new_revision = self._grace.call(
            lambda: self._coord.transaction([Compare(self._mirror.round_key, revision)],
                                            [Put(self._mirror.round_key, record.encode())]),
            "closing a rendezvous round")
        if not ok:
            # Lost the race (or our retried write landed): the watch brings the winner.
            self._relist.set()
            return
        log.info("node %s closed round %d with %d node(s)", self.me, number, len(members))
        self._mirror.set_round(KeyValue(self._mirror.round_key, record.encode(),
                                        create_revision=new_revision, mod_revision=new_revision))
        if number >= 2:  # no agent reads the store of a round two behind
            old = self._store_prefix + f"torch.rendezvous.{self._run_id}.{number - 2}/".encode()
            try:
                self._coord.delete_prefix(old)
            except CoordinationError as exc:
                log.debug("could not delete the store of round %d: %s", number - 2, exc)

    def _round_left(self) -> str | None:
        """Why a blocking wait in the store can stop now: a member of the round this node is
        in is gone (confirmed), so what it was to write (torch's rank assignment, written by
        the agent of rank 0) will never come. The agent then fails at once and is restarted
        into a new round, instead of after the store's timeout (60 s)."""
        if not self._started or self._stopped:
            return None
        gone = self.gone_members()
        with self._mirror.cond:
            current = self._mirror.round
        if not gone or current is None or self.me not in current.members:
            return None
        return f"member(s) {', '.join(gone)} of round {current.round} left the rendezvous"

    def gone_members(self) -> list[str]:
        """Members of the current round whose records have been absent for ``confirm``
        seconds while this node trusted its view (empty while it does not)."""
        now = self._clock.monotonic()
        if now < self._untrusted_until:
            return []
        with self._mirror.cond:
            return sorted(n for n, t in self._mirror.absent_since.items()
                          if now - t >= self._confirm and n not in self._mirror.nodes)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to enter: rejoining members, and waiting nodes when the round has
        room. From the watch's mirror: no etcd request, so an outage cannot fail it."""
        if self._relist.is_set() and self._started and not self._stopped:
            self._relist.clear()
            try:  # once, without the grace: this call must not block the agent's monitor
                self._relist_now(patient=False)
            except CoordinationError as exc:
                self._relist.set()
                log.debug("re-listing the rendezvous failed (%s); the mirror stands", exc)
        gone = self.gone_members()
        with self._mirror.cond:
            nodes, current = dict(self._mirror.nodes), self._mirror.round
        if current is not None and gone and self.on_round_broken is not None \
                and self.me in current.members:
            new = [g for g in gone if (current.round, g) not in self._reported_gone]
            if new:
                self._reported_gone.update((current.round, g) for g in new)
                self.on_round_broken(new)
        return num_waiting(nodes, current, self._max, gone, self._grow,
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
        with self._mirror.cond:
            if self._started:
                return self._mirror.closed
        return self._grace.call(lambda: self._coord.get(self._mirror.closed_key),
                                "reading whether the rendezvous is closed") is not None

    def set_closed(self) -> None:
        self._grace.call(lambda: self._coord.put(self._mirror.closed_key, b'{"v":1}'),
                         "closing the rendezvous")
        with self._mirror.cond:
            self._mirror.closed = True
            self._mirror.cond.notify_all()

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
        """Revokes the lease and stops the watch, without closing the rendezvous."""
        if self._stopped:
            return
        self._stopped = True
        if self._watch is not None:
            self._watch.cancel()
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
