"""The restore side of the checkpoint service (a mixin of
:class:`~elasticd.store.service.CheckpointService`, whose state it shares), and the read
pins its replies hold until ``ckpt_release`` or ``pin_ttl``.

* ``ckpt_list`` job, [rank], [world_size] → ram {rank: [[gen, step], ...]}, persisted,
  persisted_worlds [[gen, step, world size], ...] (any world size: a shrink reshards from it)
  [[gen, step], ...], persist_root, progress [gen, step] | null, replicas {rank: [[gen, step],
  ...]} (copies of other nodes' shards held here; empty without a replicator)
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
* ``ckpt_release`` pin → {}
* ``ckpt_committed`` job → generation, step, ranks | committed: null (no replicator, nothing
  committed yet, or etcd unreadable)
* ``ckpt_report`` job, rank, source, seconds, steps_lost, bytes, generation, step, [refused],
  [next_generation] → {}
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from elasticd.store.api import ScratchOverCap, SlotStoreError
from elasticd.store.scratch_pool import prefill
from elasticd.snapshot.format import SnapshotError
from elasticd.store.service_records import call_hooks, param
from elasticd.store.telemetry import RESTORE_SOURCES
from elasticd.local.wire import RequestError
from elasticd.errors import ShardLost

log = logging.getLogger(__name__)


class RestoreOps:
    """The restore-side ops of :class:`~elasticd.store.service.CheckpointService`."""

    def _list(self, msg: dict[str, Any]) -> dict[str, Any]:
        job = param(msg, "job", str)
        only = param(msg, "rank", int, None)
        world = param(msg, "world_size", int, None)
        ranks = sorted({r for j, r, _, _ in self.store.holdings() if j == job})
        with self._lock:
            record = self._jobs.get(job)
            refused = set() if record is None else set(record.refused)
            progress = None if record is None else record.progress

        def usable(r: int, version: tuple[int, int]) -> bool:
            view = self.store.latest(job, r, version=version)
            return view is not None and (world is None or view.header.world_size == world)

        ram = {str(r): [list(v) for v in self.store.versions(job, r)
                        if (r, *v) not in refused and usable(r, v)]
               for r in (ranks if only is None else [only])}
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

    def _open(self, msg: dict[str, Any], verify: bool = True) -> dict[str, Any]:
        """``ckpt_open``: hands the worker a read-only descriptor of the held snapshot, its
        payload checked again first (RAM can rot between the snapshot and the restore), but
        not when this request has just fetched and checked it (``verify`` False)."""
        job, rank = param(msg, "job", str), param(msg, "rank", int)
        version = (param(msg, "generation", int), param(msg, "step", int))
        self._sweep_pins()
        try:
            view = self.store.latest(job, rank, pin=True, verify=verify, version=version)
        except SnapshotError as exc:
            with self._lock:
                self._jobs[job].refused.add((rank, *version))
                self.counters["refused"] += 1
            log.error("REFUSED corrupt snapshot of %s rank %d step %s on node %s: %s", job,
                      rank, version, self.node_id, exc)
            self._emit("snapshot_refused", job, "local")
            raise RequestError(f"refused: {exc}") from exc
        if view is None:
            raise RequestError(f"{job} rank {rank} step {version} is not held here")
        pin, fd = self._pin(view.descriptor, view.release, job, f"{job} rank {rank} step {version}")
        with self._lock:
            record = self._jobs.get(job)
            # A shard an earlier (aborted) restore round fetched from a peer is in the local
            # store now, but it still came from the peer: say so, or recoveries get mislabelled.
            fetched = record is not None and (rank, *version) in record.fetched
        return {"path": view.path, "offset": 0, "size": view.header.layout.total_size,
                "pin": pin, "source": "peer" if fetched else "local", "_fds": [fd]}

    def _committed(self, msg: dict[str, Any]) -> dict[str, Any]:
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

    def _fetch(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank = param(msg, "job", str), param(msg, "rank", int)
        with self._lock:
            shard_lock = self._fetching[(job, rank)]
        with shard_lock:
            return self._fetch_one(job, rank, msg)

    def _fetch_one(self, job: str, rank: int, msg: dict[str, Any]) -> dict[str, Any]:
        version = (param(msg, "generation", int), param(msg, "step", int))
        key = (rank, *version)
        with self._lock:
            record = self._jobs.get(job)
            refused = record is not None and key in record.refused
            was_fetched = record is not None and key in record.fetched
        source, wire_bytes, holder, just_fetched = "local", 0, self.node_id, False
        try:
            held = version in self.store.versions(job, rank)
        except ValueError as exc:  # a job name the store cannot hold
            raise RequestError(str(exc)) from exc
        if refused or not held:
            if self.replicator is None:
                return {"lost": True, "reason": "not held here and no peer replication"}
            caller = (job, rank, (msg.get("_peer") or {}).get("pid"))
            if msg.get("need") is not None:  # one live partial copy per (job, rank) and caller
                with self._lock:
                    earlier = self._scratch_pins.pop(caller, None)
                if earlier is not None:
                    self._release({"pin": earlier})
            replica = self._open_replica(job, rank, version)
            if replica is not None:
                return replica
            try:
                result = self.replicator.fetch_to_local(job, rank, version,
                                                        need=msg.get("need"))
            except ShardLost as exc:
                return {"lost": True, "reason": str(exc)[:500]}
            except ScratchOverCap as exc:
                self._scratch_refused(job, exc)
                raise RequestError(f"cannot fetch {job} rank {rank} step {version} here: "
                                   f"{exc}") from exc
            except (SlotStoreError, SnapshotError, ValueError, OSError) as exc:  # no room, or torn
                raise RequestError(f"cannot fetch {job} rank {rank} step {version} here: "
                                   f"{exc}") from exc
            scratch = result.scratch
            with self._lock:
                record = self._jobs[job]
                self.counters["fetches"] += 1
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
        reply = self._open({"job": job, "rank": rank, "generation": version[0],
                            "step": version[1], "_peer": msg.get("_peer", {})},
                           verify=not just_fetched)
        return {**reply, "source": source, "wire_bytes": wire_bytes, "holder": holder}

    def _open_replica(self, job: str, rank: int,
                      version: tuple[int, int]) -> dict[str, Any] | None:
        """The reply for a shard this node holds as a replica of another node's (the dead
        node's rank, now hosted here): its slot handed over read-only and pinned, as
        ``ckpt_open`` hands a local one (checked first, for rot in RAM), rather than copied
        into the local store or a scratch segment first; None when it is not held here."""
        store = getattr(getattr(self.replicator, "sink", None), "store", None)
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
        pin, fd = self._pin(view.descriptor, view.release, job,
                            f"the replica of {job} rank {rank} step {version}")
        return {"path": view.path, "offset": 0, "size": view.header.layout.total_size,
                "pin": pin, "source": "peer", "wire_bytes": 0, "holder": self.node_id,
                "_fds": [fd]}

    def _hand_scratch(self, caller: tuple[str, int, Any], scratch: Any,
                      result: Any) -> dict[str, Any]:
        """The reply for a partial copy (``ckpt_fetch`` with ``need``, see the module
        docstring) to ``caller`` (job, rank, pid)."""
        pin, fd = self._pin(functools.partial(scratch.descriptor, writable=False),
                            functools.partial(self.store.scratch.drop, scratch), caller[0],
                            "a partial copy")
        with self._lock:
            self._scratch_pins[caller] = pin
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
        sizes = []
        for held_job, rank, _, _ in self.store.holdings():
            view = self.store.latest(held_job, rank) if held_job == job else None
            if view is not None:
                sizes.append(view.header.layout.total_size)
        return prefill(self.store, job, sizes) if sizes else 0

    def undelivered(self, op: str, reply: dict[str, Any]) -> None:
        """The local API could not send ``reply`` to ``op`` (its worker went away while the
        request ran: a restore round aborted during a fetch from a frozen holder): the read
        pin it carried is released now. Held until ``pin_ttl``, it kept the rank's other slot
        from being reused, so every other snapshot of that rank was skipped and commits
        stalled (the frozen-holder chaos test lost 29 steps at the next restore)."""
        pin = reply.get("pin")
        if op in ("ckpt_open", "ckpt_fetch") and isinstance(pin, int):
            self._release({"pin": pin})
            log.info("the reply to %s was not delivered (its caller is gone): read pin %d of %s "
                     "released", op, pin, reply.get("path", "?"))

    def _pin(self, descriptor: Callable[[], int], release: Callable[[], None], job: str,
             what: str) -> tuple[int, int]:
        """A new read-only descriptor for the worker, and the pin that holds ``release`` until
        ``ckpt_release`` (or ``pin_ttl``); ``release`` is called at once when it fails."""
        try:
            fd = descriptor()
        except OSError as exc:
            release()
            raise RequestError(f"cannot hand over {what}: {exc}") from exc
        with self._lock:
            self._next_pin += 1
            self._pins[self._next_pin] = (release, job, self.clock.monotonic())
            return self._next_pin, fd

    def _release(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            entry = self._pins.pop(param(msg, "pin", int), None)
        if entry is not None:
            entry[0]()
        return {}

    def _scratch_refused(self, job: str, exc: ScratchOverCap) -> None:
        """A partial copy refused over ``job``'s scratch cap: counted; logged the first time
        and every 100th (a worker that loops must not flood the log)."""
        with self._lock:
            record = self._jobs[job]
            record.scratch_refused += 1
            self.counters["scratch_refused"] += 1
            count = record.scratch_refused
        if count % 100 == 1:
            log.error("REFUSED restore scratch on node %s (%d so far for %s): %s", self.node_id,
                      count, job, exc)
        self._emit("scratch_refused", job)

    def _sweep_pins(self, job: str | None = None) -> None:
        """Drops the pins older than ``pin_ttl`` (their worker died), or all of ``job``'s."""
        now = self.clock.monotonic()
        with self._lock:
            releases = [self._pins.pop(p)[0] for p, (_, j, t) in list(self._pins.items())
                        if (j == job if job is not None else now - t > self.pin_ttl)]
            self._scratch_pins = {k: p for k, p in self._scratch_pins.items() if p in self._pins}
        for release in releases:
            release()

    def _report(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank, source = param(msg, "job", str), param(msg, "rank", int), msg.get("source")
        if source not in RESTORE_SOURCES:
            raise RequestError(f"source must be one of {RESTORE_SOURCES}, got {source!r:.40}")
        seconds, lost = param(msg, "seconds", float), param(msg, "steps_lost", int)
        nbytes = param(msg, "bytes", int)
        refused = [str(r)[:500] for r in msg.get("refused", []) if isinstance(r, str)][:16]
        entry = {"job": job, "rank": rank, "source": source, "seconds": seconds,
                 "steps_lost": lost, "bytes": nbytes, "generation": msg.get("generation"),
                 "step": msg.get("step"), "refused": refused, "at": self.clock.wall()}
        start_gen = param(msg, "next_generation", int, None)
        with self._lock:
            record = self._jobs[job]
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
        call_hooks(self.on_restore, "restore", entry)
        return {}
