"""Peer replicas in daemon-owned shared memory: the :class:`~elasticd.replication.api.Sink` a
node's :class:`~elasticd.replication.server.ReplicaServer` stores into.

Replicas live in a :class:`~elasticd.store.shm.SlotStore` of their own, so they get the
same pre-touched, double-buffered slots as local snapshots, and a restarted daemon adopts the
ones whose checksums verify (:meth:`SlotStore.scan`). The store is separate from the local one
(a sibling directory, :func:`replica_root`) rather than a namespace inside it because a slot's
directory must be named for the job and rank its header carries (the store checks both when a
snapshot completes and at a restart scan), and the local store's scan deletes anything under its
root it does not recognise. Keeping them apart also keeps the checkpoint service's listing of a
job's local ranks free of other nodes' shards.

One node-wide memory cap counts both stores: given ``cap_bytes`` and the local store, the sink
keeps the local store's ``cap_bytes`` at the cap minus the replica bytes held, and allocates a
replica only within the cap minus the local bytes held. Whoever asks first gets the room: a
local snapshot over the cap is skipped by the checkpoint service (unprotected), a replica over
it is refused with ``no_space`` (the owner counts a failed push).

Received bytes land straight in the slot (no copy). Before a copy is published its snapshot
header is parsed and every payload block is checked against the header's xxh3 checksums (the
transport's per-frame checksums only prove that the wire did not alter the bytes, not that the
sender's copy was intact). Fetches are served from the replicas and, for shards this node
owns, from its local snapshots. The version rule of the base class refuses stale and duplicate
copies; :meth:`ShmSink.set_floor` also refuses every copy of an abandoned generation but the
committed one the job keeps. Daemon side: no torch.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from elasticd.store.api import CommitPending, OverBudget, Slot, SlotBusy, StaleSlot
from elasticd.snapshot.format import SnapshotError
from elasticd.snapshot.reader import parse_header
from elasticd.store.shm import SlotStore, SnapshotView
from elasticd.replication.api import (
    IN_PROGRESS,
    NO_SPACE,
    STALE,
    Descriptor,
    Refused,
    Sink,
    Version,
)

log = logging.getLogger(__name__)

#: A received copy failed its snapshot checksums (or its header did not match its descriptor).
CORRUPT = "corrupt"
#: The descriptor names something the store cannot hold (e.g. a job name it refuses).
INVALID = "invalid"

REPLICA_SUFFIX = "+replicas"


def replica_root(local_root: str) -> str:
    """Where a node keeps peer replicas, beside its local slots (``+`` is never part of a node
    name, so this cannot be another node's local root)."""
    return local_root.rstrip("/") + REPLICA_SUFFIX


def pinned_view(store: SlotStore, job: str, rank: int,
                version: Version | None) -> SnapshotView | None:
    """A pinned view of a complete snapshot (``version``, or the newest), or None."""
    try:
        return store.latest(job, rank, pin=True, version=version)
    except (SnapshotError, ValueError):
        return None


def descriptor_of(view: SnapshotView) -> Descriptor:
    h = view.header
    return Descriptor(h.job, h.rank, h.generation, h.step, h.layout.total_size,
                      h.layout.data_offset)


class ShmSink(Sink):
    """Stores peer replicas in ``store``.

    Args:
        store: the replica slot store (scanned first on a daemon restart; its copies are
            adopted as held).
        local: the node's local slot store, whose bytes count against ``cap_bytes`` too.
        cap_bytes: node-wide cap on local plus replica slot bytes; None for no cap.
    """

    def __init__(self, store: SlotStore, *, local: SlotStore | None = None,
                 cap_bytes: int | None = None) -> None:
        super().__init__()
        if cap_bytes is not None and cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0 or None, got {cap_bytes}")
        self.store, self.local, self.cap_bytes = store, local, cap_bytes
        self._mem = threading.Lock()  # allocate runs outside the base class's lock
        self._pending: dict[Descriptor, Slot] = {}
        self._held: dict[tuple[str, int], Descriptor] = {}
        self._reading: dict[Descriptor, list[SnapshotView]] = {}
        self._floors: dict[str, int] = {}
        self._budget_lock = threading.Lock()
        #: Called with a job to bring its committed version up to date (see :meth:`_reserve`).
        self.on_pending: Callable[[str], None] = lambda *_: None
        #: Called with (job, rank, version) when a replica landed, which may be committed: the
        #: commit protocol retains it (see :mod:`elasticd.replication.commit_state`).
        self.on_landed: Callable[[str, int, Version], None] = lambda *_: None
        #: Called with (job, rank, version) when a newer replica needs the slot of that version.
        self.on_superseded: Callable[[str, int, Version], None] = lambda *_: None
        #: Called with (job, rank, versions): those of them the rank's owner's record says can
        #: never be committed (skipped or withdrawn); see :meth:`_resolved`.
        self.never_committed: Callable[[str, int, list[Version]], set[Version]] = lambda *_: set()
        #: Called with a job: the committed version this node keeps of it (None: none known),
        #: taken below the floor too (see :meth:`set_floor`).
        self.kept_commit: Callable[[str], Version | None] = lambda _job: None
        for job, rank, _, _ in store.holdings():
            view = store.latest(job, rank)
            if view is not None:
                self._held[(job, rank)] = descriptor_of(view)
        self._update_local_cap()

    # -- generations ------------------------------------------------------------------------

    def set_floor(self, job: str, generation: int) -> None:
        """Refuses, from now on, every copy of ``job`` older than ``generation`` (a restore
        opened it: the versions below it can never commit), but the committed version
        (:attr:`kept_commit`): until the new generation commits, it is the step a second
        failure restores, so a holder that died is replaced and a drain hands it over as
        before the floor."""
        with self._mem:
            self._floors[job] = max(self._floors.get(job, 0), generation)

    # -- storage primitives -----------------------------------------------------------------

    def allocate(self, d: Descriptor) -> memoryview:
        with self._mem:
            floor = self._floors.get(d.job, 0)
        # Asked only below the floor, and outside _mem: it takes the commit tracker's lock,
        # which every push received would otherwise wait for.
        if d.generation < floor and d.version != self.kept_commit(d.job):
            raise Refused(STALE, f"generation {d.generation} of {d.job} was abandoned "
                                 f"(current generation {floor})")
        with self._mem:
            # A shard has two slots, one of which holds its newest copy: a second transfer of
            # the same shard would be handed the same free slot and the two would tear it.
            if any(p.shard == d.shard for p in self._pending):
                raise Refused(IN_PROGRESS, f"another copy of rank {d.owner_rank} is being "
                                           "received")
            self._pending[d] = None  # type: ignore[assignment]  # claims the shard
        try:
            slot = self._reserve(d)
        except BaseException:
            with self._mem:
                self._pending.pop(d, None)
            raise
        with self._mem:
            self._pending[d] = slot
        return slot.buffer[: d.total_bytes]

    def _reserve(self, d: Descriptor) -> Slot:
        try:
            return self._reserve_once(d)
        except CommitPending as exc:
            if d.version <= exc.version:
                raise Refused(IN_PROGRESS, str(exc)) from exc
            # A newer copy exists, so its sender resolved the acknowledged one in the way: it
            # was committed (this node's watch may not have said so yet: ask etcd) or withdrawn
            # by its owner, who sends no newer copy until one or the other happened (its slots
            # keep it from snapshotting past it, and where a free slot would not, as for a
            # rank's new owner, CommitBook.holding_back keeps the copy from being sent).
            self.on_pending(d.job)
            try:
                return self._reserve_once(d)
            except CommitPending as again:
                if d.version <= again.version:
                    raise Refused(IN_PROGRESS, str(again)) from again
                victim = self._resolved(d, again)
                self.on_superseded(d.job, d.owner_rank, victim)
                return self._reserve_once(d)

    def _resolved(self, d: Descriptor, pending: CommitPending) -> Version:
        """Which undecided copy in the way of ``d`` its owner resolved. With one, that one
        (the other slot holds the commit). With two, the owner withdrew one of them before it
        could snapshot ``d``, but the other may still be committed from the records: only
        the owner's record says which (a withdrawal is published with the version), so a copy
        is let go only when it says that copy can never be committed."""
        undecided = sorted(v for v in pending.held if v < d.version)
        if len(undecided) <= 1:
            return pending.version
        dead = self.never_committed(d.job, d.owner_rank, undecided)
        if not dead:
            raise Refused(IN_PROGRESS, f"rank {d.owner_rank}: copies {undecided} may both still "
                                       "be committed; retry after the owner's record says which "
                                       "it withdrew")
        return max(dead)

    def _reserve_once(self, d: Descriptor) -> Slot:
        try:
            with self._budget_lock:
                if self.cap_bytes is None or self.local is None:
                    self.store.cap_bytes = self.cap_bytes
                    return self.store.reserve(d.job, d.owner_rank, d.total_bytes)
                # Hold room for the worst case against local reservations first, then read
                # what the local store holds: any local reservation either finished before
                # that read (and is counted) or sees the lowered cap.
                worst = 2 * d.total_bytes + (8 << 10)
                self.local.cap_bytes = max(0, self.cap_bytes - self.store.bytes_held() - worst)
                try:
                    self.store.cap_bytes = max(0, self.cap_bytes - self.local.bytes_held())
                    return self.store.reserve(d.job, d.owner_rank, d.total_bytes)
                finally:
                    self._update_local_cap_locked()
        except OverBudget as exc:
            raise Refused(NO_SPACE, str(exc)) from exc
        except CommitPending:
            raise  # handled by _reserve
        except SlotBusy as exc:
            raise Refused(IN_PROGRESS, str(exc)) from exc
        except ValueError as exc:
            raise Refused(INVALID, str(exc)) from exc

    def _update_local_cap(self) -> None:
        with self._budget_lock:
            self._update_local_cap_locked()

    def _update_local_cap_locked(self) -> None:
        if self.cap_bytes is not None and self.local is not None:
            self.local.cap_bytes = max(0, self.cap_bytes - self.store.bytes_held())

    def publish(self, d: Descriptor, tags: Any = None) -> None:
        # Runs under the base class's lock, so verification delays other transfers' begin and
        # commit by one pass over this copy (~26 GB/s); it is what makes the copy count.
        with self._mem:
            slot = self._pending.pop(d)
        where = f"replica of {d.job} rank {d.owner_rank} {d.version}"
        try:
            header = parse_header(slot.buffer, job=d.job, rank=d.owner_rank, where=where)
            if header.version() != d.version or header.layout.total_size != d.total_bytes:
                raise SnapshotError(f"{where}: header says {header.version()} of "
                                    f"{header.layout.total_size} bytes, the transfer "
                                    f"{d.version} of {d.total_bytes}")
            # Verifies every block against the header's checksums (so a holder's copy agrees
            # with its checksums and with its block tags, which the wire checked), rewrites the
            # same header, and keeps the tags with the copy.
            self.store.complete(slot, header, tags=tags)
            # The acknowledgement that follows may make it committed: it stays until then.
            self.on_landed(d.job, d.owner_rank, d.version)
        except (SnapshotError, StaleSlot, ValueError) as exc:
            log.error("REFUSED corrupt %s: %s", where, exc)
            raise Refused(CORRUPT, str(exc)) from exc
        with self._mem:
            # The newest copy stays the one held: the committed one handed over (an exact
            # push) may land beside a newer one.
            if (held := self._held.get(d.shard)) is None or held.version < d.version:
                self._held[d.shard] = d

    def discard(self, d: Descriptor, reason: str) -> None:
        with self._mem:
            self._pending.pop(d, None)  # the slot stays reserved; the next reserve reuses it
        log.info("replica of %s rank %d %s dropped: %s", d.job, d.owner_rank, d.version, reason)

    def held(self, job: str, owner_rank: int) -> Descriptor | None:
        with self._mem:
            return self._held.get((job, owner_rank))

    def lookup(self, job: str, owner_rank: int,
               version: Version | None) -> tuple[Descriptor, memoryview] | None:
        # The owner's own snapshot is served too: otherwise only m - 1 of the m copies of a
        # shard could be fetched by a node that takes over the rank while its owner lives.
        view = pinned_view(self.store, job, owner_rank, version)
        if self.local is not None:
            mine = pinned_view(self.local, job, owner_rank, version)
            if view is None or (mine is not None and mine.header.version() > view.header.version()):
                view, mine = mine, view
            if mine is not None:
                mine.release()
        if view is None:
            return None
        d = descriptor_of(view)
        with self._mem:
            self._reading.setdefault(d, []).append(view)
        return d, view.buffer

    def tags(self, d: Descriptor) -> Any:
        with self._mem:
            views = self._reading.get(d)
            return views[-1].tags if views else None

    def release(self, d: Descriptor) -> None:
        with self._mem:
            views = self._reading.get(d)
            view = views.pop() if views else None
            if views is not None and not views:
                del self._reading[d]
        if view is not None:
            view.release()

    # -- housekeeping -----------------------------------------------------------------------

    def versions(self, job: str, owner_rank: int) -> list[Version]:
        """Every complete copy of a shard held (newest first: the latest and the one before)."""
        try:
            return self.store.versions(job, owner_rank)
        except ValueError:
            return []

    def holdings(self) -> list[Descriptor]:
        """The newest copy of every shard held."""
        with self._mem:
            return sorted(self._held.values(), key=lambda d: (d.job, d.owner_rank))

    def drop(self, job: str, owner_rank: int) -> None:
        """Frees a shard's replica (e.g. one the placement no longer asks this node to hold)."""
        with self._lock, self._mem:
            if any(p.shard == (job, owner_rank) for p in self._pending):
                return  # being received: the next placement change will drop it
            self._held.pop((job, owner_rank), None)
            self.store.remove(job, owner_rank)
        self._update_local_cap()

    def remove_job(self, job: str) -> None:
        """Frees every replica of ``job`` (the job ended)."""
        with self._lock, self._mem:
            self._held = {s: d for s, d in self._held.items() if s[0] != job}
            self._floors.pop(job, None)
            self.store.remove_job(job)
        self._update_local_cap()
