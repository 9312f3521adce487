"""The daemon-side replication service: push local snapshots to placement peers, commit steps,
re-replicate after membership changes, fetch shards for recovery, drain.

One :class:`Replicator` per daemon. The daemon tells it the rendezvous round's membership
(:meth:`~Replicator.set_membership`), and the checkpoint service tells it each completed local
snapshot (:meth:`~Replicator.on_local_snapshot`). Pushes run on per-peer lanes
(:mod:`elasticd.replication.lanes`): the newest snapshot wins, intermediate steps are skipped,
nothing queues without bound, and the training loop never waits. When every peer acknowledged a
verified copy of a rank's version, the rank has ``m`` copies; this node records that in etcd,
and whichever node completes a version last records the commit (:mod:`elasticd.replication.commit`).

Retention: a holder keeps the two newest copies of each shard (double-buffered slots). So that a
committed copy is not pushed out before a newer version commits, a rank's next push waits (up to
``commit_wait`` seconds, real time) until its previous fully replicated version is committed;
after that it goes ahead anyway and the wait is counted, because nodes that replicated different
steps would otherwise wait for each other forever.

Locks: ``_lock`` guards job state and is never held while calling etcd, a peer or a slot store,
since the in-memory coordinator runs watch callbacks on the writer's thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import ssl
import threading
import time
from typing import Any

from elasticd.checkpoint.format import SnapshotError
from elasticd.checkpoint.shm import SlotStore, SnapshotView
from elasticd.clock import Clock, SystemClock
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator, EventType, Watch
from elasticd.coordination.keys import Keyspace
from elasticd.replication.api import EXISTS, ConnectionLost, Descriptor, Refused, ReplicationError, Version
from elasticd.replication.commit import (
    KEEP_VERSIONS,
    CommitConflict,
    Committed,
    Replicated,
    committed_key,
    decide,
    decode_committed,
    encode_replicated,
    read_committed,
    read_progress,
    record_commit,
    replicated_key,
    update_holders,
)
from elasticd.replication.lanes import AddressBook, Connections, Lanes, NoAddress, Task, resolve
from elasticd.replication.placement import Placement, compute_placement, decode_placement, encode_placement
from elasticd.replication.recovery import (
    FetchResult,
    ShardLost,
    fetch_shard,
    holder_order,
    repair_plan,
    under_replicated,
)
from elasticd.replication.shm_sink import ShmSink, descriptor_of

log = logging.getLogger(__name__)

__all__ = ["FetchResult", "Replicator", "ShardLost"]


@dataclasses.dataclass
class _Job:
    placement: Placement | None = None
    previous: Placement | None = None
    floor: int = 0
    committed: Committed | None = None
    committed_at_change: Version | None = None
    acked: dict[int, dict[Version, set[str]]] = dataclasses.field(default_factory=dict)
    replicated: dict[int, list[Version]] = dataclasses.field(default_factory=dict)
    latest: dict[int, Version] = dataclasses.field(default_factory=dict)
    gen_base: dict[int, int] = dataclasses.field(default_factory=dict)
    watch: Watch | None = None


class Replicator:
    """Replicates this node's snapshots and serves recovery for one daemon.

    Args:
        node_id: this node.
        coord, keys: etcd and its keyspace (placement and commit records).
        store: this node's local slot store (the checkpoint service's).
        secret: the cluster secret for the replication transport.
        m: replication factor, the owner's copy included.
        clock: times transfers and stamps records.
        peers_address: node id -> (host, port) of its replica server, or None.
        sink: the sink this node's replica server stores into (sources for re-replication,
            drain and fetches of shards held here).
        workers: pool threads (lanes run one per thread while they have work).
        commit_wait: seconds a push waits for the previous version's commit (see module doc).
        timeout: seconds any single network send or receive may block.
    """

    def __init__(self, node_id: str, coord: Coordinator, keys: Keyspace, store: SlotStore,
                 secret: bytes, m: int = 2, clock: Clock | None = None,
                 peers_address: AddressBook = lambda node: None, *,
                 sink: ShmSink | None = None, workers: int = 4, commit_wait: float = 2.0,
                 timeout: float = 30.0, ssl_context: ssl.SSLContext | None = None) -> None:
        if m < 1 or workers < 1 or commit_wait < 0:
            raise ValueError(f"need m >= 1, workers >= 1, commit_wait >= 0; got m={m}, "
                             f"workers={workers}, commit_wait={commit_wait}")
        self.node_id, self.coord, self.keys, self.store = node_id, coord, keys, store
        self.m, self.clock, self.sink, self.commit_wait = m, clock or SystemClock(), sink, commit_wait
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._jobs: dict[str, _Job] = {}
        self._closing = False
        self._busy = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self.fetch_failures: collections.Counter[str] = collections.Counter()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix=f"replicator-{node_id}")
        self._conns = Connections(node_id, secret, peers_address, timeout=timeout,
                                  ssl_context=ssl_context, clock=self.clock)
        self._lanes = Lanes(self._executor, self._run)

    # -- membership and generations --------------------------------------------------------

    def set_membership(self, job: str, nodes: list[str], ranks_by_node: dict[str, list[int]],
                       round: int = 0) -> Placement:
        """Adopts a rendezvous round's membership: computes the placement (deterministic),
        publishes it (compare-and-set: one writer wins), and re-replicates committed shards
        whose holders left. Returns the placement."""
        placement = compute_placement(nodes, ranks_by_node, self.m, round)
        with self._lock:
            st = self._jobs.setdefault(job, _Job())
            old = st.placement
            if old is not None and encode_placement(old) == encode_placement(placement):
                return old
            st.previous, st.placement = old, placement
            st.committed_at_change = st.committed.version if st.committed else None
            need_watch = st.watch is None
        log.info("%s: %s", job, placement.describe())
        self._publish_placement(job, placement)
        if need_watch:
            self._watch(job)
        if old is not None:
            self._submit(self._rereplicate, job)
        return placement

    def start_generation(self, job: str, generation: int) -> None:
        """A fallback to an older persisted step opened ``generation``: copies and commits of
        older generations never count again (this node's sink refuses them too)."""
        with self._lock:
            st = self._jobs.setdefault(job, _Job())
            st.floor = max(st.floor, generation)
            for rank in list(st.replicated):
                st.replicated[rank] = [v for v in st.replicated[rank] if v[0] >= st.floor]
            st.latest = {r: v for r, v in st.latest.items() if v[0] >= st.floor}
            self._cond.notify_all()
        if self.sink is not None:
            self.sink.set_floor(job, generation)

    def _publish_placement(self, job: str, placement: Placement) -> bool:
        key, raw = self.keys.job_placement(job), encode_placement(placement)
        try:
            for _ in range(8):
                kv = self.coord.get(key)
                if kv is not None:
                    if kv.value == raw:
                        return False
                    try:
                        current = decode_placement(kv.value, key).round
                    except records.RecordError:
                        current = -1
                    if current > placement.round or current == placement.round != 0:
                        return False  # a newer round's, or this round's from another writer
                if self.coord.compare_and_set(key, raw, kv.mod_revision if kv else 0):
                    self.counters["placements_published"] += 1
                    return True
        except CoordinationError as exc:
            self._etcd_error("publish placement", exc)
        return False

    # -- snapshots in, pushes out ----------------------------------------------------------

    def on_local_snapshot(self, job: str, rank: int, version: Version) -> None:
        """A local snapshot of ``rank`` completed: queue its push to the rank's peers. Returns
        at once; never raises for replication trouble."""
        version = (int(version[0]), int(version[1]))
        with self._lock:
            st = self._jobs.setdefault(job, _Job())
            if version[0] < st.floor or (rank in st.latest and version <= st.latest[rank]):
                return
            st.latest[rank] = version
            st.gen_base.setdefault(version[0], version[1] - 1)
            placement = st.placement
        if placement is None or self.node_id not in placement.holders:
            self.counters["no_placement"] += 1
            return
        peers = placement.peers_of(self.node_id)
        for peer in peers:
            self._lanes.submit(peer, Task(job, rank, version))
        if not peers:  # m = 1: the owner's copy is all there is
            self._submit(self._on_replicated, job, rank, version)

    def _run(self, peer: str, task: Task) -> None:
        if task.exact:
            resolve(task, self._push_exact(peer, task))
        else:
            self._push_newest(peer, task)

    def _push_newest(self, peer: str, task: Task) -> None:
        self._gate(task.job, task.rank)
        view = self._view(self.store, task.job, task.rank, None)
        if view is None:
            return
        try:
            version = view.header.version()
            with self._lock:
                st = self._jobs.get(task.job)
                done = st is None or version[0] < st.floor or peer in st.acked.get(
                    task.rank, {}).get(version, ())
            ok = not done and self._send(peer, view)
        finally:
            view.release()
        if ok:
            self._on_ack(task.job, task.rank, version, peer)

    def _push_exact(self, peer: str, task: Task) -> bool:
        stores = [self.store] + ([self.sink.store] if self.sink is not None else [])
        if task.source == "replica":
            stores.reverse()
        for store in stores:
            view = self._view(store, task.job, task.rank, task.version)
            if view is not None:
                try:
                    return self._send(peer, view)
                finally:
                    view.release()
        self._fail("source_missing")
        return False

    @staticmethod
    def _view(store: SlotStore, job: str, rank: int, version: Version | None) -> SnapshotView | None:
        try:
            return store.latest(job, rank, pin=True, version=version)
        except (SnapshotError, ValueError):
            return None

    def _send(self, peer: str, view: SnapshotView) -> bool:
        d, buf = descriptor_of(view), view.buffer
        for attempt in (0, 1):
            try:
                client, reused = self._conns.get(peer)
            except NoAddress:
                self._fail("no_address")
                return False
            except ReplicationError as exc:
                log.warning("cannot connect to %s: %s", peer, exc)
                self._fail("unreachable")
                return False
            try:
                result = client.push(d, buf[: d.header_bytes], buf[d.header_bytes : d.total_bytes])
            except Refused as exc:
                if exc.reason == EXISTS:
                    return True  # the peer already holds this very version, verified
                self._fail(exc.reason)
                log.info("%s refused %s rank %d %s: %s", peer, d.job, d.owner_rank, d.version, exc)
                return False
            except ReplicationError as exc:
                self._conns.discard(peer, client)
                if reused and attempt == 0 and isinstance(exc, ConnectionLost):
                    continue  # the peer may have closed an idle connection: one fresh try
                self._fail("connection" if isinstance(exc, ConnectionLost) else "remote")
                log.warning("push of %s rank %d %s to %s failed: %s", d.job, d.owner_rank,
                            d.version, peer, exc)
                return False
            with self._lock:
                self.counters["pushes"] += 1
                self.counters["push_bytes"] += d.total_bytes
                self.counters["push_micros"] += int(result.seconds * 1e6)
            return True
        return False

    def _gate(self, job: str, rank: int) -> None:
        """Waits until the rank's previous fully replicated version is committed (see the
        module doc); real time, since it is a bound on waiting, not a measurement."""
        deadline = time.monotonic() + self.commit_wait
        with self._cond:
            while not self._closing:
                st = self._jobs.get(job)
                last = (st.replicated.get(rank) or [None])[0] if st else None
                if last is None or (st.committed is not None and st.committed.version >= last):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.counters["gate_timeouts"] += 1  # under the lock already
                    return
                self._cond.wait(remaining)

    # -- copies counted, steps committed ---------------------------------------------------

    def _on_ack(self, job: str, rank: int, version: Version, peer: str) -> None:
        with self._lock:
            st = self._jobs.get(job)
            if st is None or st.placement is None:
                return
            acked = st.acked.setdefault(rank, {}).setdefault(version, set())
            acked.add(peer)
            if not set(st.placement.peers_of(self.node_id)) <= acked:
                return
        self._on_replicated(job, rank, version)

    def _on_replicated(self, job: str, rank: int, version: Version) -> None:
        """``rank`` has ``m`` copies of ``version``: record it, and commit if every rank has."""
        with self._lock:
            st = self._jobs.get(job)
            if st is None or st.placement is None or version in st.replicated.get(rank, ()):
                return
            versions = sorted({version, *st.replicated.get(rank, ())}, reverse=True)
            st.replicated[rank] = versions[:KEEP_VERSIONS]
            oldest = st.replicated[rank][-1]
            st.acked[rank] = {v: s for v, s in st.acked.get(rank, {}).items() if v >= oldest}
            mine = st.placement.ranks.get(self.node_id, ())
            # A version can commit only once all of this node's ranks have it.
            if mine and not all(version in st.replicated.get(r, ()) for r in mine):
                return
            record = Replicated(
                self.node_id, st.placement.round,
                {r: tuple(st.replicated[r]) for r in (mine or st.replicated) if r in st.replicated},
                {r: st.placement.holders[self.node_id] for r in (mine or st.replicated)},
                self.clock.wall())
        try:
            self.coord.put(replicated_key(self.keys, job, self.node_id), encode_replicated(record))
        except CoordinationError as exc:
            self._etcd_error("record replicated versions", exc)
            return
        self._try_commit(job)

    def _try_commit(self, job: str) -> None:
        with self._lock:
            st = self._jobs.get(job)
            if st is None or st.placement is None:
                return
            placement, floor, committed = st.placement, st.floor, st.committed
        try:
            candidate = decide(placement, read_progress(self.coord, self.keys, job),
                               floor=floor, now=self.clock.wall())
            if candidate is None or (committed and candidate.version <= committed.version):
                return
            written, current = record_commit(self.coord, self.keys, job, candidate)
        except (CoordinationError, CommitConflict) as exc:
            self._etcd_error("record the commit", exc)
            return
        if written:
            self.counters["commits"] += 1
            log.info("%s: committed step %d (generation %d), %d ranks with %d copies each", job,
                     current.step, current.generation, len(current.ranks), current.m)
        self._learn(job, current)

    def _learn(self, job: str, committed: Committed) -> None:
        with self._cond:
            st = self._jobs.get(job)
            if st is None:
                return
            old = st.committed
            if old is not None and (committed.version < old.version or committed == old):
                return
            st.committed = committed
            advanced = st.committed_at_change is None or committed.version > st.committed_at_change
            self._cond.notify_all()
        if advanced and (old is None or committed.version > old.version):
            self._submit(self._collect, job)

    def _watch(self, job: str) -> None:
        key = committed_key(self.keys, job)
        try:
            kvs, revision = self.coord.get_prefix(key)
            for kv in kvs:
                if kv.key == key:
                    self._learn(job, decode_committed(kv.value, key))
            watch = self.coord.watch_prefix(key, functools.partial(self._on_watch, job),
                                            revision + 1)
        except (CoordinationError, records.RecordError) as exc:
            self._etcd_error("watch the committed record", exc)
            return
        with self._lock:
            st = self._jobs.get(job)
            if st is not None and st.watch is None and not self._closing:
                st.watch, watch = watch, None
        if watch is not None:
            watch.cancel()

    def _on_watch(self, job: str, events: Any) -> None:
        if isinstance(events, CoordinationError):
            self._submit(self._reread, job)  # events may have been missed: read it again
            return
        key = committed_key(self.keys, job)
        for event in events:
            if event.type is EventType.PUT and event.kv.key == key:
                try:
                    self._learn(job, decode_committed(event.kv.value, key))
                except records.RecordError as exc:
                    log.error("unreadable committed record of %s: %s", job, exc)

    def _reread(self, job: str) -> None:
        try:
            committed = read_committed(self.coord, self.keys, job)
        except CoordinationError as exc:
            self._etcd_error("read the committed record", exc)
            return
        if committed is not None:
            self._learn(job, committed)

    def _collect(self, job: str) -> None:
        """Frees replicas the current placement no longer asks this node to hold, once a step
        was committed under it (until then they may be what restores a dead node's ranks)."""
        with self._lock:
            st = self._jobs.get(job)
            placement, committed = (st.placement, st.committed) if st else (None, None)
        if self.sink is None or placement is None or committed is None:
            return
        if not any(placement.ranks.values()):
            return  # ranks unknown: cannot tell which replicas are wanted
        wanted = {r for o in placement.held_by(self.node_id) for r in placement.ranks[o]}
        # Ranks this node now owns are in its local store: an old replica of one is redundant.
        mine = set(placement.ranks.get(self.node_id, ()))
        wanted |= {r for r, hs in committed.holders.items() if self.node_id in hs and r not in mine}
        for d in self.sink.holdings():
            if d.job == job and d.owner_rank not in wanted:
                log.info("%s: dropping the replica of rank %d (no longer held here)", job,
                         d.owner_rank)
                self.sink.drop(job, d.owner_rank)

    # -- re-replication, drain, recovery ---------------------------------------------------

    def _rereplicate(self, job: str) -> None:
        try:
            committed = read_committed(self.coord, self.keys, job)
        except CoordinationError as exc:
            self._etcd_error("read the committed record", exc)
            return
        with self._lock:
            st = self._jobs.get(job)
            placement = st.placement if st else None
        if committed is None or placement is None:
            return
        self._learn(job, committed)
        for rank, target in repair_plan(committed, placement, self.node_id):
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.add_done_callback(functools.partial(
                self._repaired, job, committed.version, rank, target))
            self._lanes.submit(target, Task(job, rank, committed.version, exact=True, done=done))

    def _repaired(self, job: str, version: Version, rank: int, target: str,
                  done: concurrent.futures.Future) -> None:
        if not done.result():
            self._fail("rereplication")
            return
        self.counters["rereplications"] += 1
        self._set_holders(job, version, {rank: [target]}, drop=())

    def _set_holders(self, job: str, version: Version, added: dict[int, list[str]],
                     drop: tuple[str, ...]) -> None:
        with self._lock:
            st = self._jobs.get(job)
            placement, committed = (st.placement, st.committed) if st else (None, None)
        if placement is None or committed is None or committed.version != tuple(version):
            return
        members = set(placement.nodes) - set(drop)
        changes = {r: [h for h in committed.holders.get(r, ()) if h in members] + hs
                   for r, hs in added.items()}
        try:
            current = update_holders(self.coord, self.keys, job, version, changes,
                                     self.clock.wall())
        except (CoordinationError, CommitConflict, records.RecordError) as exc:
            self._etcd_error("record new holders", exc)
            return
        if current is not None:
            self._learn(job, current)

    def drain(self, timeout: float = 120.0) -> dict[str, dict[str, Any]]:
        """Hands this node's copies of every committed step to other members, so that each
        rank keeps ``m`` copies without this node; blocks until done or ``timeout`` (real
        time). Returns per job: version, pushed and failed (rank, target) pairs, complete."""
        deadline = time.monotonic() + timeout
        report: dict[str, dict[str, Any]] = {}
        for job in list(self._jobs):
            self._reread(job)
            with self._lock:
                st = self._jobs[job]
                placement, committed = st.placement, st.committed
            if placement is None or committed is None:
                continue
            plan = repair_plan(committed, placement, self.node_id,
                               leaving=frozenset({self.node_id}))
            futures = []
            for rank, target in plan:
                done: concurrent.futures.Future = concurrent.futures.Future()
                self._lanes.submit(target, Task(job, rank, committed.version, exact=True,
                                                done=done))
                futures.append((rank, target, done))
            pushed, failed = [], []
            for rank, target, done in futures:
                try:
                    ok = done.result(max(0.0, deadline - time.monotonic()))
                except concurrent.futures.TimeoutError:
                    ok = False
                (pushed if ok else failed).append((rank, target))
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

    def fetch(self, job: str, rank: int, version: Version | None, into: Any) -> FetchResult:
        """Fetches ``rank``'s shard (``version``, or the newest) from a holder into ``into``
        (a writable buffer, or a function given the descriptor that returns one), verified.

        Raises:
            ShardLost: no holder has an intact copy: use the persistent tier.
        """
        with self._lock:
            st = self._jobs.get(job) or _Job()
            committed, placements = st.committed, (st.placement, st.previous)
        holders = holder_order(job, rank, version, self.node_id, committed, placements)
        try:
            result = fetch_shard(job, rank, version, into, me=self.node_id, holders=holders,
                                 connections=self._conns, local=self._read_own, clock=self.clock)
        except ShardLost as exc:
            with self._lock:
                self.fetch_failures["lost"] += 1
            log.error("%s", exc)
            raise
        with self._lock:
            self.counters["fetches"] += 1
            self.counters["fetch_bytes"] += result.wire_bytes
            self.counters["fetch_micros"] += int(result.seconds * 1e6)
            for _, reason in result.attempts:
                self.fetch_failures[reason.split(":")[0]] += 1
        return result

    def _read_own(self, job: str, rank: int, version: Version | None, sized: Any) -> Descriptor | None:
        for store in [self.store] + ([self.sink.store] if self.sink is not None else []):
            view = self._view(store, job, rank, version)
            if view is None:
                continue
            try:
                d = descriptor_of(view)
                memoryview(sized(d)).cast("B")[: d.total_bytes] = view.buffer
                return d
            finally:
                view.release()
        return None

    # -- status, metrics, lifecycle --------------------------------------------------------

    def _sync_lag(self, st: _Job) -> int:
        if not st.latest:
            return 0
        latest = max(st.latest.values())
        c = st.committed
        if c is not None and c.generation == latest[0]:
            return max(0, latest[1] - c.step)
        if c is not None and c.generation > latest[0]:
            return 0
        return latest[1] - st.gen_base.get(latest[0], latest[1] - 1)

    def status(self) -> dict[str, Any]:
        """Per job: placement, committed step and holders, local progress, sync lag."""
        backlog = self._lanes.backlog()
        with self._lock:
            out: dict[str, Any] = {}
            for job, st in sorted(self._jobs.items()):
                p, c = st.placement, st.committed
                out[job] = {
                    "placement": p.describe() if p else None,
                    "holders": {o: list(hs) for o, hs in p.holders.items()} if p else {},
                    "committed": list(c.version) if c else None,
                    "committed_holders": {str(r): list(h) for r, h in c.holders.items()} if c else {},
                    "latest_local": {str(r): list(v) for r, v in sorted(st.latest.items())},
                    "replicated": {str(r): [list(v) for v in vs] for r, vs in st.replicated.items()},
                    "sync_lag": self._sync_lag(st),
                    "under_replicated": under_replicated(c, p),
                    "generation_floor": st.floor,
                }
            return {"node": self.node_id, "jobs": out, "backlog": backlog}

    def stats(self) -> dict[str, Any]:
        """Plain numbers for the daemon's metrics (a node runs one job: maxima over jobs)."""
        with self._lock:
            c = dict(self.counters)
            jobs = list(self._jobs.values())
            lags = [self._sync_lag(st) for st in jobs]
            committed = [st.committed.step for st in jobs if st.committed]
            under = sum(under_replicated(st.committed, st.placement) for st in jobs)
            failures, fetch_failures = dict(self.failures), dict(self.fetch_failures)
        return {
            "replication_pushes_total": c.get("pushes", 0),
            "replication_bytes_total": c.get("push_bytes", 0),
            "replication_seconds_total": c.get("push_micros", 0) / 1e6,
            "replication_failures_total": failures,
            "replication_skipped_total": self._lanes.skipped,
            "replication_commit_wait_timeouts_total": c.get("gate_timeouts", 0),
            "commits_total": c.get("commits", 0),
            "committed_step": max(committed, default=-1),
            "sync_lag_steps": max(lags, default=0),
            "under_replicated_shards": under,
            "replica_bytes_held": self.sink.bytes_held() if self.sink is not None else 0,
            "rereplications_total": c.get("rereplications", 0),
            "fetches_total": c.get("fetches", 0),
            "fetch_bytes_total": c.get("fetch_bytes", 0),
            "fetch_seconds_total": c.get("fetch_micros", 0) / 1e6,
            "fetch_failures_total": fetch_failures,
            "etcd_errors_total": c.get("etcd_errors", 0),
        }

    def _fail(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1

    def _etcd_error(self, what: str, exc: Exception) -> None:
        with self._lock:
            self.counters["etcd_errors"] += 1
        log.warning("replicator %s: cannot %s: %s", self.node_id, what, exc)

    def _submit(self, fn: Any, *args: Any) -> None:
        with self._lock:
            if self._closing:
                return
            self._busy += 1

        def run() -> None:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 — background work must never kill the pool
                log.exception("replicator %s: %s failed", self.node_id, fn.__name__)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

        try:
            self._executor.submit(run)
        except RuntimeError:  # shut down meanwhile
            with self._cond:
                self._busy -= 1

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Blocks (real time) until no push, commit or repair is pending; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._lanes.wait_idle(max(0.0, deadline - time.monotonic())):
                with self._cond:
                    if self._cond.wait_for(lambda: self._busy == 0,
                                           max(0.0, deadline - time.monotonic())):
                        if not self._lanes.backlog() and self._lanes.wait_idle(0):
                            return True
        return False

    def remove_job(self, job: str) -> None:
        """Forgets a finished job and frees its replicas here."""
        with self._lock:
            st = self._jobs.pop(job, None)
        if st is not None and st.watch is not None:
            st.watch.cancel()
        if self.sink is not None:
            self.sink.remove_job(job)

    def close(self) -> None:
        """Stops pushing (pending pushes dropped, those in flight finish), unwatches, joins the
        pool and closes connections."""
        with self._cond:
            self._closing = True
            watches = [st.watch for st in self._jobs.values() if st.watch is not None]
            self._cond.notify_all()
        for watch in watches:
            watch.cancel()
        self._lanes.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._conns.close()
