"""The restore side of the checkpoint service, a part :class:`~elasticd.store.service.
CheckpointService` owns: it shares the service's job records (:class:`~elasticd.store.
service_records.JobBook`) and read pins (:class:`~elasticd.store.read_pins.ReadPins`, which its
replies hold until ``ckpt_release`` or ``pin_ttl``), and nothing else of it.

* ``ckpt_list`` job, [rank], [world_size] → ram {rank: [[gen, step], ...]}, persisted,
  persisted_worlds [[gen, step, world size], ...] (any world size: a shrink reshards from it)
  [[gen, step], ...], persist_root, progress [gen, step] | null, replicas {rank: [[gen, step],
  ...]} (copies of other nodes' shards held here; empty without a replicator)
  With [previous_rank, previous_world_size] (a survivor of an in-process re-formation) also
  own [[gen, step], ...]: that rank's snapshots at that world size held here; with [committed]
  true also committed_step (what ``ckpt_committed`` answers): a restore's discovery in one
  call, not three to a daemon busy with the failure.
* ``ckpt_open`` job, rank, generation, step → path, offset, size, pin, and the slot's
  descriptor (read-only)
* ``ckpt_fetch`` job, rank, generation, step, [need] → path, offset, size, pin (as
  ``ckpt_open``), source "local" | "peer", wire_bytes, holder, [partial] | lost: true, reason.
  Makes a shard (possibly of another node's rank, after that node died) available in this
  node's store, fetching it from the peers that hold copies when it is not here. With
  ``need`` ([[global shape, placements, offsets, local shape], ...], a new rank's local boxes
  after a change of world size, :mod:`elasticd.recovery.ranges`) a shard not held here is
  fetched only in the blocks holding rows those boxes overlap, into a scratch segment that is
  not a snapshot of the store (``partial``: only those rows are valid), deleted at
  ``ckpt_release``. Scratch is bounded (:mod:`elasticd.store.scratch`): one live partial
  copy per (job, rank) and caller (asking again gives the earlier one back first), and a
  per-job byte cap, over which the fetch is refused with one line, counted
  (``elasticd_scratch_refused_total``) and shown in ``/status`` (``scratch``).
* ``ckpt_sessions`` job, rank, old_rank, generation, step, [seconds] → sessions [{holder,
  ticket}], and a descriptor each: replication sessions scoped to the job, to every remote
  holder of old rank ``old_rank``'s snapshot at that step that describes it, handed to the
  worker (:mod:`elasticd.replication.handed`: it fetches its own rows over them, never holding
  the secret). One live set per (job, rank, old rank): asking again cuts the last set off, as
  do its deadline (``seconds``, at most 1800), an undelivered reply and the job leaving
  (:mod:`elasticd.store.handed_sessions`). When this node holds that copy itself the
  answer is local: true and no sessions (the worker reads it in place through
  ``ckpt_fetch``); when this node cannot hand sessions over at all (no peer replication, or
  replication over TLS) it is unsupported: true, reason, and no sessions. Called by a
  worker's direct fetch (:mod:`elasticd.worker.direct`).
* ``ckpt_sessions_done`` job, rank, old_ranks [int, ...] → ended: the number of sessions
  cut off: the worker's fetch over them is over, so the live sets of (job, rank, each old
  rank) end now rather than at their deadline.
* ``ckpt_release`` pin → {}
* ``ckpt_committed`` job → generation, step, ranks | committed: null (no replicator, nothing
  committed yet, or etcd unreadable)
* ``ckpt_report`` job, rank, source, seconds, steps_lost, bytes, generation, step, [refused],
  [next_generation], [path], [direct {wire_bytes, routed_bytes, old_ranks, remote_ranks}:
  the worker fetched a reshard's rows itself] → {}
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from typing import Any, Callable

from elasticd.store.api import ScratchOverCap, SlotStoreError
from elasticd.store.scratch_pool import prefill
from elasticd.snapshot.format import SnapshotError, dtensors_only
from elasticd.hooks import call_hooks
from elasticd.store.handed_sessions import MAX_SESSION_SECONDS, SESSION_SECONDS, HandedSessions
from elasticd.store.read_pins import ReadPins
from elasticd.store.service_records import JobBook, ServiceDeps, emit, param
from elasticd.store.telemetry import RESTORE_PATHS, RESTORE_SOURCES
from elasticd.local.wire import RequestError
from elasticd.errors import ShardLost

log = logging.getLogger(__name__)

#: Old ranks one ``ckpt_sessions_done`` may name: a reshard needs a few per new rank (a
#: shrink from 1,000 ranks to 10: ~101), far from this.
MAX_DONE_RANKS = 4096


class Restores:
    """The restore-side ops of :class:`~elasticd.store.service.CheckpointService`.

    Args:
        book: the service's job records and counters (its snapshot side shares them).
        on_restore: hooks called with each restore report (after it is logged).
    """

    def __init__(self, book: JobBook, pins: ReadPins, deps: ServiceDeps,
                 on_restore: list[Callable[[dict[str, Any]], None]]) -> None:
        self._book, self._pins, self._sink = book, pins, deps.sink
        self.store, self.persist, self.replicator = deps.store, deps.persist, deps.replicator
        self.node_id, self.clock = deps.node_id, deps.clock
        self.on_restore = on_restore
        # One fetch per shard at a time: after a grow two local ranks may ask for the same old
        # rank's shard, and two transfers into one slot would tear it.
        self._fetching: collections.defaultdict[tuple[str, int], Any] = (
            collections.defaultdict(threading.Lock))
        #: Sessions handed to workers (``ckpt_sessions``), kept to be cut off.
        self.handed = HandedSessions(self.clock)

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """Op name -> handler, for the restore side's ops."""
        return {"ckpt_list": self.ckpt_list, "ckpt_open": self.ckpt_open,
                "ckpt_release": self.ckpt_release, "ckpt_report": self.ckpt_report,
                "ckpt_committed": self.ckpt_committed, "ckpt_fetch": self.ckpt_fetch,
                "ckpt_sessions": self.ckpt_sessions,
                "ckpt_sessions_done": self.ckpt_sessions_done}

    def ckpt_list(self, msg: dict[str, Any]) -> dict[str, Any]:
        job = param(msg, "job", str)
        only = param(msg, "rank", int, None)
        world = param(msg, "world_size", int, None)
        ranks = sorted({r for j, r, _, _ in self.store.holdings() if j == job})
        with self._book.lock:
            record = self._book.jobs.get(job)
            refused = set() if record is None else set(record.refused)
            progress = None if record is None else record.progress

        def held(r: int, at: int | None) -> list[list[int]]:
            # The newest pair too (an in-process job's: store/shm.py), which only this node's
            # restores read: a survivor's own shard of the last step it completed.
            out = []
            for v in self.store.versions(job, r, newest=True):
                view = None if (r, *v) in refused else self.store.latest(
                    job, r, version=v, newest=True)
                if view is not None and (at is None or view.header.world_size == at):
                    out.append(list(v))
            return out

        ram = {str(r): held(r, world) for r in (ranks if only is None else [only])}
        extra: dict[str, Any] = {}
        was = param(msg, "previous_rank", int, None), param(msg, "previous_world_size", int, None)
        if None not in was:
            extra["own"] = held(*was)
        if msg.get("committed") is True:
            extra["committed_step"] = self.ckpt_committed({"job": job})
        persisted: list[list[int]] = []
        saved_by: list[list[int]] = []  # [generation, step, world size], every world size
        if self.persist is not None:
            try:
                steps = self.persist.steps(job)
                persisted = [list(m.version()) for m in steps
                             if world is None or m.world_size == world]
                saved_by = [[*m.version(), m.world_size] for m in steps]
            except OSError as exc:
                log.warning("cannot list the persistent tier for %s: %s", job, exc)
        return {"ram": ram, "persisted": persisted, "persisted_worlds": saved_by,
                "progress": progress and list(progress),
                "persist_root": self.persist.root if self.persist else None,
                "replicas": self._replicas(job, only), **extra}

    def _replicas(self, job: str, only: int | None) -> dict[str, list[list[int]]]:
        """Versions of other nodes' shards this node holds as replicas (informational)."""
        sink = self.replicator.sink if self.replicator is not None else None
        if sink is None:
            return {}
        try:
            ranks = sorted({d.owner_rank for d in sink.holdings() if d.job == job})
            return {str(r): [list(v) for v in sink.versions(job, r)]
                    for r in ranks if only is None or r == only}
        except Exception as exc:  # noqa: BLE001 — a listing must not fail over replicas
            log.warning("cannot list the replicas of %s held here: %s", job, exc)
            return {}

    def ckpt_open(self, msg: dict[str, Any], verify: bool = True) -> dict[str, Any]:
        """``ckpt_open``: hands the worker a read-only descriptor of the held snapshot, its
        payload checked again first (RAM can rot between the snapshot and the restore), but
        not when this request has just fetched and checked it (``verify`` False)."""
        job, rank = param(msg, "job", str), param(msg, "rank", int)
        version = (param(msg, "generation", int), param(msg, "step", int))
        self._pins.sweep()
        try:
            view = self.store.latest(job, rank, pin=True, verify=verify, version=version,
                                     newest=True)
        except SnapshotError as exc:
            with self._book.lock:
                self._book.jobs[job].refused.add((rank, *version))
                self._book.counters["refused"] += 1
            log.error("REFUSED corrupt snapshot of %s rank %d step %s on node %s: %s", job,
                      rank, version, self.node_id, exc)
            emit(self._sink, "snapshot_refused", job, "local")
            raise RequestError(f"refused: {exc}") from exc
        if view is None:
            raise RequestError(f"{job} rank {rank} step {version} is not held here")
        pin, fd = self._pins.hold(view.descriptor, view.release, job,
                                  f"{job} rank {rank} step {version}")
        with self._book.lock:
            record = self._book.jobs.get(job)
            # A shard an earlier (aborted) restore round fetched from a peer is in the local
            # store now, but it still came from the peer: say so, or recoveries get mislabelled.
            fetched = record is not None and (rank, *version) in record.fetched
        return {"path": view.path, "offset": 0, "size": view.header.layout.total_size,
                "pin": pin, "source": "peer" if fetched else "local", "_fds": [fd]}

    def ckpt_committed(self, msg: dict[str, Any]) -> dict[str, Any]:
        job = param(msg, "job", str)
        try:
            committed = self.replicator.committed(job) if self.replicator is not None else None
        except Exception as exc:  # noqa: BLE001 — etcd trouble: workers restore from what is local
            log.warning("cannot read the committed step of %s: %s", job, exc)
            committed = None
        if committed is None:
            return {"committed": None}
        return {"generation": committed.generation, "step": committed.step,
                "ranks": sorted(committed.ranks)}

    def ckpt_fetch(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank = param(msg, "job", str), param(msg, "rank", int)
        with self._book.lock:
            shard_lock = self._fetching[(job, rank)]
        with shard_lock:
            return self._fetch_one(job, rank, msg)

    def _fetch_one(self, job: str, rank: int, msg: dict[str, Any]) -> dict[str, Any]:
        version = (param(msg, "generation", int), param(msg, "step", int))
        key = (rank, *version)
        with self._book.lock:
            record = self._book.jobs.get(job)
            refused = record is not None and key in record.refused
            was_fetched = record is not None and key in record.fetched
        source, wire_bytes, holder, just_fetched = "local", 0, self.node_id, False
        try:
            held = version in self.store.versions(job, rank, newest=True)
        except ValueError as exc:  # a job name the store cannot hold
            raise RequestError(str(exc)) from exc
        if refused or not held:
            if self.replicator is None:
                return {"lost": True, "reason": "not held here and no peer replication"}
            caller = (job, rank, (msg.get("_peer") or {}).get("pid"))
            if msg.get("need") is not None:  # one live partial copy per (job, rank) and caller
                self._pins.release_scratch(caller)
            replica = self._open_replica(job, rank, version)
            if replica is not None:
                return replica
            try:
                result = self.replicator.fetch_to_local(job, rank, version,
                                                        need=msg.get("need"))
            except ShardLost as exc:
                return {"lost": True, "reason": str(exc)[:500]}
            except (SlotStoreError, SnapshotError, ValueError, OSError) as exc:  # no room, or torn
                if isinstance(exc, ScratchOverCap):
                    self._scratch_refused(job, exc)
                raise RequestError(f"cannot fetch {job} rank {rank} step {version} here: "
                                   f"{exc}") from exc
            scratch = result.scratch
            with self._book.lock:
                record = self._book.jobs[job]
                self._book.counters["fetches"] += 1
                if scratch is None:
                    record.refused.discard(key)  # the bad copy was replaced by a verified one
                    record.fetched.add(key)
            if scratch is not None:
                log.info("%s rank %d step %s: the rows a new rank needs fetched from %s into "
                         "node %s (%d bytes on the wire)", job, rank, version, result.holder,
                         self.node_id, int(result.wire_bytes))
                return self._hand_scratch(caller, scratch, result)
            source, wire_bytes, holder = "peer", int(result.wire_bytes), result.holder
            just_fetched = True
            log.info("%s rank %d step %s fetched from %s into node %s (%d bytes on the wire)",
                     job, rank, version, holder, self.node_id, wire_bytes)
        elif was_fetched:
            source = "peer"
        reply = self.ckpt_open({"job": job, "rank": rank, "generation": version[0],
                            "step": version[1], "_peer": msg.get("_peer", {})},
                           verify=not just_fetched)
        return {**reply, "source": source, "wire_bytes": wire_bytes, "holder": holder}

    def ckpt_sessions(self, msg: dict[str, Any]) -> dict[str, Any]:
        """``ckpt_sessions`` (see the module docstring)."""
        job, rank = param(msg, "job", str), param(msg, "rank", int)
        old, version = param(msg, "old_rank", int), (param(msg, "generation", int),
                                                     param(msg, "step", int))
        seconds = msg.get("seconds", SESSION_SECONDS)
        if type(seconds) not in (int, float) or not 0 < seconds <= MAX_SESSION_SECONDS:
            raise RequestError(f"seconds must be a number in (0, {MAX_SESSION_SECONDS:g}], "
                               f"got {seconds!r:.40}")
        key = (job, rank, old)
        self.handed.cut_off(key)  # the set asked for before ends first
        if self._held_here(job, old, version):  # read in place (ckpt_fetch): no wire at all
            return {"job": job, "rank": rank, "old_rank": old, "sessions": [], "local": True}
        if not self._hands_sessions():  # how this node is set up, not a failure
            return {"job": job, "rank": rank, "old_rank": old, "sessions": [],
                    "unsupported": True,
                    "reason": "no peer replication on this node" if self.replicator is None
                    else "replication runs over TLS here: its sessions cannot be handed over"}
        try:
            handed = self.replicator.hand_sessions(job, old, version)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        self.handed.give(key, [client for _, client, _, _ in handed], float(seconds))
        log.info("%s rank %d: %d session(s) to the holders of old rank %d step %s handed "
                 "over", job, rank, len(handed), old, version)
        return {"job": job, "rank": rank, "old_rank": old,
                "sessions": [{"holder": h, "ticket": t.to_json()} for h, _, _, t in handed],
                "_fds": [fd for _, _, fd, _ in handed]}

    def ckpt_sessions_done(self, msg: dict[str, Any]) -> dict[str, Any]:
        """``ckpt_sessions_done`` (see the module docstring)."""
        job, rank = param(msg, "job", str), param(msg, "rank", int)
        old = msg.get("old_ranks")
        if (not isinstance(old, list) or len(old) > MAX_DONE_RANKS
                or not all(type(q) is int for q in old)):
            raise RequestError(f"old_ranks must be a list of at most {MAX_DONE_RANKS} ranks, "
                               f"got {old!r:.40}")
        ended = sum(self.handed.cut_off((job, rank, q)) for q in set(old))
        if ended:
            log.info("%s rank %d: the sessions handed over for old ranks %s ended: its fetch "
                     "is done (%d)", job, rank, sorted(set(old))[:8], ended)
        return {"ended": ended}

    def _held_here(self, job: str, rank: int, version: tuple[int, int]) -> bool:
        """Whether this node holds ``rank``'s ``version`` (its store or a replica), not
        refused: a restore reads it in place through ``ckpt_fetch``."""
        with self._book.lock:
            record = self._book.jobs.get(job)
            if record is not None and (rank, *version) in record.refused:
                return False
        try:
            if version in self.store.versions(job, rank, newest=True):
                return True
        except ValueError as exc:  # a job name the store cannot hold
            raise RequestError(str(exc)) from exc
        replicas = getattr(self.replicator.sink if self.replicator else None, "store", None)
        return replicas is not None and version in replicas.versions(job, rank)

    def _open_replica(self, job: str, rank: int,
                      version: tuple[int, int]) -> dict[str, Any] | None:
        """The reply for a shard this node holds as a replica of another node's (the dead
        node's rank, now hosted here): its slot handed over read-only and pinned, as
        ``ckpt_open`` hands a local one (checked first, for rot in RAM), rather than copied
        into the local store or a scratch segment first; None when it is not held here."""
        sink = self.replicator.sink if self.replicator is not None else None
        # Only a shared-memory sink (ShmSink) keeps its copies in slots that can be handed over.
        store = getattr(sink, "store", None)
        if store is None:
            return None
        try:
            view = store.latest(job, rank, pin=True, verify=True, version=version)
        except (SnapshotError, ValueError) as exc:
            log.error("REFUSED the replica of %s rank %d step %s on node %s: %s", job, rank,
                      version, self.node_id, exc)
            return None
        if view is None:
            return None
        pin, fd = self._pins.hold(view.descriptor, view.release, job,
                                  f"the replica of {job} rank {rank} step {version}")
        return {"path": view.path, "offset": 0, "size": view.header.layout.total_size,
                "pin": pin, "source": "peer", "wire_bytes": 0, "holder": self.node_id,
                "_fds": [fd]}

    def _hand_scratch(self, caller: tuple[str, int, Any], scratch: Any,
                      result: Any) -> dict[str, Any]:
        """The reply for a partial copy (``ckpt_fetch`` with ``need``, see the module
        docstring) to ``caller`` (job, rank, pid)."""
        pin, fd = self._pins.hold(functools.partial(scratch.descriptor, writable=False),
                                  functools.partial(self.store.scratch.drop, scratch), caller[0],
                                  "a partial copy", caller)
        return {"path": scratch.path, "offset": 0, "size": result.descriptor.total_bytes,
                "pin": pin, "source": "peer", "partial": True,
                "wire_bytes": int(result.wire_bytes), "holder": result.holder, "_fds": [fd]}

    def membership_changed(self, job: str) -> int:
        """A node that runs ``job`` failed (the daemon's loop saw its lease go): this node's
        workers restore soon, after the rendezvous, and a restore at another world size lands
        the rows a new rank needs of other old ranks' snapshots in scratch. Sets scratch aside
        now, one segment the size of each snapshot of ``job`` this node holds (a new rank's
        partial copies are about an old shard's size), its pages touched behind the
        detection and the rendezvous (:func:`~elasticd.store.scratch_pool.prefill`). It
        counts against the job's scratch cap (``scratch_cap_mib``) and the node's like any
        scratch from now on (what does not fit is not set aside), and goes unused after
        ``scratch_pool.KEEP_SECONDS``. Returns the bytes set aside."""
        sizes, direct = [], True
        for held_job, rank, _, _ in self.store.holdings():
            view = self.store.latest(held_job, rank) if held_job == job else None
            if view is not None:
                sizes.append(view.header.layout.total_size)
                direct = direct and dtensors_only(view.header.meta)
        if sizes and direct and self._hands_sessions():
            # Its workers fetch a reshard's rows themselves (worker/direct.py) into their own
            # tensors and staging: scratch set aside would only take RAM and CPU from the
            # recovery. (A worker with ELASTICD_DIRECT_FETCH=0 lands in fresh scratch.)
            log.info("%s: no restore scratch set aside: its workers fetch a reshard's rows "
                     "themselves", job)
            return 0
        return prefill(self.store, job, sizes) if sizes else 0

    def _hands_sessions(self) -> bool:
        """Whether ``ckpt_sessions`` can hand sessions over here (replication without TLS)."""
        connections = getattr(self.replicator, "connections", None)
        return connections is not None and connections.ssl_context is None

    def undelivered(self, op: str, reply: dict[str, Any]) -> None:
        """The local API could not send ``reply`` to ``op`` (its worker went away while the
        request ran: a restore round aborted during a fetch from a frozen holder): the read
        pin it carried is released now. Held until ``pin_ttl``, it kept the rank's other slot
        from being reused, so every other snapshot of that rank was skipped and commits
        stalled (the frozen-holder chaos test lost 29 steps at the next restore)."""
        pin = reply.get("pin")
        if op == "ckpt_sessions":  # nobody took the sessions: they end now
            self.handed.cut_off((reply.get("job"), reply.get("rank"), reply.get("old_rank")))
        if op in ("ckpt_open", "ckpt_fetch") and isinstance(pin, int):
            self._pins.release(pin)
            log.info("the reply to %s was not delivered (its caller is gone): read pin %d of %s "
                     "released", op, pin, reply.get("path", "?"))

    def ckpt_release(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._pins.release(param(msg, "pin", int))
        return {}

    def _scratch_refused(self, job: str, exc: ScratchOverCap) -> None:
        """A partial copy refused over ``job``'s scratch cap: counted; logged the first time
        and every 100th (a worker that loops must not flood the log)."""
        with self._book.lock:
            record = self._book.jobs[job]
            record.scratch_refused += 1
            self._book.counters["scratch_refused"] += 1
            count = record.scratch_refused
        if count % 100 == 1:
            log.error("REFUSED restore scratch on node %s (%d so far for %s): %s", self.node_id,
                      count, job, exc)
        emit(self._sink, "scratch_refused", job)

    def ckpt_report(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank, source = param(msg, "job", str), param(msg, "rank", int), msg.get("source")
        if source not in RESTORE_SOURCES:
            raise RequestError(f"source must be one of {RESTORE_SOURCES}, got {source!r:.40}")
        seconds, lost = param(msg, "seconds", float), param(msg, "steps_lost", int)
        nbytes = param(msg, "bytes", int)
        path = msg.get("path")  # absent from an older worker's report
        if path not in (None, *RESTORE_PATHS):
            raise RequestError(f"path must be one of {RESTORE_PATHS}, got {path!r:.40}")
        refused = [str(r)[:500] for r in msg.get("refused", []) if isinstance(r, str)][:16]
        direct = _direct_figures(msg.get("direct"))
        entry = {"job": job, "rank": rank, "source": source, "seconds": seconds,
                 "steps_lost": lost, "bytes": nbytes, "generation": msg.get("generation"),
                 "step": msg.get("step"), "refused": refused, "at": self.clock.wall(),
                 "path": path, "direct": direct}
        start_gen = param(msg, "next_generation", int, None)
        with self._book.lock:
            record = self._book.jobs[job]
            record.last_restore = entry
            self._book.counters[f"restores_{source}"] += 1
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
        log.info("%s rank %d%s restored from %s: step %s, %.3f s, %d bytes, %d steps lost%s",
                 job, rank, " (kept in-process)" if path == "in_process" else "", source,
                 entry["step"], seconds, nbytes, lost,
                 f"; refused: {'; '.join(refused)}" if refused else "")
        for reason in refused:
            if reason.startswith("persistent"):
                emit(self._sink, "snapshot_refused", job, "persistent")
            if reason.startswith("direct fetch"):
                emit(self._sink, "direct_fell_back", job)
        if direct is not None:
            log.info("%s rank %d fetched its rows itself from %d old ranks' holders: %d bytes "
                     "on the wire, %d straight into its tensors", job, rank,
                     direct["remote_ranks"], direct["wire_bytes"], direct["routed_bytes"])
            emit(self._sink, "direct_fetched", job, direct["wire_bytes"], direct["routed_bytes"])
        emit(self._sink, "restored", job, source, seconds, lost, nbytes)
        call_hooks(self.on_restore, entry, log=log, failed="restore hook failed")
        return {}


def _direct_figures(value: Any) -> dict[str, int] | None:
    """A report's ``direct`` field (a worker's own fetch, :mod:`elasticd.worker.direct`):
    its counts, each a non-negative int; None when absent or malformed."""
    keys = ("wire_bytes", "routed_bytes", "old_ranks", "remote_ranks")
    if not isinstance(value, dict) or not all(type(value.get(k)) is int and value[k] >= 0
                                              for k in keys):
        return None
    return {k: value[k] for k in keys}
