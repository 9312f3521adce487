"""The daemon's checkpoint service: what workers call, over the local socket, to snapshot and
restore.

A worker asks for a slot (``ckpt_reserve``), copies its state into it, writes the unsealed
header JSON into the slot's header area and says so (``ckpt_complete``); the service reads and
validates that header, computes the xxh3 block checksums and seals the snapshot — on the
daemon's thread, so checksums never stall the training loop. Over the memory cap a snapshot is
skipped, never an error: the worker gets ``{"skip": true}``, the job is marked unprotected, one
warning is logged per job and a counter goes up. At restore, workers list what is held
(``ckpt_list``), open a snapshot read-only (``ckpt_open``: verified here first, pinned until
``ckpt_release``) and report where they restored from (``ckpt_report``).

When every local rank has completed a step, the step is offered to the :class:`Persister`.
Slot files stay the daemon's (0600 in its 0700 shm dir): a worker never opens one by path, it
maps the descriptor that comes with the reply (``_fds``, passed over the local socket with
``SCM_RIGHTS``): read-write for ``ckpt_reserve``, read-only for ``ckpt_open`` and
``ckpt_fetch`` — the very file the daemon verified, whatever the path names by then, and the
same way whichever uid the job runs as. Daemon side: no torch.

Ops (request fields → reply fields; errors are :class:`RequestError` replies):

* ``ckpt_reserve`` job, rank, world_size, nbytes, [local_world_size], [step], [mapped
  [[dev, ino], ...]] → path, capacity, ticket, file [dev, ino], and the slot's descriptor
  (read-write) unless ``file`` is one of the ``mapped`` files the worker still maps | skip,
  reason
* ``ckpt_complete`` job, rank, ticket, header_size, [stall_seconds] → generation, step, bytes
* ``ckpt_list`` job, [rank], [world_size] → ram {rank: [[gen, step], ...]}, persisted
  [[gen, step], ...], persist_root, progress [gen, step] | null, replicas {rank: [[gen, step],
  ...]} (copies of other nodes' shards held here; empty without a replicator)
* ``ckpt_open`` job, rank, generation, step → path, offset, size, pin, and the slot's
  descriptor (read-only)
* ``ckpt_release`` pin → {}
* ``ckpt_report`` job, rank, source, seconds, steps_lost, bytes, generation, step, [refused],
  [next_generation] → {}
* ``ckpt_committed`` job → generation, step, ranks | committed: null (no replicator, nothing
  committed yet, or etcd unreadable)
* ``register`` job, rank, world_size, [local_rank], [restart], [step] → node, unprotected
  (a worker's Checkpointer says who it is, when it starts and after each restore: the daemon
  learns the group's ranks from it, for placement, as from a progress report)
* ``ckpt_fetch`` job, rank, generation, step → path, offset, size, pin (as ``ckpt_open``),
  source "local" | "peer", wire_bytes, holder | lost: true, reason. Makes a shard (possibly of
  another node's rank, after that node died) available in this node's store, fetching it from
  the peers that hold copies when it is not here.

With a :class:`~elasticd.replication.replicator.Replicator`, every completed snapshot is
handed to it (``on_local_snapshot``) for replication to peers, and a restore that opens a new
generation (``ckpt_report`` with ``next_generation``) tells it (``start_generation``).

A ``ckpt_reserve`` with a step, and a ``register``, count as the worker's progress report: they
go to :attr:`CheckpointService.on_progress` (hang detection, the group's ranks), so a script
that checkpoints needs no :func:`elasticd.worker.progress` call. Each job's protection is
assessed every daemon cycle (:mod:`elasticd.checkpoint.protection`); ``ckpt_reserve`` and
``register`` replies carry ``unprotected`` (the reason) while it lasts, so workers warn too.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
from typing import Any, Callable

from elasticd.checkpoint.api import (
    CommitPending,
    OverBudget,
    Slot,
    SlotBusy,
    SlotStoreError,
    StaleSlot,
)
from elasticd.checkpoint.format import PREAMBLE_SIZE, SnapshotError
from elasticd.checkpoint.protection import REASONS, JobView, Unprotected, assess
from elasticd.checkpoint.reader import _header_from_json
from elasticd.checkpoint.shm import SlotStore
from elasticd.clock import Clock, SystemClock
from elasticd.local.wire import RequestError
from elasticd.checkpoint.telemetry import RESTORE_SOURCES
from elasticd.persistence.persister import Flushed, Persister
from elasticd.replication.recovery import ShardLost

log = logging.getLogger(__name__)

@dataclasses.dataclass
class _Job:
    world_size: int = 0
    local_world_size: int | None = None
    uid: int | None = None
    ranks: set[int] = dataclasses.field(default_factory=set)
    slots: dict[int, Slot] = dataclasses.field(default_factory=dict)
    nbytes: dict[int, int] = dataclasses.field(default_factory=dict)
    failing: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> last failure
    warned: bool = False
    first_snapshot_at: float | None = None  # monotonic
    protection: Unprotected | None = None
    progress: tuple[int, int] | None = None
    offered: tuple[int, int] = (-1, -1)
    refused: set[tuple[int, int, int]] = dataclasses.field(default_factory=set)
    last_restore: dict[str, Any] | None = None
    # Shards (rank, generation, step) that reached this store from a peer: still "peer" when
    # a rank opens them again after the fetch.
    fetched: set[tuple[int, int, int]] = dataclasses.field(default_factory=set)
    generation_started: int = -1


def _get(msg: dict[str, Any], key: str, kind: type, default: Any = ...) -> Any:
    value = msg.get(key, default)
    if value is ...:
        raise RequestError(f"request lacks {key!r}")
    if value is default and default is not ...:
        return value
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind or (kind is int and value < 0):
        raise RequestError(f"{key!r} must be a {'non-negative ' if kind is int else ''}"
                           f"{kind.__name__}, got {value!r:.60}")
    return value


def _mapped(msg: dict[str, Any]) -> set[tuple[int, int]]:
    """The ``mapped`` field of a reservation: (device, inode) pairs; anything else is ignored
    (the worker then simply gets a descriptor)."""
    value = msg.get("mapped")
    if not isinstance(value, list):
        return set()
    return {(p[0], p[1]) for p in value[:8] if isinstance(p, list) and len(p) == 2
            and all(type(v) is int for v in p)}


class CheckpointService:
    """Serves the checkpoint ops for one node.

    Args:
        store: the node's slot store (after :meth:`SlotStore.scan` on a restart).
        node_id: this node, for log lines.
        persist: the persistent tier's flusher, or None.
        metrics_sink: optional :class:`~elasticd.checkpoint.telemetry.CheckpointMetrics`.
        clock: injected time.
        pin_ttl: a read pin not released within this many seconds (its worker died) is dropped.
        replicator: the node's :class:`~elasticd.replication.replicator.Replicator`, or None
            (no peer replication: ``ckpt_committed`` says nothing is committed and
            ``ckpt_fetch`` finds only what this node holds).
        lag_limit: steps the committed step may lag the newest snapshot before the job counts
            as unprotected.
        grace: seconds after a job's first snapshot here before a missing placement or
            commit counts as unprotected.
    """

    def __init__(self, store: SlotStore, node_id: str, persist: Persister | None = None,
                 metrics_sink: Any = None, clock: Clock | None = None,
                 pin_ttl: float = 600.0, replicator: Any = None, lag_limit: int = 100,
                 grace: float = 10.0) -> None:
        self.store, self.node_id, self.persist = store, node_id, persist
        self.replicator = replicator
        self.lag_limit, self.grace = lag_limit, grace
        #: Called with each progress-like message (``register``, ``ckpt_reserve`` with a
        #: step): job, rank, world_size, [step], [restart], [local_rank], _peer.
        self.on_progress: list[Callable[[dict[str, Any]], None]] = []
        self.sink, self.clock, self.pin_ttl = metrics_sink, clock or SystemClock(), pin_ttl
        self._lock = threading.Lock()
        # One fetch per shard at a time: after a grow two local ranks may ask for the same old
        # rank's shard, and two transfers into one slot would tear it.
        self._fetching: collections.defaultdict[tuple[str, int], threading.Lock] = (
            collections.defaultdict(threading.Lock))
        self._jobs: dict[str, _Job] = {}
        self._pins: dict[int, tuple[Any, str, float]] = {}
        self._next_pin = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)
        #: Called with each restore report (after it is logged), e.g. to record an event.
        self.on_restore: list[Callable[[dict[str, Any]], None]] = []
        self._paused = ""  # why new snapshots are refused (a drain, a clean exit), or ""
        self._reserving = 0  # reservations between the pause check and their slot's record
        if persist is not None and persist.on_flushed is None:
            persist.on_flushed = self._on_flushed
        for job, rank, gen, step in store.holdings():  # adopted after a daemon restart
            record = self._job(job)
            record.progress = max(record.progress or (gen, step), (gen, step))

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """Op name → handler, for :class:`~elasticd.daemon.local_api.LocalServer`."""
        return {"ckpt_reserve": self._reserve, "ckpt_complete": self._complete,
                "ckpt_list": self._list, "ckpt_open": self._open,
                "ckpt_release": self._release, "ckpt_report": self._report,
                "ckpt_committed": self._committed, "ckpt_fetch": self._fetch,
                "register": self._register}

    def _job(self, job: str) -> _Job:
        record = self._jobs.get(job)
        if record is None:
            record = self._jobs[job] = _Job()
        return record

    def _emit(self, method: str, *args: Any) -> None:
        fn = getattr(self.sink, method, None)
        if fn is not None:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 — metrics must never fail a snapshot
                log.exception("checkpoint metrics sink %s failed", method)

    # -- snapshots ------------------------------------------------------------------------

    def _reserve(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank = _get(msg, "job", str), _get(msg, "rank", int)
        world, nbytes = _get(msg, "world_size", int), _get(msg, "nbytes", int)
        local_world = _get(msg, "local_world_size", int, None)
        if rank >= world:
            raise RequestError(f"rank {rank} outside world size {world}")
        uid = msg.get("_peer", {}).get("uid", msg.get("uid"))
        step, gen = _get(msg, "step", int, None), _get(msg, "generation", int, None)
        if step is not None:
            self._progress({"job": job, "rank": rank, "world_size": world, "step": step,
                            "_peer": msg.get("_peer")})
        self._sweep_pins()
        with self._lock:
            if step is not None and gen is not None:
                # The step is reached once its snapshot is asked for, taken or not: a rank
                # killed before the snapshot completes must still count it as lost.
                record = self._job(job)
                record.progress = max(record.progress or (gen, step), (gen, step))
            if self._paused:
                self.counters["skipped_paused"] += 1
                return {"skip": True, "reason": f"paused: {self._paused}"}
            self._reserving += 1
        try:
            reply = self._reserve_slot(job, rank, world, nbytes, local_world, uid,
                                       None if step is None or gen is None else (gen, step),
                                       _mapped(msg))
        finally:
            with self._lock:
                self._reserving -= 1
        warning = self.unprotected(job)
        return {**reply, "unprotected": warning} if warning else reply

    def _progress(self, msg: dict[str, Any]) -> None:
        for hook in self.on_progress:
            try:
                hook(msg)
            except Exception:  # noqa: BLE001 — a snapshot must not fail over a progress hook
                log.exception("progress hook failed")

    def _register(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A worker's Checkpointer says who it is (at its start and after each restore)."""
        job, rank = _get(msg, "job", str), _get(msg, "rank", int)
        world = _get(msg, "world_size", int)
        if rank >= world:
            raise RequestError(f"rank {rank} outside world size {world}")
        report = {"job": job, "rank": rank, "world_size": world, "_peer": msg.get("_peer")}
        for key in ("local_rank", "restart", "step"):
            value = _get(msg, key, int, None)
            if value is not None:
                report[key] = value
        self._progress(report)
        return {"node": self.node_id, "unprotected": self.unprotected(job) or None}

    def _reserve_slot(self, job: str, rank: int, world: int, nbytes: int,
                      local_world: int | None, uid: Any,
                      version: tuple[int, int] | None = None,
                      mapped: set[tuple[int, int]] = frozenset()) -> dict[str, Any]:
        with self._lock:
            record = self._job(job)
            if record.world_size != world:  # a new world: its local ranks are seen afresh
                record.world_size, record.ranks = world, set()
            record.ranks.add(rank)
            record.local_world_size, record.uid = local_world, uid if type(uid) is int else None
        try:
            slot = self.store.reserve(job, rank, nbytes)
        except OverBudget as exc:
            return self._skip(job, rank, "over_budget", str(exc))
        except CommitPending as exc:
            if self.replicator is not None:
                self.replicator.on_commit_pending(job, exc.version, skipped=version)
            return self._skip(job, rank, "commit_pending", str(exc))
        except SlotBusy as exc:
            return self._skip(job, rank, "busy", str(exc))
        except (ValueError, OSError) as exc:
            raise RequestError(f"cannot reserve a slot: {exc}") from exc
        try:
            identity, fd = self.store.handover(slot, mapped)
        except (StaleSlot, OSError) as exc:  # a newer reservation of this rank took it
            raise RequestError(f"cannot hand over the slot: {exc}") from exc
        with self._lock:
            record.slots[rank] = slot
            if record.failing.get(rank, "").startswith("over the memory cap"):
                record.failing.pop(rank, None)
        reply = {"path": slot.path, "capacity": slot.capacity, "ticket": slot.ticket,
                 "file": list(identity)}
        if fd is not None:
            reply["_fds"] = [fd]
        return reply

    def quiesce(self, timeout: float, why: str = "the node is draining") -> bool:
        """Refuses new snapshots (workers get ``skip``) and waits up to ``timeout`` seconds
        for those in flight to complete, so that workers stopped next leave a complete
        snapshot behind. Returns True when none is left in flight."""
        with self._lock:
            self._paused = why

        def busy() -> int:
            with self._lock:
                return self._reserving + sum(len(r.slots) for r in self._jobs.values())

        if self.clock.wait(lambda: not busy(), timeout, 0.02):
            return True
        log.warning("%d snapshots still in flight after %.1f s; going on", busy(), timeout)
        return False

    def resume(self) -> None:
        """Accepts snapshots again (after :meth:`quiesce`)."""
        with self._lock:
            self._paused = ""

    def _skip(self, job: str, rank: int, reason: str, detail: str) -> dict[str, Any]:
        with self._lock:
            record = self._job(job)
            self.counters[f"skipped_{reason}"] += 1
            if reason == "over_budget":
                record.failing[rank] = f"over the memory cap ({detail})"
                warn, record.warned = not record.warned, True
            else:
                warn = False
        if warn:
            log.warning("job %s on node %s: snapshot of rank %d skipped, over the memory cap "
                        "(%s); training continues without in-RAM checkpoints (further skips "
                        "of this job are counted, not logged)", job, self.node_id, rank, detail)
        else:
            log.debug("%s rank %d: snapshot skipped (%s): %s", job, rank, reason, detail)
        if reason == "over_budget":
            self.assess()  # failing snapshots count at once, not at the next daemon cycle
        self._emit("snapshot_skipped", job, reason)
        return {"skip": True, "reason": f"{reason}: {detail}"}

    def _complete(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank = _get(msg, "job", str), _get(msg, "rank", int)
        ticket, size = _get(msg, "ticket", int), _get(msg, "header_size", int)
        stall = _get(msg, "stall_seconds", float, 0.0)
        with self._lock:
            record = self._jobs.get(job)
            slot = None if record is None else record.slots.get(rank)
        if slot is None or slot.ticket != ticket:
            raise RequestError(f"{job} rank {rank}: ticket {ticket} is not the slot reserved")
        if not 0 < size <= slot.capacity - PREAMBLE_SIZE:
            raise RequestError(f"header_size {size} does not fit the slot")
        where = f"{job} rank {rank} (slot {slot.path})"
        try:
            raw = json.loads(bytes(slot.buffer[PREAMBLE_SIZE : PREAMBLE_SIZE + size]))
            header = _header_from_json(raw, PREAMBLE_SIZE + size, where)
            if header.world_size != record.world_size:
                raise RequestError(f"{where}: header says world size {header.world_size}, the "
                                   f"reservation {record.world_size}")
            sealed = self.store.complete(slot, dataclasses.replace(header, blocks=()))
        except (ValueError, SnapshotError, StaleSlot) as exc:  # JSONDecodeError is a ValueError
            with self._lock:
                record.failing[rank] = f"rank {rank}'s snapshot refused: {str(exc)[:200]}"
            raise RequestError(f"snapshot refused: {exc}") from exc
        version, nbytes = sealed.version(), sealed.layout.total_size
        with self._lock:
            record.slots.pop(rank, None)
            record.failing.pop(rank, None)
            if record.first_snapshot_at is None:
                record.first_snapshot_at = self.clock.monotonic()
            record.nbytes[rank] = nbytes
            record.progress = max(record.progress or version, version)
            self.counters["snapshots"] += 1
        self._emit("snapshot_completed", job, rank, sealed.step, nbytes, stall)
        self._replicate(job, rank, version)
        self._maybe_persist(job, record, version)
        return {"generation": sealed.generation, "step": sealed.step, "bytes": nbytes}

    def _replicate(self, job: str, rank: int, version: tuple[int, int]) -> None:
        if self.replicator is None:
            return
        try:
            self.replicator.on_local_snapshot(job, rank, version)
        except Exception:  # noqa: BLE001 — the snapshot is sealed; replication must not fail it
            self.counters["replicate_failed"] += 1
            log.exception("%s rank %d step %s: handing the snapshot to replication failed",
                          job, rank, version)

    def _maybe_persist(self, job: str, record: _Job, version: tuple[int, int]) -> None:
        if self.persist is None:
            return
        with self._lock:
            ranks = sorted(record.ranks)
            want = record.local_world_size or record.world_size
            if len(ranks) < want or version <= record.offered:
                return
            if not all(version in self.store.versions(job, r) for r in ranks):
                return
            record.offered = version
        if not self.persist.due(job, version[1]):
            return
        views = []
        for r in ranks:
            view = self.store.latest(job, r, pin=True, version=version)
            if view is None:  # overwritten meanwhile: a newer step will be offered
                for v in views:
                    v.release()
                return
            views.append(view)
        if not self.persist.submit(job, views, record.uid):
            log.debug("%s step %s not persisted: the writer is busy", job, version)

    def _on_flushed(self, flushed: Flushed) -> None:
        self._emit("persisted", flushed.job, flushed.version[1], flushed.seconds,
                   flushed.nbytes, not flushed.error)

    # -- restore --------------------------------------------------------------------------

    def _list(self, msg: dict[str, Any]) -> dict[str, Any]:
        job = _get(msg, "job", str)
        only = _get(msg, "rank", int, None)
        world = _get(msg, "world_size", int, None)
        ranks = sorted({r for j, r, _, _ in self.store.holdings() if j == job})
        with self._lock:
            record = self._jobs.get(job)
            refused = set() if record is None else set(record.refused)
            progress = None if record is None else record.progress
        ram: dict[str, list[list[int]]] = {}
        for r in ranks if only is None else [only]:
            held = []
            for version in self.store.versions(job, r):
                if (r, *version) in refused:
                    continue
                view = self.store.latest(job, r, version=version)
                if view is not None and (world is None or view.header.world_size == world):
                    held.append(list(version))
            ram[str(r)] = held
        persisted: list[list[int]] = []
        if self.persist is not None:
            try:
                persisted = [list(m.version()) for m in self.persist.steps(job)
                             if world is None or m.world_size == world]
            except OSError as exc:
                log.warning("cannot list the persistent tier for %s: %s", job, exc)
        return {"ram": ram, "persisted": persisted, "progress": progress and list(progress),
                "persist_root": self.persist.root if self.persist else None,
                "replicas": self._replicas(job, only)}

    def _replicas(self, job: str, only: int | None) -> dict[str, list[list[int]]]:
        """Versions of other nodes' shards this node holds as replicas (informational)."""
        sink = getattr(self.replicator, "sink", None)
        if sink is None:
            return {}
        try:
            ranks = sorted({d.owner_rank for d in sink.holdings() if d.job == job})
            return {str(r): [list(v) for v in sink.versions(job, r)]
                    for r in ranks if only is None or r == only}
        except Exception as exc:  # noqa: BLE001 — a listing must not fail over replicas
            log.warning("cannot list the replicas of %s held here: %s", job, exc)
            return {}

    def _open(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank = _get(msg, "job", str), _get(msg, "rank", int)
        version = (_get(msg, "generation", int), _get(msg, "step", int))
        self._sweep_pins()
        try:
            view = self.store.latest(job, rank, pin=True, verify=True, version=version)
        except SnapshotError as exc:
            with self._lock:
                self._job(job).refused.add((rank, *version))
                self.counters["refused"] += 1
            log.error("REFUSED corrupt snapshot of %s rank %d step %s on node %s: %s", job,
                      rank, version, self.node_id, exc)
            self._emit("snapshot_refused", job, "local")
            raise RequestError(f"refused: {exc}") from exc
        if view is None:
            raise RequestError(f"{job} rank {rank} step {version} is not held here")
        try:
            fd = view.descriptor()
        except OSError as exc:
            view.release()
            raise RequestError(f"cannot hand over {job} rank {rank} step {version}: "
                               f"{exc}") from exc
        with self._lock:
            self._next_pin += 1
            pin = self._next_pin
            self._pins[pin] = (view, job, self.clock.monotonic())
            record = self._jobs.get(job)
            # A shard an earlier (aborted) restore round fetched from a peer is in the local
            # store now, but it still came from the peer: say so, or recoveries get mislabelled.
            fetched = record is not None and (rank, *version) in record.fetched
        return {"path": view.path, "offset": 0, "size": view.header.layout.total_size,
                "pin": pin, "source": "peer" if fetched else "local", "_fds": [fd]}

    def _committed(self, msg: dict[str, Any]) -> dict[str, Any]:
        job = _get(msg, "job", str)
        if self.replicator is None:
            return {"committed": None}
        try:
            committed = self.replicator.committed(job)
        except Exception as exc:  # noqa: BLE001 — etcd trouble: workers restore from what is local
            log.warning("cannot read the committed step of %s: %s", job, exc)
            return {"committed": None}
        if committed is None:
            return {"committed": None}
        return {"generation": committed.generation, "step": committed.step,
                "ranks": sorted(committed.ranks)}

    def _fetch(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank = _get(msg, "job", str), _get(msg, "rank", int)
        with self._lock:
            shard_lock = self._fetching[(job, rank)]
        with shard_lock:
            return self._fetch_one(job, rank, msg)

    def _fetch_one(self, job: str, rank: int, msg: dict[str, Any]) -> dict[str, Any]:
        version = (_get(msg, "generation", int), _get(msg, "step", int))
        key = (rank, *version)
        with self._lock:
            record = self._jobs.get(job)
            refused = record is not None and key in record.refused
            was_fetched = record is not None and key in record.fetched
        source, wire_bytes, holder = "local", 0, self.node_id
        try:
            held = version in self.store.versions(job, rank)
        except ValueError as exc:  # a job name the store cannot hold
            raise RequestError(str(exc)) from exc
        if refused or not held:
            if self.replicator is None:
                return {"lost": True, "reason": "not held here and no peer replication"}
            try:
                result = self.replicator.fetch_to_local(job, rank, version)
            except ShardLost as exc:
                return {"lost": True, "reason": str(exc)[:500]}
            except (SlotStoreError, SnapshotError, ValueError, OSError) as exc:  # no room, or torn
                raise RequestError(f"cannot fetch {job} rank {rank} step {version} here: "
                                   f"{exc}") from exc
            with self._lock:
                record = self._job(job)
                record.refused.discard(key)  # the bad copy was replaced by a verified one
                record.fetched.add(key)
                self.counters["fetches"] += 1
            source, wire_bytes, holder = "peer", int(result.wire_bytes), result.holder
            log.info("%s rank %d step %s fetched from %s into node %s (%d bytes on the wire)",
                     job, rank, version, holder, self.node_id, wire_bytes)
        elif was_fetched:
            source = "peer"
        reply = self._open({"job": job, "rank": rank, "generation": version[0],
                            "step": version[1], "_peer": msg.get("_peer", {})})
        return {**reply, "source": source, "wire_bytes": wire_bytes, "holder": holder}

    def _release(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            entry = self._pins.pop(_get(msg, "pin", int), None)
        if entry is not None:
            entry[0].release()
        return {}

    def _sweep_pins(self) -> None:
        now = self.clock.monotonic()
        with self._lock:
            old = [p for p, (_, _, t) in self._pins.items() if now - t > self.pin_ttl]
            views = [self._pins.pop(p)[0] for p in old]
        for view in views:
            view.release()

    def _report(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank, source = _get(msg, "job", str), _get(msg, "rank", int), msg.get("source")
        if source not in RESTORE_SOURCES:
            raise RequestError(f"source must be one of {RESTORE_SOURCES}, got {source!r:.40}")
        seconds, lost = _get(msg, "seconds", float), _get(msg, "steps_lost", int)
        nbytes = _get(msg, "bytes", int)
        refused = [str(r)[:500] for r in msg.get("refused", []) if isinstance(r, str)][:16]
        entry = {"job": job, "rank": rank, "source": source, "seconds": seconds,
                 "steps_lost": lost, "bytes": nbytes, "generation": msg.get("generation"),
                 "step": msg.get("step"), "refused": refused, "at": self.clock.wall()}
        start_gen = _get(msg, "next_generation", int, None)
        with self._lock:
            record = self._job(job)
            record.last_restore = entry
            self.history.append(entry)
            self.counters[f"restores_{source}"] += 1
            if start_gen is not None and start_gen > record.generation_started:
                record.generation_started = start_gen
            else:
                start_gen = None  # another local rank already told the replicator
        if start_gen is not None and self.replicator is not None:
            try:
                self.replicator.start_generation(job, start_gen)
            except Exception:  # noqa: BLE001 — a report must not fail over replication
                log.exception("%s: starting generation %d in replication failed", job,
                              start_gen)
        log.info("%s rank %d restored from %s: step %s, %.3f s, %d bytes, %d steps lost%s",
                 job, rank, source, entry["step"], seconds, nbytes, lost,
                 f"; refused: {'; '.join(refused)}" if refused else "")
        for reason in refused:
            if reason.startswith("persistent"):
                self._emit("snapshot_refused", job, "persistent")
        self._emit("restored", job, source, seconds, lost, nbytes)
        for hook in self.on_restore:
            try:
                hook(entry)
            except Exception:  # noqa: BLE001 — a report must not fail over a hook
                log.exception("restore hook failed")
        return {}

    # -- housekeeping and status ----------------------------------------------------------

    def remove_job(self, job: str) -> None:
        """Drops the job's slots, pins and records (its persisted steps stay)."""
        with self._lock:
            self._jobs.pop(job, None)
            views = [self._pins.pop(p)[0] for p, (_, j, _) in list(self._pins.items())
                     if j == job]
        for view in views:
            view.release()
        self.store.remove_job(job)

    def unprotected(self, job: str | None) -> str:
        """``UNPROTECTED: <detail>`` while ``job`` is unprotected on this node, else ""."""
        with self._lock:
            record = self._jobs.get(job) if job is not None else None
            verdict = None if record is None else record.protection
        return str(verdict) if verdict is not None else ""

    def assess(self) -> None:
        """Re-assesses every job's protection (once per daemon cycle); logs each change."""
        try:
            replication = self.replicator.status()["jobs"] if self.replicator else {}
        except Exception:  # noqa: BLE001 — status must not fail over replication
            log.exception("cannot read the replication status")
            replication = {}
        now = self.clock.monotonic()
        changes = []
        with self._lock:
            for job, record in self._jobs.items():
                rep = replication.get(job) or {}
                committed = rep.get("committed")
                view = JobView(
                    failing=next(iter(record.failing.values()), ""), newest=record.progress,
                    replicated=self.replicator is not None,
                    placement=bool(rep.get("placement")),
                    committed=tuple(committed) if committed else None,
                    lag=int(rep.get("sync_lag") or 0),
                    seconds=0.0 if record.first_snapshot_at is None
                    else now - record.first_snapshot_at)
                verdict = assess(view, self.lag_limit, self.grace)
                old = record.protection
                if (verdict and verdict.reason) != (old and old.reason):
                    changes.append((job, old, verdict))  # logged once per change of reason
                record.protection = verdict
        for job, old, new in changes:
            if new is not None:
                log.warning("job %s is %s (node %s)", job, new, self.node_id)
            else:
                log.warning("job %s is protected again on node %s (was: %s)", job,
                            self.node_id, old.detail if old else "")

    def status(self) -> dict[str, Any]:
        """Per job: each rank's latest (generation, step) held, bytes held, unprotected flag,
        reason (a metrics label) and detail, newest persisted step, progress and the last
        restore (protection re-assessed first)."""
        self.assess()
        out: dict[str, Any] = {}
        holdings = self.store.holdings()
        with self._lock:
            for job, record in sorted(self._jobs.items()):
                ranks = {str(r): [g, s] for j, r, g, s in holdings if j == job}
                persisted = self.persist.persisted(job) if self.persist else None
                out[job] = {
                    "ranks": ranks,
                    "bytes": sum(record.nbytes.get(int(r), 0) for r in ranks),
                    "unprotected": record.protection is not None,
                    "unprotected_reason": record.protection.detail if record.protection else "",
                    "unprotected_kind": record.protection.reason if record.protection else "",
                    "persisted": persisted and list(persisted),
                    "progress": record.progress and list(record.progress),
                    "last_restore": record.last_restore,
                }
        return out

    def stats(self) -> dict[str, Any]:
        """Plain numbers for the daemon's metrics (:mod:`elasticd.metrics` reads them at
        scrape time)."""
        status = self.status()
        with self._lock:
            counters = dict(self.counters)
        steps = [s for job in status.values() for _, s in job["ranks"].values()]
        persist = self.persist.stats() if self.persist else {}
        return {
            "snapshots_total": counters.get("snapshots", 0),
            "snapshot_bytes": sum(job["bytes"] for job in status.values()),
            "snapshot_step": min(steps) if steps else -1,
            "replica_bytes_held": self.store.bytes_held(),
            "skipped_over_budget_total": counters.get("skipped_over_budget", 0),
            "skipped_busy_total": counters.get("skipped_busy", 0),
            "skipped_commit_pending_total": counters.get("skipped_commit_pending", 0),
            "refused_total": counters.get("refused", 0),
            "unprotected_jobs": {reason: sum(job["unprotected_kind"] == reason
                                             for job in status.values())
                                 for reason in REASONS},
            "restores_total": {s: counters.get(f"restores_{s}", 0) for s in RESTORE_SOURCES},
            "persisted_step": max((j["persisted"][1] for j in status.values()
                                   if j["persisted"]), default=-1),
            "persist_seconds_last": persist.get("last_seconds", 0.0),
            "persists_total": persist.get("flushed", 0),
            "persists_failed_total": persist.get("failed", 0),
            "persists_skipped_total": persist.get("skipped_busy", 0),
        }
