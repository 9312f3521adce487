"""Liveness by lease: a dead node leaves torch's rendezvous state seconds after it dies.

torch's dynamic rendezvous drops a node only when its heartbeat, written into the shared state
every ``keep_alive_interval``, is older than ``keep_alive_interval * keep_alive_max_attempt``.
The etcd-v3 backend keeps that window long (40 s by default) so that an etcd outage inside the
grace period does not evict healthy nodes (:mod:`elasticd.coordination.rendezvous`). The price
was slow recovery: after kill -9 of a node, the survivors wait in the wait list until torch drops
the dead participant, about one window later (docs/facts.md: 40+ s).

Here every agent also proves it is alive through etcd itself:

* **Alive key** (:mod:`.rendezvous_alive_key`). Each agent grants a lease of ``liveness_ttl``
  seconds (default 3), keeps it alive from a daemon thread every TTL/3 (re-granting and
  re-writing when it was lost), and binds ``<prefix>/jobs/<run_id>/rdzv/alive/<node-id>`` to it,
  where ``<node-id>`` is torch's ``_NodeDesc`` of the agent (``addr_pid_localid``). The key is
  written before the agent's first read or write of the rendezvous state, so no node enters the
  state before its key exists. The lease is revoked (the key deleted) when the handler shuts down
  or the agent exits; after kill -9 it expires TTL (+ up to 0.5 s, etcd's expiry tick) after the
  last keep-alive.
* **Dropping.** Whenever the backend hands torch a state, it first reads every alive key (one
  ``get_prefix``, *after* the state read, so a node's key is always older than its entry) and
  sets the heartbeat of each dead node far in the past, so that torch's own ``_sanitize`` drops it
  at once, with torch's own epilogue (a round left without participants moves on). The rewrite
  reaches etcd with the agent's next write, like the standby fix (:mod:`.rendezvous_standby`).

**The rule** (:class:`LivenessJudge`; every time on the agent's monotonic clock). A node in the
state is dropped when all of these hold:

1. its alive key was absent in this agent's successful reads for at least ``liveness_confirm``
   seconds (default 1: in practice two reads about a second apart, torch's state cache period).
   A re-grant race (the key gone for the milliseconds between a lease's expiry and its owner's
   re-write) never spans that;
2. it is not a node still joining: this agent either saw its key once, or has seen the node in
   the state for 2 x TTL (a node from an agent without liveness, or one that died before any read
   of ours saw its key, is dropped after that);
3. this agent trusts its view of etcd: nothing made it doubt it for 2 x TTL. Doubt comes from any
   etcd call of this agent (keep-alive, state read or write, alive-key read) failing as
   unreachable or taking longer than TTL/3, this agent's own lease found lost, or its own alive
   key missing from a read. Doubt also forgets every absence seen so far (rule 1 starts over).

Why rule 3: an etcd paused (SIGSTOP) or unreachable for longer than the TTL expires *every*
lease when it comes back, the observer's own included. Each agent re-grants and re-writes within
one keep-alive period, but an agent reading in that gap would otherwise see everybody dead. Every
agent had its own keep-alive fail or stall through such an outage, and finds its own lease lost
after it, so for 2 x TTL afterwards (several keep-alive periods, ample for everyone to re-write)
it drops nobody. A shorter pause can still expire the leases of the nodes whose last keep-alive
came earliest: the observer's keep-alive sent during the pause then stalls past TTL/3 (it is due
every TTL/3), which is doubt enough. What rule 3 does not cover, rule 1 does: a node whose key
reappears within ``liveness_confirm`` is kept.

What is left to torch's window: a node of an agent that never wrote a key (``lease_liveness``
off on that node), after 2 x TTL when others have liveness on, so give every node the same
``--rdzv-conf``; and every node while etcd itself is unreachable (no read, no judgement).

A false drop costs little: a dropped participant keeps training (torch restarts workers for
nodes in the wait list, not for departures) and rejoins at the next re-rendezvous; a dropped
waiting node re-adds itself at its next sync.

Measured (plain torchrun, 3 nodes, ``--nnodes 2:3``, default settings but
``last_call_timeout=1``, ``tests/integration/test_torchrun_liveness.py``): after kill -9 of a
node, the survivors trained at world size 2 after 8.9-9.5 s (39.9 s with ``lease_liveness=false``).
Of those, about 4.5 s went to finding the node dead (key gone ~3 s after the kill, dropped ~1.4 s
later), 1.3 s to the new round (``last_call_timeout``), and 3.4 s to starting the new workers.
The same 3 agents rode out an 8 s etcd SIGSTOP without a drop or a restart, and with rule 3
disabled (and ``liveness_confirm=0``) they dropped each other in 2 of 2 runs.

Choosing the TTL: detection takes TTL + up to 0.5 s (etcd's expiry tick) + ``liveness_confirm``
+ up to one read period. A shorter TTL finds dead nodes sooner but evicts a live agent whose
keep-alives stall (a busy machine, an etcd fsync stall, one timed-out request of
``etcd_timeout``) for longer than the TTL. 3 s survives two missed keep-alives in a row; etcd
refuses to go below about 2 s anyway (its minimum TTL is 1.5 election timeouts, rounded up).

This module needs none of torch's classes: it reads torch's private state (``participants``,
``wait_list``, ``redundancy_list``, ``last_heartbeats``; ``_NodeDesc`` fields ``addr``,
``pid``, ``local_id``) by attribute; if torch changes them, the state passes unchanged with one
warning, and torch's heartbeat window takes over. Unpickling here adds no exposure: torch
unpickles the very same bytes a moment later.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import socket
import threading
from datetime import datetime, timezone
from typing import Any, Callable, Collection
from urllib.parse import quote

from elasticd.clock import Clock, SystemClock
from elasticd.coordination.api import CoordinationError, Coordinator
from elasticd.coordination.rendezvous_alive_key import AliveKeyKeeper
from elasticd.coordination.rendezvous_grace import OutageGrace

log = logging.getLogger(__name__)

#: Defaults of rdzv-conf ``liveness_ttl`` (seconds, an integer: etcd's lease TTL) and
#: ``liveness_confirm`` (seconds).
DEFAULT_LIVENESS_TTL = 3
DEFAULT_LIVENESS_CONFIRM = 1.0
#: etcd raises any lease TTL below 1.5 election timeouts (1 s by default) to that, rounded up.
MIN_LIVENESS_TTL = 2

#: The heartbeat given to a dead node: older than any keep-alive window, so torch drops it.
DEAD_HEARTBEAT = datetime(1970, 1, 1, tzinfo=timezone.utc)

#: Schema version of the alive key's JSON value.
ALIVE_SCHEMA = 1


def node_id(node: Any) -> str:
    """The alive key's last path element for a torch ``_NodeDesc`` (``addr_pid_localid``).

    Percent-quoted, so that an IPv6 address or an odd host name stays one path element.

    Raises:
        AttributeError: ``node`` is not shaped like torch's ``_NodeDesc``.
    """
    return quote(f"{node.addr}_{node.pid}_{node.local_id}", safe="")


def is_marked_dead(state: Any, node: Any) -> bool:
    """True when :class:`LeaseLiveness` has marked ``node`` dead in this (unpickled) state."""
    return state.last_heartbeats.get(node) == DEAD_HEARTBEAT


class LivenessJudge:
    """Decides which nodes of the rendezvous state are dead, from this agent's reads alone.

    Pure bookkeeping (no I/O), thread-safe: the backend calls :meth:`judge` after each read of
    the alive keys, the keep-alive thread calls :meth:`distrust`. See the module docstring for
    the rule.

    Args:
        ttl: the alive keys' lease TTL, seconds.
        confirm: how long, in seconds, a key must stay absent in successful reads.
        clock: time source (monotonic).
        distrust_for: how long doubt lasts, seconds; 2 x ``ttl`` if None.
        join_grace: how long a node never seen alive is spared, seconds; 2 x ``ttl`` if None.

    Raises:
        ValueError: a non-positive TTL or a negative duration.
    """

    def __init__(self, ttl: float, confirm: float = DEFAULT_LIVENESS_CONFIRM,
                 clock: Clock | None = None, distrust_for: float | None = None,
                 join_grace: float | None = None) -> None:
        if ttl <= 0:
            raise ValueError(f"liveness TTL {ttl!r} must be positive")
        self.ttl = ttl
        self.confirm = confirm
        self.distrust_for = 2 * ttl if distrust_for is None else distrust_for
        self.join_grace = 2 * ttl if join_grace is None else join_grace
        for name in ("confirm", "distrust_for", "join_grace"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"liveness {name} {getattr(self, name)!r} must be >= 0 seconds")
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._untrusted_until = float("-inf")
        self._first_seen: dict[str, float] = {}
        self._missing_since: dict[str, float] = {}
        self._seen_alive: set[str] = set()

    def distrust(self, reason: str) -> None:
        """This agent's view of etcd is doubtful: drop nobody for ``distrust_for`` seconds."""
        now = self._clock.monotonic()
        with self._lock:
            if now >= self._untrusted_until:
                log.warning("lease liveness: dropping nobody for %gs (%s)", self.distrust_for,
                            reason)
            self._untrusted_until = max(self._untrusted_until, now + self.distrust_for)
            # An absence that began before (or during) the doubtful period proves nothing.
            self._missing_since.clear()

    @property
    def trusted(self) -> bool:
        """Whether an absence seen now would count."""
        with self._lock:
            return self._clock.monotonic() >= self._untrusted_until

    def missing_for(self, node: str) -> float | None:
        """Seconds ``node``'s key has been seen absent (None: not counted as missing)."""
        with self._lock:
            since = self._missing_since.get(node)
            return None if since is None else self._clock.monotonic() - since

    def judge(self, in_state: Collection[str], alive: Collection[str],
              me: str | None) -> set[str]:
        """Records one successful read and returns the nodes to drop now.

        Args:
            in_state: ids of every node in the rendezvous state just read.
            alive: ids whose alive key exists, read after the state.
            me: this agent's own id (never dropped; its absence is a reason for doubt).

        Returns:
            Ids of nodes in ``in_state`` that are dead by the rule.
        """
        if me is not None and me not in alive:
            self.distrust("this agent's own alive key is missing")
        now = self._clock.monotonic()
        with self._lock:
            present = set(in_state)
            for table in (self._first_seen, self._missing_since):
                for gone in [n for n in table if n not in present]:
                    del table[gone]
            self._seen_alive &= present
            for node in present:
                self._first_seen.setdefault(node, now)
                if node in alive:
                    self._seen_alive.add(node)
                    self._missing_since.pop(node, None)
            if now < self._untrusted_until:
                return set()
            dead = set()
            for node in present:
                if node in alive or node == me:
                    continue
                since = self._missing_since.setdefault(node, now)
                joining = (node not in self._seen_alive
                           and now - self._first_seen[node] < self.join_grace)
                if not joining and now - since >= self.confirm:
                    dead.add(node)
            return dead


class LeaseLiveness:
    """This agent's side of liveness by lease: its alive key, and the dead-node filter.

    The backend calls :meth:`ensure_started` before its first etcd call, :meth:`note_unreachable`
    when one of its calls finds etcd unreachable, and :meth:`filter` on every state it hands to
    torch. The handler creator calls :meth:`bind` with torch's node descriptor once the handler
    exists, and :meth:`stop` when it shuts down (also registered with ``atexit``).

    Args:
        coordinator: the etcd connection.
        alive_prefix: ``<prefix>/jobs/<run_id>/rdzv/alive/``.
        ttl: lease TTL, seconds.
        confirm: rdzv-conf ``liveness_confirm``.
        grace: outage grace for establishing the key (its clock is used throughout).
        background: run the keep-alive thread; unit tests pass False and call
            ``keeper.step()`` themselves, on a fake clock.
        close_last_call: end a re-rendezvous' last call once every agent with an alive key
            has joined it (:meth:`_close_last_call`).

    Raises:
        ValueError: a prefix not ending in ``/``, or a TTL below :data:`MIN_LIVENESS_TTL`.
    """

    def __init__(self, coordinator: Coordinator, alive_prefix: bytes,
                 ttl: int = DEFAULT_LIVENESS_TTL, confirm: float = DEFAULT_LIVENESS_CONFIRM,
                 grace: OutageGrace | None = None, background: bool = True,
                 close_last_call: bool = True) -> None:
        if not alive_prefix.endswith(b"/"):
            raise ValueError(f"alive key prefix {alive_prefix!r} must end with '/'")
        if ttl < MIN_LIVENESS_TTL:
            raise ValueError(f"liveness TTL {ttl!r} must be at least {MIN_LIVENESS_TTL} s")
        self._coordinator = coordinator
        self.prefix = alive_prefix
        self.ttl = ttl
        self._grace = grace or OutageGrace()
        self._clock = self._grace.clock
        self._background = background
        self.judge = LivenessJudge(ttl, confirm, self._clock)
        self.me: str | None = None
        self.keeper: AliveKeyKeeper | None = None
        self._lock = threading.Lock()
        self._started = False
        self._stopped = False
        self._announced: set[str] = set()
        self._warned_shape = False
        self._pid = os.getpid()
        #: End a re-rendezvous' last call once every live agent joined (see _close_last_call).
        self.close_last_call = close_last_call
        #: Called with the ids of participants of this agent's complete round found dead
        #: (see :meth:`_broken_round`); None: nothing is done about them.
        self.on_round_broken: Callable[[list[str]], None] | None = None
        self._broken_seen: set[tuple[int, str]] = set()

    def bind(self, node: Any) -> None:
        """Names this agent: torch's ``_NodeDesc`` of its handler.

        Raises:
            AttributeError: ``node`` is not shaped like torch's ``_NodeDesc``.
        """
        self.me = node_id(node)
        record = {"v": ALIVE_SCHEMA, "addr": node.addr, "pid": node.pid,
                  "local_id": node.local_id, "host": socket.gethostname(), "ttl": self.ttl}
        self.keeper = AliveKeyKeeper(self._coordinator, self.prefix + self.me.encode(),
                                     json.dumps(record, sort_keys=True).encode(), self.ttl,
                                     self.judge.distrust, self._clock)

    @property
    def active(self) -> bool:
        return self.keeper is not None and self._started and not self._stopped

    def ensure_started(self) -> None:
        """Writes the alive key (through the outage grace) and starts the keep-alive thread.

        Only the first call does anything; before :meth:`bind` and after :meth:`stop`, nothing.

        Raises:
            EtcdUnavailableError: etcd unreachable for the grace period, or refusing the write.
        """
        with self._lock:
            if self._started or self._stopped or self.keeper is None:
                return
            self._grace.call(self.keeper.establish, "writing this agent's alive key")
            if self._background:
                self.keeper.start()
            self._started = True
            atexit.register(self.stop)
        log.info("lease liveness: %s alive (lease %x, TTL %ds)",
                 self.keeper.key.decode(errors="replace"), self.keeper.lease or 0, self.ttl)

    def note_unreachable(self, exc: BaseException) -> None:
        """A backend call found etcd unreachable: doubt what the next reads show."""
        self.judge.distrust(f"etcd unreachable: {exc}")

    def note_call_took(self, seconds: float) -> None:
        """A backend call's duration; one slower than TTL/3 may have waited out a stall."""
        if seconds > self.ttl / 3.0:
            self.judge.distrust(f"an etcd call took {seconds:.1f}s")

    def stop(self, revoke: bool = True) -> None:
        """Stops the keep-alive thread and (by default) revokes the lease. Idempotent."""
        if os.getpid() != self._pid:
            return  # a forked child exiting (atexit is inherited): the lease is the parent's
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            started = self._started
        if started and self.keeper is not None:
            self.keeper.stop(revoke)
        atexit.unregister(self.stop)

    def filter(self, state_bits: bytes) -> bytes:
        """Returns torch's state with every dead node's heartbeat set far in the past.

        The state passes unchanged when nothing is dead, when liveness is not running, when
        the bytes are not a state torch can read (torch raises its own error on them), and
        when the alive keys cannot be read (an outage: torch's heartbeat window rules).
        """
        if not self.active:
            return state_bits
        try:
            state = pickle.loads(state_bits)
        except Exception:  # torch raises its own RendezvousStateError on these bytes
            return state_bits
        try:
            nodes = (set(state.participants) | set(state.wait_list)
                     | set(state.redundancy_list) | set(state.last_heartbeats))
            by_id = {node_id(n): n for n in nodes}
        except (AttributeError, TypeError) as exc:
            if not self._warned_shape:
                self._warned_shape = True
                log.warning("torch's rendezvous state has changed shape (%s); lease liveness "
                            "is off, dead nodes leave after torch's heartbeat window", exc)
            return state_bits
        if not by_id:
            return state_bits
        dead, alive = self._dead(by_id)
        for name in sorted(dead):
            state.last_heartbeats[by_id[name]] = DEAD_HEARTBEAT
            if name not in self._announced:
                self._announced.add(name)
                log.warning("lease liveness: the alive key of node %s has been gone for %.1fs; "
                            "dropping it from the rendezvous", name,
                            self.judge.missing_for(name) or 0.0)
        broken = self._broken_round(state, dead)
        if broken and self.on_round_broken is not None:
            self.on_round_broken(broken)
        closed = self.close_last_call and self._close_last_call(state, dead, alive)
        return pickle.dumps(state) if dead or closed else state_bits

    def _broken_round(self, state: Any, dead: set[str]) -> list[str]:
        """Participants of the complete round this agent is in that are now dead (each
        reported once per round).

        torch restarts a worker group for nodes that wait to join, not for participants that
        leave: it counts on the group's collectives failing. Workers that are still starting
        (waiting in ``init_process_group`` for the dead node's ranks) wait out gloo's timeout
        instead, 30 minutes by default. Seen after SIGSTOP of a daemon: its agent joined the
        survivors' round, then fenced itself, and the survivors' new workers waited for it.
        """
        if not dead:
            return []
        try:
            if not state.complete:
                return []
            members = {node_id(p) for p in state.participants}
            round_ = int(state.round)
        except (AttributeError, TypeError, ValueError):
            return []
        if self.me not in members:
            return []
        new = sorted(n for n in dead & members if (round_, n) not in self._broken_seen)
        self._broken_seen.update((round_, n) for n in new)
        return new

    def _close_last_call(self, state: Any, dead: set[str], alive: set[str]) -> bool:
        """Ends the last call of a re-rendezvous at once when every live agent already joined.

        torch keeps a round that has ``min_nodes`` open for ``last_call_timeout`` in case more
        nodes come. After a failure the survivors are all there is: when every agent whose
        alive key exists is a participant, nobody else can come, so the deadline is moved to
        now (saves the whole last call, 1 s by default). Only for rounds after the first (at a
        job's start, agents start at different times and a late one may not have written its
        key yet) and only while this agent trusts its view of etcd. A node that arrives anyway
        joins the next round, as it would after a last call.
        """
        try:
            deadline = state.deadline
            if (state.complete or state.closed or state.round < 1 or deadline is None
                    or not alive or not self.judge.trusted):
                return False
            now = datetime.now(timezone.utc)
            if deadline <= now:
                return False
            joined = {node_id(p) for p in state.participants} - dead
            if not alive <= joined:
                return False
            state.deadline = now
        except (AttributeError, TypeError):  # another torch: leave its last call alone
            return False
        log.info("every live agent has joined round %d (%d nodes): ending its last call now",
                 state.round, len(joined))
        return True

    def _dead(self, by_id: dict[str, Any]) -> tuple[set[str], set[str]]:
        """(ids judged dead, ids whose alive key exists); nobody dead when etcd cannot say."""
        start = self._clock.monotonic()
        try:
            kvs, _ = self._coordinator.get_prefix(self.prefix)
        except CoordinationError as exc:
            self.judge.distrust(f"reading the alive keys failed: {exc}")
            return set(), set()
        # Served after a stall? Leases may have expired for the stall's sake.
        self.note_call_took(self._clock.monotonic() - start)
        alive = {kv.key[len(self.prefix):].decode(errors="replace") for kv in kvs}
        if self.me not in alive and self.keeper is not None:
            self.keeper.request_rewrite()
        return self.judge.judge(by_id.keys(), alive, self.me), alive
