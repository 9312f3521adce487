"""Daemon-owned shared memory that holds snapshots: double-buffered slots per (job, rank).

The daemon, not the worker, owns the files (under ``/dev/shm/elasticd-<node>`` by default), so
a snapshot survives the worker that wrote it, and a restarted daemon keeps every segment whose
checksums verify (:meth:`SlotStore.scan`). The root is claimed and walked safely
(:mod:`elasticd.store.shm_root`), and workers never open a slot by path: the daemon hands
them a descriptor of the file it verified. Each (job, rank) has two slots: a snapshot is written
into the one that does not hold the last complete snapshot, then sealed (header written last, see
:func:`elasticd.snapshot.format.seal`), so a crash mid-snapshot never costs the previous one.

Slots are files sized on first use, grown when the state grows, allocated with ``fallocate``
(a full tmpfs is then an error here rather than a SIGBUS in whoever writes) and pre-touched,
because first writes into fresh tmpfs pages run ten times slower than memcpy (docs/facts.md). A
per-node cap bounds the bytes held; going over it raises :class:`OverBudget`, which the caller
turns into a skipped snapshot, a warning and a metric. No torch here: this is daemon code.

The newest pair (jobs that keep it, :attr:`SlotStore.keeps_newest`: in-process jobs): two
more slots per local rank, files ``N.newest`` (which a restarted daemon's scan removes), for
this node's own restore only (:mod:`elasticd.store.newest_pair`; why and what it costs:
docs/replication.md, "The newest pair").
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
from typing import Any, Callable

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.store.api import (
    CommitPending,
    OverBudget,
    ScanResult,
    Slot,
    SlotBusy,
    SlotStoreError,
    StaleSlot,
)
from elasticd.snapshot.format import (
    JOB_RE,
    SnapshotError,
    SnapshotHeader,
    invalidate,
    seal,
    write_header,
)
from elasticd.snapshot.reader import SnapshotReader, verify_payload
from elasticd.snapshot.segment import PAGE, Segment, map_fd
from elasticd.store.scratch_pool import KEEP_SECONDS
from elasticd.store.newest_pair import NewestPairs, room_for
from elasticd.store.scratch_space import ScratchSpace
from elasticd.store.shm_root import SEGMENT_RE, claim_root, listdir_at, remove_at, same_file
from elasticd.store.shm_scan import scan_root

__all__ = ["PAGE", "CommitPending", "OverBudget", "ScanResult", "Slot", "SlotBusy", "SlotStore",
           "SlotStoreError", "SnapshotView", "StaleSlot", "map_fd"]

log = logging.getLogger(__name__)


class SnapshotView:
    """The latest complete snapshot of one (job, rank), read in place (no copy): what
    :meth:`SlotStore.latest` hands its readers (pushes and fetches send its bytes, the
    checkpoint service hands workers a descriptor of its file).

    The bytes stay valid until the store reuses the slot, which happens at the second
    :meth:`SlotStore.reserve` after this one was taken; a *pinned* view (``latest(pin=True)``)
    prevents that until :meth:`release` (a reserve then raises :class:`SlotBusy`).

    Args:
        unpin: what lets go of its pin (None: the view is not pinned).
        verify: check the payload against its checksums now (raises CorruptSnapshot).
    """

    def __init__(self, segment: Segment, unpin: Callable[[Segment], None] | None,
                 verify: bool) -> None:
        self.header: SnapshotHeader = segment.header  # type: ignore[assignment]
        self.tags = segment.tags  # what the store's tagger made at seal time, or None
        self.path = segment.path
        self.buffer = segment.view[: self.header.layout.total_size].toreadonly()
        # Parsed again from the bytes only when they are verified now: a push or a fetch
        # serves the bytes by the header the store holds (parsing a header of a few hundred
        # entries cost each fetch request ~2 ms).
        if verify:
            SnapshotReader(self.buffer, verify=True, where=segment.path)
        self._segment, self._unpin = segment, unpin

    def descriptor(self) -> int:
        """A new read-only descriptor of the slot file (for a worker; the caller closes it)."""
        return self._segment.descriptor(writable=False)

    def release(self) -> None:
        if self._unpin is not None:
            unpin, self._unpin = self._unpin, None
            unpin(self._segment)

@dataclasses.dataclass
class _Pair:
    segments: list[Segment | None] = dataclasses.field(default_factory=lambda: [None, None])
    latest: int | None = None
    reserved: int | None = None
    next_serial: int = 0
    # Versions that must stay (see SlotStore.retain).
    retained: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # The newest pair (see the module doc): never retained; reserved_newest indexes it.
    newest: list[Segment | None] = dataclasses.field(default_factory=lambda: [None, None])
    reserved_newest: int | None = None

    def held(self, newest: bool) -> list[Segment]:
        """The complete copies of the commit slots, and of the newest pair with ``newest``."""
        return [s for s in (*self.segments, *(self.newest if newest else ()))
                if s is not None and s.header is not None]


class SlotStore:
    """Double-buffered snapshot slots for every (job, rank) this node holds.

    Args:
        root: directory for the slot files (created, mode 0700); one per node.
        cap_bytes: most bytes the slot files may take together; None for no cap.
        job_scratch_cap: most bytes of restore scratch one job may hold (:attr:`scratch`);
            None for no per-job cap.
        scratch_keep: seconds a released restore scratch segment stays, pages touched, for
            its job's next restore (:mod:`elasticd.store.scratch_pool`); 0: none stays.
        clock: times how long they stay.
    """

    def __init__(self, root: str, *, cap_bytes: int | None = None,
                 job_scratch_cap: int | None = None, scratch_keep: float = KEEP_SECONDS,
                 clock: Clock | None = None):
        if cap_bytes is not None and cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0 or None, got {cap_bytes}")
        self.root, self.cap_bytes = os.path.abspath(root), cap_bytes
        self._fd = claim_root(self.root)
        self._pairs: dict[tuple[str, int], _Pair] = {}
        self._retained: dict[str, set[tuple[int, int]]] = {}  # job-wide (see retain)
        self._lock = threading.Lock()
        self._tickets = 0
        #: Partial copies for restores, and those kept for their job's next one.
        self.scratch = ScratchSpace(self._fd, self.root, self._lock, self._slot_bytes,
                                    cap_bytes, job_scratch_cap, scratch_keep,
                                    lambda job: self._dir(job, 0), clock or SYSTEM_CLOCK)
        #: Called at each local seal with the slot's memory and its payload blocks' ranges;
        #: what it returns rides along as ``SnapshotView.tags`` (replication sets it: the
        #: block tags that spare a push the pass over the bytes, seal.py's BlockTags).
        self.tagger: Callable[[memoryview, list[tuple[int, int]]], Any] | None = None
        #: Whether a job keeps each local rank's newest pair (module doc): the daemon sets it
        #: from the job spec (in-process jobs). Called with the lock held: it must not block.
        self.keeps_newest: Callable[[str], bool] = lambda job: False
        self._newest = NewestPairs(self)

    # -- paths and allocation -------------------------------------------------------------

    def _dir(self, job: str, rank: int) -> str:
        """(job, rank)'s directory, relative to the root."""
        if not isinstance(job, str) or not JOB_RE.fullmatch(job):
            raise ValueError(f"job name {job!r} must match {JOB_RE.pattern}")
        if type(rank) is not int or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        return f"{job}/{rank}"

    def _pair(self, job: str, rank: int) -> _Pair:
        pair = self._pairs.get((job, rank))
        if pair is None:
            directory = self._dir(job, rank)
            for name in (job, directory):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=self._fd)
            serials = [int(m.group(1)) for n in listdir_at(self._fd, directory)
                       if (m := SEGMENT_RE.fullmatch(n))]
            pair = self._pairs[(job, rank)] = _Pair(next_serial=max(serials, default=-1) + 1)
        return pair

    def _allocate(self, job: str, rank: int, pair: _Pair, capacity: int,
                  role: str = "slot") -> Segment:
        name = f"{self._dir(job, rank)}/{pair.next_serial}.{role}"
        pair.next_serial += 1
        try:
            return Segment.allocate(self._fd, name, os.path.join(self.root, name), capacity)
        except OSError as exc:
            raise OverBudget(f"cannot allocate {capacity} bytes in {self.root}: {exc}") from exc

    # -- the snapshot cycle ---------------------------------------------------------------

    def retain(self, job: str, rank: int | None, version: tuple[int, int]) -> bool:
        """Marks a held copy of ``version`` (of ``rank``, or of every rank of ``job`` for None,
        now and later) as one that must stay: :meth:`reserve` refuses to overwrite it
        (:class:`CommitPending`) until :meth:`release_retained`. Which copies must stay is the
        commit protocol's decision (:mod:`elasticd.replication.commit_state`), not the store's.

        Returns:
            False when ``rank``'s copy is not held here (nothing was marked).
        """
        version = (int(version[0]), int(version[1]))
        with self._lock:
            if rank is None:
                self._retained.setdefault(job, set()).add(version)
                return True
            pair = self._pairs.get((job, rank))
            if pair is None or not any(s is not None and s.header is not None
                                       and s.header.version() == version for s in pair.segments):
                return False
            pair.retained.add(version)
            return True

    def release_retained(self, job: str, rank: int | None, version: tuple[int, int]) -> None:
        """Undoes :meth:`retain` (with the same ``rank``): the copy may be overwritten again."""
        version = (int(version[0]), int(version[1]))
        with self._lock:
            if rank is None:
                self._retained.get(job, set()).discard(version)
            elif (pair := self._pairs.get((job, rank))) is not None:
                pair.retained.discard(version)

    def reserve(self, job: str, rank: int, nbytes: int, both: bool = True, *,
                newest: bool = False) -> Slot:
        """Returns a free slot of at least ``nbytes`` for the next snapshot of (job, rank).

        The slot holding the latest complete snapshot is not returned, except when the other
        slot holds a copy that must stay (:meth:`retain`) and the latest may go: then the latest
        is overwritten (the other one becomes the latest until this snapshot completes). On
        first use both slots are allocated (``both``), so the next snapshot's is ready; a slot
        too small for ``nbytes`` is replaced by a bigger one (new path).

        Args:
            both: allocate the other slot too when it is missing. False for a one-off copy (a
                shard fetched for a restore): its other slot, needed only if this node goes on
                snapshotting that rank, is allocated by that snapshot's reserve. Allocating it
                here cost as much CPU as the fetch itself and doubled the memory held
                (bench/results/fetch_cost.json).
            newest: a slot of the newest pair instead (module doc; a job that keeps it, after
                the commit slots refused this snapshot): never the one holding the rank's
                newest complete copy, nor a pinned one. Raises SlotBusy when both are.

        Raises:
            OverBudget: the allocation would exceed ``cap_bytes`` (or the filesystem is full).
            CommitPending: both slots hold copies that must stay.
            SlotBusy: the slot to reuse is pinned by a reader.
        """
        if type(nbytes) is not int or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive integer, got {nbytes!r}")
        capacity = -(-nbytes // PAGE) * PAGE
        with self._lock:
            pair = self._pair(job, rank)
            if newest:
                return self._newest.reserve(job, rank, pair, nbytes, capacity)
            index = 0 if pair.latest is None else 1 - pair.latest
            if self._stays(job, pair, index):
                everywhere = self._retained.get(job, set())
                if pair.latest is None or self._stays(job, pair, pair.latest):
                    held = [s.header.version() for s in pair.segments if s is not None
                            and s.header is not None and s.header.version() not in everywhere]
                    pending = min(held, default=min(everywhere, default=(0, 0)))
                    raise CommitPending(
                        f"{job} rank {rank}: both slots hold copies that must stay (committed "
                        f"{max(everywhere, default=None)}, acknowledged {pending} not yet "
                        "committed); this snapshot is skipped", pending, tuple(held))
                newer = pair.segments[pair.latest]
                if newer is not None and newer.pins:
                    # A reader (a push to a peer that stopped answering) holds the newer copy:
                    # skip this snapshot rather than evict the committed one, the only copy of
                    # it on this node (bench: SIGSTOP of a peer's daemon; the restore then had
                    # the committed step nowhere reachable and started over from step 0).
                    raise SlotBusy(f"{job} rank {rank}: the free slot holds a copy that must "
                                   "stay and the newer copy is pinned by a reader; this "
                                   "snapshot is skipped")
                index = pair.latest
                pair.latest = 1 - index
                if self.keeps_newest(job):
                    self._newest.set_aside(job, rank, pair, index, nbytes, capacity)
            other = 1 - index
            current = pair.segments[index]
            if current is not None and current.pins:
                raise SlotBusy(f"{job} rank {rank}: free slot {current.path} is pinned by a reader")
            grow = current is None or current.capacity < nbytes
            fill = both and pair.segments[other] is None
            needed = (capacity if grow else 0) + (capacity if fill else 0)
            freed = current.capacity if grow and current is not None else 0
            room_for(self, needed - freed, f"{job} rank {rank}: snapshot of {nbytes} bytes")
            if grow:
                if current is not None:
                    current.destroy(self._fd)
                    pair.segments[index] = None
                pair.segments[index] = current = self._allocate(job, rank, pair, capacity)
            if fill:
                pair.segments[other] = self._allocate(job, rank, pair, capacity)
            if current.header is not None:
                pair.retained.discard(current.header.version())
            invalidate(current.view)
            current.header, current.tags = None, None
            self._tickets += 1
            current.ticket = self._tickets
            pair.reserved, pair.reserved_newest = index, None
            return Slot(job, rank, current.path, current.capacity, current.view, current.ticket)

    def _stays(self, job: str, pair: _Pair, index: int) -> bool:
        """Whether slot ``index`` holds a complete copy that must not be overwritten (call with
        the lock held)."""
        segment = pair.segments[index]
        if segment is None or segment.header is None:
            return False
        version = segment.header.version()
        return version in pair.retained or version in self._retained.get(job, ())

    def complete(self, slot: Slot, header: SnapshotHeader, *, verified: bool = False,
                 tags: Any = None) -> SnapshotHeader:
        """Seals the snapshot written into ``slot`` (it becomes (job, rank)'s latest); returns
        the sealed header.

        If ``header.blocks`` is empty the payload checksums are computed here (and the
        :attr:`tagger` tags the blocks); if it holds checksums (a replica received from a
        peer) the payload is verified against them, unless ``verified``: the daemon itself
        checked every block as it wrote them (a fetch from peers), and nothing else has the
        slot. ``tags``: the block tags the copy came with (checked on the wire), kept with it
        (``SnapshotView.tags``).

        Raises:
            StaleSlot: the slot was reserved again, grown or removed since.
            CorruptSnapshot: the payload does not match the given checksums.
            ValueError: the header is for another job/rank or larger than the slot.
        """
        if (header.job, header.rank) != (slot.job, slot.rank):
            raise ValueError(f"header for {header.job} rank {header.rank} given for a slot of "
                             f"{slot.job} rank {slot.rank}")
        if header.layout.total_size > slot.capacity:
            raise ValueError(f"snapshot of {header.layout.total_size} bytes exceeds the "
                             f"{slot.capacity}-byte slot")
        with self._lock:
            segment = self._reserved_segment(slot)
        # Checksumming runs outside the lock: other ranks keep reserving meanwhile.
        if header.blocks:
            if not verified:
                verify_payload(segment.view, header)
            write_header(segment.view, header)
            sealed = header
        else:
            sealed = seal(segment.view, header)
            if self.tagger is not None and not slot.newest:  # never pushed: no tags
                lay = sealed.layout
                tags = self.tagger(segment.view,
                                   [lay.block_range(i) for i in range(lay.num_blocks)])
        with self._lock:
            # Re-checked: a new reservation of the same rank may have taken the slot meanwhile.
            self._reserved_segment(slot)
            pair = self._pairs[(slot.job, slot.rank)]
            segment.header, segment.tags = sealed, tags
            if slot.newest:
                pair.reserved_newest = None
            else:
                pair.latest, pair.reserved = pair.segments.index(segment), None
        return sealed

    def handover(self, slot: Slot,
                 mapped: set[tuple[int, int]] = frozenset()) -> tuple[tuple[int, int], int | None]:
        """What a worker needs to write into a reserved slot: the file's identity (device,
        inode) and a new read-write descriptor of it (the caller closes it) — or None instead
        when the identity is in ``mapped``, the files the worker says it still maps (from a
        descriptor handed over before), which spares a descriptor per snapshot.

        Raises:
            StaleSlot: the slot was reserved again, grown or removed since.
        """
        with self._lock:
            segment = self._reserved_segment(slot)
            fd = None if segment.identity in mapped else segment.descriptor(writable=True)
            return segment.identity, fd

    def _reserved_segment(self, slot: Slot) -> Segment:
        pair = self._pairs.get((slot.job, slot.rank))
        index = None if pair is None else pair.reserved_newest if slot.newest else pair.reserved
        segment = (None if pair is None or index is None
                   else (pair.newest if slot.newest else pair.segments)[index])
        if segment is None or segment.ticket != slot.ticket or segment.path != slot.path:
            raise StaleSlot(f"{slot.job} rank {slot.rank}: slot {slot.path} is no longer reserved "
                            "for this snapshot")
        return segment

    def latest(self, job: str, rank: int, *, pin: bool = False, verify: bool = False,
               version: tuple[int, int] | None = None,
               newest: bool = False) -> SnapshotView | None:
        """The latest complete snapshot of (job, rank), or None.

        Args:
            pin: keep the slot from being reused until the view is released.
            verify: re-check the payload checksums now (raises CorruptSnapshot).
            version: the complete snapshot with this (generation, step) instead, which may be
                the previous one (see :meth:`versions`); None when it is not held.
            newest: look for ``version`` in the newest pair too (a restore on this node;
                replication and persistence see the commit slots only).
        """
        with self._lock:
            pair = self._pairs.get((job, rank))
            if pair is None or pair.latest is None:
                return None
            segment = pair.segments[pair.latest]
            if version is not None:
                segment = next((s for s in pair.held(newest)
                                if s.header.version() == tuple(version)), None)
                if segment is None:
                    return None
            assert segment is not None and segment.header is not None
            if pin:
                segment.pins += 1
        try:
            return SnapshotView(segment, self._unpin if pin else None, verify)
        except SnapshotError:
            if pin:
                self._unpin(segment)
            raise

    def versions(self, job: str, rank: int, *, newest: bool = False) -> list[tuple[int, int]]:
        """(generation, step) of every complete snapshot of (job, rank) held, newest first:
        the latest and, until the next reserve takes its slot, the one before it; with
        ``newest`` those of the newest pair too (for a restore on this node)."""
        with self._lock:
            pair = self._pairs.get((job, rank))
            held = [] if pair is None else [s.header.version()  # type: ignore[union-attr]
                                            for s in pair.held(newest)]
        return sorted(held, reverse=True)

    def _unpin(self, segment: Segment) -> None:
        with self._lock:
            segment.pins = max(0, segment.pins - 1)

    # -- housekeeping ---------------------------------------------------------------------

    def _slot_bytes(self) -> int:
        return sum(s.capacity for p in self._pairs.values() for s in (*p.segments, *p.newest)
                   if s is not None)

    def _held(self) -> int:
        return self._slot_bytes() + self.scratch.held_locked()

    def bytes_held(self) -> int:
        """Bytes of slot files this store holds."""
        with self._lock:
            return self._held()

    def holdings(self) -> list[tuple[str, int, int, int]]:
        """(job, rank, generation, step) of every latest complete snapshot held."""
        with self._lock:
            latest = [(key, p.segments[p.latest]) for key, p in sorted(self._pairs.items())
                      if p.latest is not None]
            return [(job, rank, s.header.generation, s.header.step)
                    for (job, rank), s in latest if s is not None and s.header is not None]

    def _drop(self, keys: list[tuple[str, int]]) -> None:
        """Forgets these (job, rank)s and deletes their slot files (call with the lock held)."""
        for key in keys:
            pair = self._pairs.pop(key, None)
            for seg in () if pair is None else (*pair.segments, *pair.newest):
                if seg is not None:
                    seg.destroy(self._fd)

    def remove(self, job: str, rank: int) -> None:
        """Drops one (job, rank)'s slots (e.g. a replica this node no longer holds)."""
        with self._lock:
            self._drop([(job, rank)])
            shutil.rmtree(self._dir(job, rank), ignore_errors=True, dir_fd=self._fd)

    def remove_job(self, job: str) -> None:
        """Drops every slot of ``job`` and its directory."""
        self._dir(job, 0)
        with self._lock:
            self._retained.pop(job, None)
            self._drop([k for k in self._pairs if k[0] == job])
            self.scratch.drain_locked(job)  # kept for its next restore
            shutil.rmtree(job, ignore_errors=True, dir_fd=self._fd)

    def close(self, *, unlink: bool = True) -> None:
        """Unmaps everything; with ``unlink`` (the default) also deletes every slot file and the
        root directory. ``unlink=False`` leaves the files for a restarted daemon to :meth:`scan`."""
        with self._lock:
            if unlink:
                self._drop(list(self._pairs))
            for seg in (s for p in self._pairs.values() for s in (*p.segments, *p.newest)
                        if s is not None):
                seg.unmap()
            self._pairs.clear()
            self.scratch.drain_locked()  # partial copies never outlive the daemon
            fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            if unlink:
                for name in os.listdir(fd):
                    remove_at(fd, name)
                if same_file(os.fstat(fd), self.root):  # not a successor's root
                    os.rmdir(self.root)
        except OSError as exc:
            log.warning("cannot remove the shm dir %s: %s", self.root, exc)
        finally:
            os.close(fd)

    def scan(self) -> ScanResult:
        """Adopts the slot files found under the root (a restarted daemon's first call):
        every verified segment in its own job/rank directory, the two newest per rank; removes
        everything else (:func:`~elasticd.store.shm_scan.scan_root`).

        Raises:
            RuntimeError: the store is already in use.
        """
        with self._lock:
            if self._pairs:
                raise RuntimeError("scan() must run before the store is used")
            found, result = scan_root(self._fd, self.root)
            for key, (next_serial, segments) in found.items():
                pair = self._pairs[key] = _Pair(next_serial=next_serial, latest=0)
                pair.segments[:len(segments)] = segments
        return result
