"""The snapshot side of the checkpoint service, a part :class:`~elasticd.store.service.
CheckpointService` owns (it shares the service's job records, :class:`~elasticd.store.
service_records.JobBook`, and nothing else of it), and what a completed snapshot sets off:
replication to peers, persistence.

* ``ckpt_reserve`` job, rank, world_size, nbytes, [local_world_size], [step], [mapped
  [[dev, ino], ...]] → path, capacity, ticket, file [dev, ino], and the slot's descriptor
  (read-write) unless ``file`` is one of the ``mapped`` files the worker still maps | skip,
  reason
* ``ckpt_complete`` job, rank, ticket, header_size, [stall_seconds] → generation, step, bytes
* ``register`` job, rank, world_size, [local_rank], [restart], [step], [unsnapshottable] →
  node, unprotected (a worker's Checkpointer says who it is, when it starts and after each
  restore: the daemon learns the group's ranks from it, for placement, as from a progress
  report; ``unsnapshottable`` says why its state cannot be snapshotted at all, which makes the
  job unprotected, reason ``snapshots_failing``, until a snapshot of that rank completes)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import Any, Callable

from elasticd.store.api import CommitPending, OverBudget, SlotBusy, StaleSlot
from elasticd.snapshot.format import PREAMBLE_SIZE, SnapshotError
from elasticd.snapshot.reader import _header_from_json
from elasticd.hooks import call_hooks
from elasticd.store.read_pins import ReadPins
from elasticd.store.service_records import JobBook, JobRecord, ServiceDeps, emit, param
from elasticd.local.wire import RequestError
from elasticd.persistence.persister import Flushed

log = logging.getLogger(__name__)


def _mapped(msg: dict[str, Any]) -> set[tuple[int, int]]:
    """The ``mapped`` field of a reservation: (device, inode) pairs; anything else is ignored
    (the worker then simply gets a descriptor)."""
    value = msg.get("mapped")
    if not isinstance(value, list):
        return set()
    return {(p[0], p[1]) for p in value[:8] if isinstance(p, list) and len(p) == 2
            and all(type(v) is int for v in p)}


class Snapshots:
    """The snapshot-side ops of :class:`~elasticd.store.service.CheckpointService`, and its
    pause (a drain, a clean exit).

    Args:
        pins: the service's read pins (a reservation drops those past their time).
        assess: re-assesses every job's protection now (a rank's snapshots failing counts at
            once, not at the next daemon cycle).
    """

    def __init__(self, book: JobBook, pins: ReadPins, deps: ServiceDeps,
                 on_progress: list[Callable[[dict[str, Any]], None]],
                 assess: Callable[[], None]) -> None:
        self._book, self._pins, self._sink, self._assess = book, pins, deps.sink, assess
        self.store, self.persist, self.replicator = deps.store, deps.persist, deps.replicator
        self.node_id, self.clock, self.on_progress = deps.node_id, deps.clock, on_progress
        self._paused = ""  # why new snapshots are refused (a drain, a clean exit), or ""
        self._reserving = 0  # reservations between the pause check and their slot's record
        if self.persist is not None and self.persist.on_flushed is None:
            self.persist.on_flushed = self._on_flushed
        if self.persist is not None and self.replicator is not None:
            self.replicator.add_commit_listener(self._persist_commit)

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """Op name -> handler, for the snapshot side's ops."""
        return {"ckpt_reserve": self.ckpt_reserve, "ckpt_complete": self.ckpt_complete,
                "register": self.register}

    def ckpt_reserve(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank = param(msg, "job", str), param(msg, "rank", int)
        world, nbytes = param(msg, "world_size", int), param(msg, "nbytes", int)
        local_world = param(msg, "local_world_size", int, None)
        if rank >= world:
            raise RequestError(f"rank {rank} outside world size {world}")
        uid = msg.get("_peer", {}).get("uid", msg.get("uid"))
        step, gen = param(msg, "step", int, None), param(msg, "generation", int, None)
        if step is not None:
            call_hooks(self.on_progress, {"job": job, "rank": rank, "world_size": world,
                                          "step": step, "_peer": msg.get("_peer")},
                       log=log, failed="progress hook failed")
        self._pins.sweep()
        with self._book.lock:
            if step is not None and gen is not None:
                # The step is reached once its snapshot is asked for, taken or not: a rank
                # killed before the snapshot completes must still count it as lost.
                record = self._book.jobs[job]
                record.reached((gen, step))
            if self._paused:
                self._book.counters["skipped_paused"] += 1
                return {"skip": True, "reason": f"paused: {self._paused}"}
            self._reserving += 1
        try:
            reply = self._reserve_slot(job, rank, world, nbytes, local_world, uid,
                                       None if step is None or gen is None else (gen, step),
                                       _mapped(msg))
        finally:
            with self._book.lock:
                self._reserving -= 1
        warning = self._book.unprotected(job)
        return {**reply, "unprotected": warning} if warning else reply

    def register(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A worker's Checkpointer says who it is (at its start and after each restore)."""
        job, rank = param(msg, "job", str), param(msg, "rank", int)
        world = param(msg, "world_size", int)
        if rank >= world:
            raise RequestError(f"rank {rank} outside world size {world}")
        optional = {key: param(msg, key, int, None) for key in ("local_rank", "restart", "step")}
        report = {"job": job, "rank": rank, "world_size": world, "_peer": msg.get("_peer"),
                  **{key: value for key, value in optional.items() if value is not None}}
        call_hooks(self.on_progress, report, log=log, failed="progress hook failed")
        why = param(msg, "unsnapshottable", str, None)
        if why:
            with self._book.lock:
                self._book.jobs[job].failing[rank] = (f"rank {rank}'s training state cannot be "
                                                f"snapshotted: {why[:300]}")
            log.error("job %s rank %d on node %s: the training state cannot be snapshotted, so "
                      "the job is unprotected: %s", job, rank, self.node_id, why[:300])
            self._assess()  # at once, not at the next daemon cycle
        return {"node": self.node_id, "unprotected": self._book.unprotected(job) or None}

    def _reserve_slot(self, job: str, rank: int, world: int, nbytes: int,
                      local_world: int | None, uid: Any,
                      version: tuple[int, int] | None = None,
                      mapped: set[tuple[int, int]] = frozenset()) -> dict[str, Any]:
        with self._book.lock:
            record = self._book.jobs[job]
            if record.world_size != world:  # a new world: its local ranks are seen afresh
                record.world_size, record.ranks = world, set()
            record.ranks.add(rank)
            record.local_world_size, record.uid = local_world, uid if type(uid) is int else None
        grid = (self.replicator.snapshot_grid(job)
                if self.replicator is not None and version is not None else 1)
        if grid > 1 and version is not None and version[1] % grid:
            # Off the job's snapshot grid: the nodes meet on common steps to commit
            # (replication/commit.py, Grid). Routine: no warning, not a failure.
            return self._newest(job, rank, nbytes, mapped, record, "grid") or {
                **self._skip(job, rank, "grid", f"off the snapshot grid (every {grid} steps "
                             "while commits lag)"), "grid": grid}
        try:
            slot = self.store.reserve(job, rank, nbytes)
        except OverBudget as exc:
            return self._skip(job, rank, "over_budget", str(exc))
        except CommitPending as exc:
            if self.replicator is not None:
                self.replicator.on_commit_pending(job, exc.version, skipped=version)
            return (self._newest(job, rank, nbytes, mapped, record, "commit_pending")
                    or self._skip(job, rank, "commit_pending", str(exc)))
        except SlotBusy as exc:
            return (self._newest(job, rank, nbytes, mapped, record, "busy")
                    or self._skip(job, rank, "busy", str(exc)))
        except (ValueError, OSError) as exc:
            raise RequestError(f"cannot reserve a slot: {exc}") from exc
        return self._hand_over(slot, mapped, record)

    def _newest(self, job: str, rank: int, nbytes: int, mapped: set[tuple[int, int]],
                record: JobRecord, refused: str) -> dict[str, Any] | None:
        """A snapshot the commit slots refused (``refused``: the skip reason it would have
        had, ``grid`` when off the grid), taken into the rank's newest pair when the job keeps
        one (an in-process job: store/shm.py's module doc), so that a survivor holds the last
        step it completed; None (skipped as before) otherwise or when that pair cannot take
        it. Counted as ``newest_only`` by that reason, not as a skip or a failure: the commit
        slots are fine, and the commit protocol was told (the caller). Counted apart because
        such a copy costs the training loop a snapshot that protects this node's own restore
        only (docs/replication.md, "The newest pair")."""
        if not self.store.keeps_newest(job):
            return None
        try:
            slot = self.store.reserve(job, rank, nbytes, newest=True)
        except (OverBudget, SlotBusy) as exc:
            log.debug("%s rank %d: no slot of the newest pair either: %s", job, rank, exc)
            return None
        except (ValueError, OSError) as exc:
            raise RequestError(f"cannot reserve a slot: {exc}") from exc
        with self._book.lock:
            self._book.counters["newest_only"] += 1
        emit(self._sink, "snapshot_newest_only", job, refused)
        return self._hand_over(slot, mapped, record)

    def _hand_over(self, slot: Any, mapped: set[tuple[int, int]],
                   record: JobRecord) -> dict[str, Any]:
        rank = slot.rank
        try:
            identity, fd = self.store.handover(slot, mapped)
        except (StaleSlot, OSError) as exc:  # a newer reservation of this rank took it
            raise RequestError(f"cannot hand over the slot: {exc}") from exc
        with self._book.lock:
            record.slots[rank] = slot
            if not slot.newest and record.failing.get(rank, "").startswith("over the memory cap"):
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
        with self._book.lock:
            self._paused = why

        def busy() -> int:
            with self._book.lock:
                return self._reserving + sum(len(r.slots) for r in self._book.jobs.values())

        if self.clock.wait(lambda: not busy(), timeout, 0.02):
            return True
        log.warning("%d snapshots still in flight after %.1f s; going on", busy(), timeout)
        return False

    def resume(self) -> None:
        """Accepts snapshots again (after :meth:`quiesce`)."""
        with self._book.lock:
            self._paused = ""

    def _skip(self, job: str, rank: int, reason: str, detail: str) -> dict[str, Any]:
        with self._book.lock:
            record = self._book.jobs[job]
            self._book.counters[f"skipped_{reason}"] += 1
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
            self._assess()  # failing snapshots count at once, not at the next daemon cycle
        emit(self._sink, "snapshot_skipped", job, reason)
        return {"skip": True, "reason": f"{reason}: {detail}"}

    def ckpt_complete(self, msg: dict[str, Any]) -> dict[str, Any]:
        job, rank = param(msg, "job", str), param(msg, "rank", int)
        ticket, size = param(msg, "ticket", int), param(msg, "header_size", int)
        stall = param(msg, "stall_seconds", float, 0.0)
        with self._book.lock:
            record = self._book.jobs.get(job)
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
            with self._book.lock:
                record.failing[rank] = f"rank {rank}'s snapshot refused: {str(exc)[:200]}"
            raise RequestError(f"snapshot refused: {exc}") from exc
        version, nbytes = sealed.version(), sealed.layout.total_size
        with self._book.lock:
            record.slots.pop(rank, None)
            record.failing.pop(rank, None)
            if record.first_snapshot_at is None:
                record.first_snapshot_at = self.clock.monotonic()
            record.nbytes[rank] = nbytes
            record.reached(version)
            self._book.counters["snapshots"] += 1
        emit(self._sink, "snapshot_completed", job, rank, sealed.step, nbytes, stall)
        if slot.newest:
            # This node's own copy (the newest pair): never replicated nor persisted.
            return {"generation": sealed.generation, "step": sealed.step, "bytes": nbytes}
        try:
            if self.replicator is not None:
                self.replicator.on_local_snapshot(job, rank, version)
        except Exception:  # noqa: BLE001 — the snapshot is sealed; replication must not fail it
            self._book.counters["replicate_failed"] += 1
            log.exception("%s rank %d step %s: handing the snapshot to replication failed",
                          job, rank, version)
        self._maybe_persist(job, record, version)
        return {"generation": sealed.generation, "step": sealed.step, "bytes": nbytes}

    def _maybe_persist(self, job: str, record: JobRecord, version: tuple[int, int]) -> None:
        """Offers a step every local rank completed to the persister (without commits: with
        them, the job's flushes follow its commits, :meth:`_persist_commit`)."""
        if self.persist is None or (self.replicator is not None
                                    and self.replicator.follows_commits(job)):
            return
        with self._book.lock:
            if version <= record.offered or not self._holding(job, version):
                return
            record.offered = version
        if not self.persist.due(job, version[1]):
            return
        views = self._pin_step(job, version)
        # None: overwritten meanwhile, a newer step will be offered.
        if views is not None and not self.persist.submit(job, views, record.uid) \
                and not self.persist.closed:
            log.debug("%s step %s not persisted: the writer is busy", job, version)
            emit(self._sink, "persist_writer_busy", job, "skipped")

    def _persist_commit(self, job: str, version: tuple[int, int]) -> None:
        """A commit this node learned (in order; every node learns the same ones): offered to
        the persister, so that every node flushes the same steps and they complete. Its copies
        stay in this node's slots until the next commit, so a flush the busy writer cannot
        take now waits for it (``retry``) rather than being skipped."""
        with self._book.lock:
            record = self._book.jobs.get(job)
            if record is None or version <= record.offered:
                return
            record.offered = version
            # Under the lock: commits told on two threads are judged in the order told.
            due = self.persist.due(job, version[1])
        if not due:
            return
        views = self._pin_step(job, version)
        if views is None:
            log.info("%s step %s committed, not persisted: this node does not hold every "
                     "local rank's copy", job, version)
            return
        if not self.persist.submit(job, views, record.uid, retry=functools.partial(
                self._pin_again, job, version)) and not self.persist.closed:
            log.debug("%s step %s waits for the persister's writer", job, version)
            emit(self._sink, "persist_writer_busy", job, "waited")

    def _pin_again(self, job: str, version: tuple[int, int]) -> list[Any] | None:
        """A step that waited for the persister's writer, pinned again once it is free; None
        (dropped) when its copies went meanwhile."""
        views = self._pin_step(job, version)
        if views is None:
            emit(self._sink, "persist_writer_busy", job, "dropped")
        return views

    def _holding(self, job: str, version: tuple[int, int]) -> list[int]:
        """The local ranks whose copy of ``version`` is held here, when that is every local
        rank's (else []). Call with the book's lock held. Ranks this node had in an older
        generation of the same world size hold no copy of a newer version, and do not count:
        required, they kept this node from persisting anything after its ranks changed."""
        record = self._book.jobs.get(job)
        if record is None:
            return []
        ranks = [r for r in sorted(record.ranks) if version in self.store.versions(job, r)]
        return ranks if ranks and len(ranks) >= (record.local_world_size
                                                 or record.world_size) else []

    def _pin_step(self, job: str, version: tuple[int, int]) -> list[Any] | None:
        """Pinned views of every local rank's copy of ``version``, or None (some rank's copy
        is not held, or the local ranks are not all known yet)."""
        with self._book.lock:
            ranks = self._holding(job, version)
        if not ranks:
            return None
        views = []
        for r in ranks:
            view = self.store.latest(job, r, pin=True, version=version)
            if view is None:
                for v in views:
                    v.release()
                return None
            views.append(view)
        return views

    def _on_flushed(self, flushed: Flushed) -> None:
        emit(self._sink, "persisted", flushed.job, flushed.version[1], flushed.seconds,
                   flushed.nbytes, not flushed.error)
