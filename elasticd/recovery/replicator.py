"""The daemon-side replication service: push local snapshots to placement peers, commit steps,
re-replicate after membership changes, fetch shards for recovery, drain.

One :class:`Replicator` per daemon, built from these parts: a
:class:`~elasticd.replication.pusher.Pusher` (per-peer bounded lanes: the newest snapshot wins,
intermediate steps are skipped and counted, nothing queues without bound, the training loop
never waits), a :class:`~elasticd.replication.tracker.CommitTracker` (copies counted, steps
committed in etcd, the retention gate), :mod:`elasticd.recovery.fetch` (fetching with holder
fallback) and :mod:`elasticd.recovery.plans` (which copies to push to keep ``m``). The daemon
tells it the rendezvous round's membership (:meth:`~Replicator.set_membership`); the checkpoint
service tells it each completed local snapshot (:meth:`~Replicator.on_local_snapshot`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import ssl
from typing import Any, Callable

from elasticd.store.shm import SlotStore
from elasticd.clock import Clock, SystemClock
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator
from elasticd.coordination.keys import Keyspace
from elasticd.replication.api import ReplicationError, ShardLost, Version
from elasticd.replication.background import Background
from elasticd.replication.commit import (
    CommitConflict,
    Committed,
    publish_placement,
    read_committed,
    record_commit,
    update_holders,
)
from elasticd.replication.report import Reply, Report
from elasticd.replication.commit_state import Holder
from elasticd.replication.deadline import LinkRates
from elasticd.replication.handed import Ticket
from elasticd.replication.lanes import AddressBook, Connections, Task
from elasticd.replication.placement import Placement, compute_placement
from elasticd.replication.pusher import Pusher
from elasticd.recovery.fetch import (
    FetchResult,
    fetch_into_scratch,
    fetch_into_store,
    fetch_shard,
    holder_order,
)
from elasticd.recovery.handing import hand_sessions
from elasticd.recovery.plans import repair_plan, under_replicated, unwanted_replicas
from elasticd.replication.shm_sink import ShmSink
from elasticd.replication.tracker import CommitTracker, JobState

log = logging.getLogger(__name__)

__all__ = ["FetchResult", "Replicator", "ShardLost"]


@dataclasses.dataclass
class ReplicationStats:
    """What :meth:`Replicator.stats` returns for the daemon's metrics: totals since start and
    gauges (a node runs one job: maxima over jobs). ``replica_bytes_held`` is the bytes of other
    nodes' shards held here, not this node's own slots (``CheckpointStats.local_slot_bytes``)."""

    replication_pushes_total: int = 0
    replication_bytes_total: int = 0
    replication_failures_total: dict[str, int] = dataclasses.field(default_factory=dict)
    replication_skipped_total: int = 0
    replication_commit_wait_timeouts_total: int = 0
    commits_total: int = 0
    committed_step: int = -1
    sync_lag_steps: int = 0
    under_replicated_shards: int = 0
    replica_bytes_held: int = 0
    rereplications_total: int = 0
    fetches_total: int = 0
    fetch_bytes_total: int = 0
    fetch_seconds_total: float = 0.0
    fetch_failures_total: dict[str, int] = dataclasses.field(default_factory=dict)
    etcd_errors_total: int = 0
    withdrawals_total: int = 0
    commit_coordinator: int = 0


def _kept_commit(tracker: CommitTracker, job: str) -> Version | None:
    """The committed version ``job``'s record in force names (a sink takes it below a
    generation floor, :meth:`ShmSink.set_floor`)."""
    committed = tracker.view(job)[1]
    return tuple(committed.version) if committed is not None else None


class Replicator:
    """Replicates this node's snapshots and serves recovery for one daemon; the store's
    :class:`~elasticd.store.api.Replication` (which says what those members promise).

    Args:
        store: this node's local slot store (the checkpoint service's).
        m: replication factor, the owner's copy included.
        clock: times transfers, stamps records and bounds every wait.
        peers_address: node id -> (host, port) of its replica server, or None.
        sink: the sink this node's replica server stores into (sources for re-replication,
            drain and fetches of shards held here).
        workers: pool threads (lanes run one per thread while they have work).
        commit_wait, withdraw_after, lease_ttl: the
            :class:`~elasticd.replication.tracker.CommitTracker`'s (the snapshots skipped
            while a version waits for its commit count as ``commit_pending``).
        timeout: seconds any single network send or receive may block.
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace, store: SlotStore,
                 secret: bytes, m: int = 2, clock: Clock | None = None,
                 peers_address: AddressBook = lambda node: None, *,
                 sink: ShmSink | None = None, workers: int = 6, commit_wait: float = 2.0,
                 timeout: float = 30.0, ssl_context: ssl.SSLContext | None = None,
                 withdraw_after: float = 1.0, lease_ttl: float = 2.0) -> None:
        if m < 1 or workers < 1 or commit_wait < 0:
            raise ValueError(f"need m >= 1, workers >= 1, commit_wait >= 0; got m={m}, "
                             f"workers={workers}, commit_wait={commit_wait}")
        self.node_id, self.coord, self.keys, self.store = node_id, coord, keys, store
        self.m, self.clock, self.sink = m, clock or SystemClock(), sink
        self.counters: collections.Counter[str] = collections.Counter()
        self.fetch_failures: collections.Counter[str] = collections.Counter()
        self.background = Background(f"replicator-{node_id}", workers)
        self.connections = Connections(node_id, secret, peers_address, timeout=timeout,
                                        ssl_context=ssl_context, clock=self.clock)
        # Commit reports on connections of their own: one never waits behind a push.
        self._reports = Connections(node_id, secret, peers_address, timeout=timeout,
                                    ssl_context=ssl_context, clock=self.clock)
        # Bumped by each abandon (any node: names come from the election record, etcd's):
        # a report that failed meanwhile is not sent again.
        self._abandoned = 0
        stores = {Holder.LOCAL: store}
        if sink is not None:
            stores[Holder.REPLICA] = sink.store
        self._own_stores = list(stores.values())  # what a fetch reads without the network
        self.tracker = CommitTracker(node_id, coord, keys, self.clock, self.background,
                                     self._collect, commit_wait, withdraw_after, stores,
                                     send=self._send_report, lease_ttl=lease_ttl,
                                     abandon=self._abandon_reports)
        #: Measured link rates per peer, shared by pushes and fetches: every call's deadline.
        self.link_rates = LinkRates()
        # Fetches in progress (job, rank, version, holders, start), shown by status(): one
        # that stays there is a thread waiting on a peer.
        self._fetching: dict[object, tuple[str, int, Version | None, list[str], float]] = {}
        #: The fetches this node's replica server is serving now (ReplicaServer.serving), for
        #: status(); the node builder sets it.
        self.serving: Callable[[], list[dict[str, Any]]] = list
        #: When this node's replica server last received a frame from a node
        #: (ReplicaServer.last_heard; wall time, None: never), a sign of life of a failed peer.
        self.last_heard: Callable[[str], float | None] = lambda node: None
        self.pusher = Pusher(store, sink, self.connections, self.background.executor,
                             self.tracker, self.link_rates)
        if sink is not None:
            sink.on_pending = self.tracker.prefix.reread
            sink.on_landed = functools.partial(self.tracker.on_landed, holder=Holder.REPLICA)
            sink.on_superseded = self.tracker.on_superseded
            sink.never_committed = self.tracker.never_committed
            sink.kept_commit = functools.partial(_kept_commit, self.tracker)
        self.tracker.reporter.ticker.start()

    def _send_report(self, node: str, report: Report) -> Reply:
        """Sends a commit report to ``node`` over the pooled report connection (a reused one
        the peer closed meanwhile is replaced once, unless :meth:`_abandon_reports` closed
        it). Raises ReplicationError."""
        abandoned = self._abandoned
        for attempt in range(2):
            client, reused = self._reports.get(node, connect_timeout=2.0)
            try:
                return client.report(report, deadline=5.0)
            except ReplicationError:
                self._reports.discard(node, client)
                if not reused or attempt or self._abandoned != abandoned:
                    raise
        raise AssertionError("unreachable")

    def _abandon_reports(self, node: str) -> None:
        """Ends the reports in flight to ``node`` (no longer a coordinator) at once: they
        fail, and are not sent again to it on a fresh connection."""
        self._abandoned += 1
        self._reports.discard(node)

    # -- membership, generations, snapshots ------------------------------------------------

    def set_membership(self, job: str, nodes: list[str], ranks_by_node: dict[str, list[int]],
                       round: int = 0) -> Placement:
        """Adopts a rendezvous round's membership: computes the placement (deterministic),
        publishes it (compare-and-set: one writer wins), and re-replicates committed shards
        whose holders left. Returns the placement."""
        placement = compute_placement(nodes, ranks_by_node, self.m, round)
        with self.tracker.lock:
            st = self.tracker.state(job)
            if st.placement is not None and st.placement == placement:
                return st.placement
        old, need_watch = self.tracker.set_placement(job, placement)
        log.info("%s: %s", job, placement.describe())
        try:
            publish_placement(self.coord, self.keys, job, placement)
        except CoordinationError as exc:
            self.tracker.etcd_error("publish the placement", exc)
        if need_watch:
            self.tracker.prefix.watch(job)
        if old is not None:
            self.background.submit(self._rereplicate, job)
        return placement

    def republish(self) -> None:
        """etcd lost its data: writes again, for every job, the placement in force, the
        newest commit this node knows (only if no newer one was written meanwhile) and this
        node's replicated record, so that commits go on and a restore finds what is held."""
        with self.tracker.lock:
            jobs = [(job, st.placement, st.committed) for job, st in self.tracker.jobs.items()]
        for job, placement, committed in jobs:
            try:
                if placement is not None:
                    publish_placement(self.coord, self.keys, job, placement)
                if committed is not None and committed.resolved:
                    # Every holder listed: the placement it derived from went with the data.
                    record_commit(self.coord, self.keys, job, dataclasses.replace(
                        committed, placement="", overrides={}))
            except (CoordinationError, CommitConflict) as exc:
                self.tracker.etcd_error("write its records again after an etcd data loss", exc)
            self.tracker.republish(job)

    def start_generation(self, job: str, generation: int) -> None:
        """A restore opened ``generation``: copies of older generations never count again
        (this node's sink refuses them too), but the committed step stays retained until the
        new generation commits (see :meth:`CommitBook.abandon_below`). The committed record
        is read first, so that this node retains it even when its watch has not told it yet
        (the restore that opened the generation read it a moment ago)."""
        committed, unsure = None, False
        if self.tracker.view(job)[0] is not None:
            try:
                committed = read_committed(self.coord, self.keys, job, _placements(self, job))
            except (CoordinationError, records.RecordError) as exc:
                self.tracker.etcd_error("read the committed record a new generation keeps", exc)
                unsure = True
        if committed is not None and committed.resolved:
            self.tracker.learn(job, committed)
        self.tracker.start_generation(job, generation, unsure or (
            committed is not None and not committed.resolved))
        if self.sink is not None:
            self.sink.set_floor(job, generation)

    def on_local_snapshot(self, job: str, rank: int, version: Version) -> None:
        """Queues the push to the rank's peers; never raises for replication trouble."""
        version = (int(version[0]), int(version[1]))
        with self.tracker.lock:
            st = self.tracker.state(job)
            if version[0] < st.book.floor or (rank in st.latest and version <= st.latest[rank]):
                return
            st.latest[rank] = version
            st.gen_base.setdefault(version[0], version[1] - 1)
            placement = st.placement
        if placement is None or self.node_id not in placement.holders:
            return
        peers = placement.peers_of(self.node_id)
        for peer in peers:
            self.pusher.lanes.submit(peer, Task(job, rank, version))
        if not peers:
            # m = 1: the owner's copy is all there is, and it must stay until committed.
            self.tracker.on_landed(job, rank, version)
            self.background.submit(self.tracker.on_replicated, job, rank, version)

    def add_commit_listener(self, listener: Callable[[str, Version], None]) -> None:
        self.tracker.commits.listeners.append(listener)

    def follows_commits(self, job: str) -> bool:
        placement = self.tracker.view(job)[0]
        return placement is not None and self.node_id in placement.holders

    def snapshot_grid(self, job: str) -> int:
        return self.tracker.prefix.grid(job)

    def on_commit_pending(self, job: str, version: Version,
                          skipped: Version | None = None) -> None:
        """A local snapshot (of ``skipped``, when known) was skipped because ``version``
        (acknowledged, not yet committed) holds the slot it needs: publishes the skip, and
        resolves ``version`` (its commit, else its withdrawal ``withdraw_after`` seconds after
        its acknowledgement), after which the slot is reused. Returns at once."""
        if skipped is not None:
            self.background.submit(self.tracker.on_skipped, job, skipped)
        self.tracker.on_blocked(job, version)

    # -- re-replication, drain, garbage ---------------------------------------------------

    def _rereplicate(self, job: str) -> None:
        try:
            committed = read_committed(self.coord, self.keys, job, _placements(self, job))
        except CoordinationError as exc:
            self.tracker.etcd_error("read the committed record", exc)
            return
        placement = self.tracker.view(job)[0]
        if committed is None or placement is None or not committed.resolved:
            return
        self.tracker.learn(job, committed)
        for rank, target in repair_plan(committed, placement, self.node_id):
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.add_done_callback(functools.partial(
                self._repaired, job, committed.version, rank, target))
            self.pusher.lanes.submit(target, Task(job, rank, committed.version, exact=True,
                                                  done=done))

    def _repaired(self, job: str, version: Version, rank: int, target: str,
                  done: concurrent.futures.Future) -> None:
        if not done.result():
            self.pusher.fail("rereplication")
            return
        with self.tracker.lock:
            self.counters["rereplications"] += 1
        self._set_holders(job, version, {rank: [target]}, drop=())

    def _set_holders(self, job: str, version: Version, added: dict[int, list[str]],
                     drop: tuple[str, ...]) -> None:
        placement, committed = self.tracker.view(job)
        if placement is None or committed is None or committed.version != tuple(version):
            return
        members = set(placement.nodes) - set(drop)
        changes = {r: [h for h in committed.holders.get(r, ()) if h in members] + hs
                   for r, hs in added.items()}
        try:
            current = update_holders(self.coord, self.keys, job, version, changes,
                                     self.clock.wall())
        except (CoordinationError, CommitConflict, records.RecordError) as exc:
            self.tracker.etcd_error("record new holders", exc)
            return
        if current is not None:
            self.tracker.learn(job, current)

    def drain(self, timeout: float = 120.0, on_progress: Any = None) -> dict[str, dict[str, Any]]:
        """Hands this node's copies of every committed step to other members, so that each
        rank keeps ``m`` copies without this node; blocks until done or ``timeout`` (real
        time). Returns per job: version, pushed and failed (rank, target) pairs, complete.

        Args:
            on_progress: called ``(done, failed, planned)`` as copies land (``elasticctl
                drain`` shows it).
        """
        deadline = self.clock.monotonic() + timeout
        progress = on_progress or (lambda done, failed, planned: None)
        report: dict[str, dict[str, Any]] = {}
        done_n = failed_n = planned_n = 0
        for job in list(self.tracker.jobs):
            self.tracker.prefix.reread(job)
            placement, committed = self.tracker.view(job)
            if placement is None or committed is None:
                continue
            plan = repair_plan(committed, placement, self.node_id,
                               leaving=frozenset({self.node_id}))
            futures = []
            for rank, target in plan:
                done: concurrent.futures.Future = concurrent.futures.Future()
                self.pusher.lanes.submit(target, Task(job, rank, committed.version,
                                                      exact=True, done=done))
                futures.append((rank, target, done))
            planned_n += len(futures)
            progress(done_n, failed_n, planned_n)
            pushed, failed = [], []
            for rank, target, done in futures:
                try:
                    ok = done.result(max(0.0, deadline - self.clock.monotonic()))
                except concurrent.futures.TimeoutError:
                    ok = False
                (pushed if ok else failed).append((rank, target))
                done_n, failed_n = done_n + bool(ok), failed_n + (not ok)
                progress(done_n, failed_n, planned_n)
            added: dict[int, list[str]] = {}
            for rank, target in pushed:
                added.setdefault(rank, []).append(target)
            if added:
                self._set_holders(job, committed.version, added, drop=(self.node_id,))
            report[job] = {"version": list(committed.version), "pushed": pushed,
                           "failed": failed, "complete": not failed}
            log.info("%s: drained %d copies of step %d from %s (%d failed)", job, len(pushed),
                     committed.step, self.node_id, len(failed))
        return report

    def _collect(self, job: str) -> None:
        """Frees replicas the current placement no longer asks this node to hold, once a step
        was committed under it (until then they may be what restores a dead node's ranks)."""
        placement, committed = self.tracker.view(job)
        if self.sink is None or placement is None or committed is None:
            return
        for rank in unwanted_replicas(committed, placement, self.node_id,
                                      [d.owner_rank for d in self.sink.holdings() if d.job == job]):
            log.info("%s: dropping the replica of rank %d (no longer held here)", job, rank)
            self.sink.drop(job, rank)

    # -- recovery --------------------------------------------------------------------------

    def fetch(self, job: str, rank: int, version: Version | None, into: Any,
              select: Any = None, reserve: Any = None) -> FetchResult:
        """Fetches ``rank``'s shard (``version``, or the newest) from a holder into ``into``
        (a writable buffer, or a function given the descriptor that returns one), verified;
        with ``select`` only the payload blocks it picks from the header, ``reserve`` called
        before each range is written (see :func:`~elasticd.recovery.fetch.fetch_shard`).

        Raises:
            ShardLost: no holder has an intact copy: use the persistent tier.
        """
        holders = _holders(self, job, rank, version)
        token = object()
        with self.tracker.lock:
            self._fetching[token] = (job, rank, version, holders, self.clock.monotonic())
        try:
            result = fetch_shard(job, rank, version, into, me=self.node_id, holders=holders,
                                 connections=self.connections, own=self._own_stores,
                                 clock=self.clock, rates=self.link_rates, select=select,
                                 reserve=reserve)
        except ShardLost as exc:
            with self.tracker.lock:
                self.fetch_failures["lost"] += 1  # and each holder that could not give it:
                self.fetch_failures.update(reason.split(":")[0] for _, reason in exc.attempts)
            log.error("%s", exc)
            raise
        finally:
            with self.tracker.lock:
                del self._fetching[token]
        with self.tracker.lock:
            self.counters["fetches"] += 1
            self.counters["fetch_bytes"] += result.wire_bytes
            self.counters["fetch_micros"] += int(result.seconds * 1e6)
            self.fetch_failures.update(reason.split(":")[0] for _, reason in result.attempts)
        return result

    def hand_sessions(self, job: str, rank: int, version: Version
                      ) -> list[tuple[str, Any, int, Ticket]]:
        """Sessions scoped to ``job`` to the remote holders of ``rank``'s ``version``, handed
        over (:func:`elasticd.recovery.handing.hand_sessions`).

        Raises:
            ValueError: the transport runs over TLS, whose sessions cannot be handed over.
        """
        if self.connections.ssl_context is not None:
            raise ValueError("replication runs over TLS here: its sessions cannot be handed "
                             "to a worker")
        return hand_sessions(self.connections, _holders(self, job, rank, version),
                             self.node_id, job, rank, version, self.link_rates)

    def committed(self, job: str) -> Committed | None:
        """The job's committed record as etcd holds it now, or None (none yet, or unreadable).

        Read from etcd rather than the tracker's cache: after a failure the restarted workers
        must see the commit another node recorded, even before this node's watch caught up.

        Raises:
            CoordinationError: etcd could not be read.
        """
        return read_committed(self.coord, self.keys, job, _placements(self, job))

    def fetch_to_local(self, job: str, rank: int, version: Version | None,
                       need: Any = None) -> FetchResult:
        if need is not None:
            return fetch_into_scratch(self, self.store, job, rank, version, need)
        return fetch_into_store(self, self.store, job, rank, version)

    # -- status, metrics, lifecycle ---------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Per job: placement, committed step and holders, local progress, sync lag; and the
        fetches in progress from peers (``fetching``) and served to peers (``serving``), each
        with its age: after a fault ends nothing must stay there."""
        backlog = self.pusher.lanes.backlog()
        held = self.sink.store.bytes_held() if self.sink is not None else 0
        with self.tracker.lock:
            out: dict[str, Any] = {}
            for job, st in sorted(self.tracker.jobs.items()):
                p, c = st.placement, st.committed
                out[job] = {
                    "placement": p.describe() if p else None,
                    "holders": {o: list(hs) for o, hs in p.holders.items()} if p else {},
                    "committed": list(c.version) if c else None,
                    "committed_holders": {str(r): list(h) for r, h in c.holders.items()} if c else {},
                    "latest_local": {str(r): list(v) for r, v in sorted(st.latest.items())},
                    "replicated": {str(r): [list(v) for v in vs] for r, vs in st.replicated.items()},
                    "sync_lag": st.sync_lag(),
                    "under_replicated": under_replicated(c, p),
                    "generation_floor": st.book.floor,
                    "awaiting_commit": [list(v) for v in st.book.awaiting()],
                }
        for job in out:  # the reporter takes the tracker's lock itself
            out[job].update(self.tracker.reporter.status(job))
        with self.tracker.lock:
            now = self.clock.monotonic()
            fetching = [{"job": job, "rank": rank, "version": version and list(version),
                         "holders": holders, "seconds": round(now - started, 3)}
                        for job, rank, version, holders, started in self._fetching.values()]
        return {"node": self.node_id, "jobs": out, "backlog": backlog,
                "replica_bytes_held": held, "fetching": fetching, "serving": self.serving()}

    def stats(self) -> ReplicationStats:
        """Plain numbers for the daemon's metrics (see :class:`ReplicationStats`)."""
        with self.tracker.lock:
            c = self.counters + self.tracker.counters
            jobs = list(self.tracker.jobs.values())
            lags = [st.sync_lag() for st in jobs]
            committed = [st.committed.step for st in jobs if st.committed]
            under = sum(under_replicated(st.committed, st.placement) for st in jobs)
            fetch_failures = dict(self.fetch_failures)
        pushed, failures = self.pusher.snapshot()
        return ReplicationStats(
            replication_pushes_total=pushed.get("pushes", 0),
            replication_bytes_total=pushed.get("push_bytes", 0),
            replication_failures_total=failures,
            replication_skipped_total=self.pusher.lanes.skipped,
            replication_commit_wait_timeouts_total=c.get("gate_timeouts", 0),
            commits_total=c.get("commits", 0),
            committed_step=max(committed, default=-1),
            sync_lag_steps=max(lags, default=0),
            under_replicated_shards=under,
            replica_bytes_held=self.sink.store.bytes_held() if self.sink is not None else 0,
            rereplications_total=c.get("rereplications", 0),
            fetches_total=c.get("fetches", 0),
            fetch_bytes_total=c.get("fetch_bytes", 0),
            fetch_seconds_total=c.get("fetch_micros", 0) / 1e6,
            fetch_failures_total=fetch_failures,
            etcd_errors_total=c.get("etcd_errors", 0),
            withdrawals_total=c.get("withdrawals", 0),
            commit_coordinator=sum(self.tracker.reporter.leading(job) is not None
                                   for job in list(self.tracker.jobs)))

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Blocks (real time) until no push, commit or repair is pending; False on timeout."""
        deadline = self.clock.monotonic() + timeout
        lanes = self.pusher.lanes
        while self.clock.monotonic() < deadline:
            if not lanes.wait_idle(max(0.0, deadline - self.clock.monotonic())):
                return False
            if not self.background.wait_idle(deadline - self.clock.monotonic()):
                return False
            if not self.tracker.reporter.settled():  # a report due: the ticker resends it
                self.clock.sleep(0.02)
                continue
            if lanes.wait_idle(0):  # background work may have queued pushes meanwhile
                return True
        return False

    def remove_job(self, job: str) -> None:
        """Forgets a finished job and frees its replicas here."""
        self.tracker.forget(job)
        if self.sink is not None:
            self.sink.remove_job(job)

    def close(self, resign: bool = True) -> None:
        """Stops pushing (pending pushes dropped, those in flight finish), ends this node's
        commit coordination (``resign``: at once, else when its lease expires), unwatches,
        joins the pool and closes connections."""
        self.background.refuse()
        self.tracker.close(resign)
        self.pusher.lanes.close()
        self.background.close()
        self.connections.close()
        self._reports.close()


def _holders(replicator: Replicator, job: str, rank: int, version: Version | None) -> list[str]:
    """The nodes to ask for ``rank``'s ``version``, in order (:func:`holder_order`): for a
    fetch, and for sessions handed to a worker."""
    with replicator.tracker.lock:
        st = replicator.tracker.jobs.get(job) or JobState()
        committed, placements = st.committed, (st.placement, st.previous)
    if committed is None or (version is not None and committed.version != tuple(version)):
        # A node new to the job (a standby taking a drained or dead node's slot) has no
        # placement or commit of its own yet: the committed record names the holders.
        try:
            committed = read_committed(replicator.coord, replicator.keys, job,
                                       placements) or committed
        except (CoordinationError, records.RecordError) as exc:
            log.warning("%s: cannot read the committed record for a fetch: %s", job, exc)
    return holder_order(job, rank, version, replicator.node_id, committed, placements)


def _placements(replicator: Replicator, job: str) -> tuple[Placement | None, ...]:
    """The job's placement and the one before it (none for a job the node does not know)."""
    with replicator.tracker.lock:
        st = replicator.tracker.jobs.get(job)
        return (st.placement, st.previous) if st is not None else ()
