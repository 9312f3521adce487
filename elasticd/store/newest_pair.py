"""The newest pair of a rank's slots: two more slots per local rank of a job that keeps it
(in-process jobs), for this node's own restore only (why and what it costs: docs/replication.md,
"The newest pair").

The store's part that picks, sizes and swaps those slots; every call runs under the store's
lock. Its copies are never retained, replicated nor persisted. Two rules make a rank hold its
last two complete steps whatever the commit slots do:

* a snapshot the commit slots refuse goes into the newest pair's slot that does not hold the
  rank's newest complete copy (:meth:`NewestPairs.reserve`);
* a commit slot's latest copy about to be overwritten (the other commit slot holds a copy that
  must stay) moves into the newest pair, and that pair's free slot takes its place
  (:meth:`NewestPairs.set_aside`): the commit slots see what they saw without the pair.

No torch here: this is daemon code.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from elasticd.snapshot.format import invalidate
from elasticd.snapshot.segment import Segment
from elasticd.store.api import OverBudget, Slot, SlotBusy

if TYPE_CHECKING:
    from elasticd.store.shm import SlotStore, _Pair

__all__ = ["NewestPairs", "room_for", "spare"]

log = logging.getLogger(__name__)


def _version_of(segment: Segment | None) -> tuple[int, int]:
    return (-1, -1) if segment is None or segment.header is None else segment.header.version()


def room_for(store: SlotStore, more: int, what: str) -> None:
    """Lets go of kept scratch for ``more`` bytes of slots, then refuses them over the node's
    cap with :class:`OverBudget` (nothing changed). Called with the store's lock held."""
    store.scratch.make_room_locked(more)
    held = store._held()
    if store.cap_bytes is not None and held + more > store.cap_bytes:
        raise OverBudget(f"{what} needs {more} more bytes of slots; {held} of the "
                         f"{store.cap_bytes}-byte cap are held")


def spare(pair: _Pair) -> int | None:
    """The newest pair's slot a snapshot may go into: not pinned, and not holding the rank's
    newest complete copy (of either role), which stays until a newer one is complete; an
    empty one first, then the older copy. None when there is none."""
    top = max(pair.held(newest=True), key=_version_of, default=None)
    free = [i for i, s in enumerate(pair.newest) if s is None or (s is not top and not s.pins)]
    return min(free, key=lambda i: (pair.newest[i] is not None, _version_of(pair.newest[i])),
               default=None)


class NewestPairs:
    """The newest pairs of one :class:`~elasticd.store.shm.SlotStore` (its part; see the module
    doc). Every method is called with the store's lock held."""

    def __init__(self, store: SlotStore) -> None:
        self._store = store

    def reserve(self, job: str, rank: int, pair: _Pair, nbytes: int, capacity: int) -> Slot:
        """``SlotStore.reserve(newest=True)``.

        Raises:
            SlotBusy: both slots are pinned, or one is and the other holds the newest copy.
            OverBudget: the slot does not fit the node's cap (nothing changed).
        """
        index = spare(pair)
        if index is None:
            raise SlotBusy(f"{job} rank {rank}: the newest pair's free slot is pinned by a reader")
        current = self._fit(job, rank, pair, index, nbytes, capacity)
        invalidate(current.view)
        current.header, current.tags = None, None
        self._store._tickets += 1
        current.ticket = self._store._tickets
        pair.reserved, pair.reserved_newest = None, index
        return Slot(job, rank, current.path, current.capacity, current.view, current.ticket,
                    newest=True)

    def set_aside(self, job: str, rank: int, pair: _Pair, index: int, nbytes: int,
                  capacity: int) -> None:
        """Moves commit slot ``index``'s copy (the latest, about to be overwritten) into the
        newest pair, and a free slot of the newest pair into its place. When none is free or
        fits the cap the copy is overwritten as without the pair. Both files are renamed for
        their new role first, the leaving copy first: a daemon that dies between the renames
        finds the commit slots' copies that must stay as before (scan adopts ``N.slot``)."""
        free_index = spare(pair)
        moving = pair.segments[index]
        if free_index is None or moving is None or moving.header is None:
            return
        try:
            free = self._fit(job, rank, pair, free_index, nbytes, capacity)
        except OverBudget as exc:
            log.debug("%s rank %d: the copy to overwrite is not set aside: %s", job, rank, exc)
            return
        self._rename(job, rank, pair, moving, "newest")
        self._rename(job, rank, pair, free, "slot")
        pair.newest[free_index], pair.segments[index] = moving, free
        if pair.reserved_newest == free_index:
            pair.reserved_newest = None

    def _fit(self, job: str, rank: int, pair: _Pair, index: int, nbytes: int,
             capacity: int) -> Segment:
        """The newest pair's slot ``index``, (re)allocated to hold ``nbytes`` within the cap.

        Raises:
            OverBudget: it does not fit (nothing changed).
        """
        store = self._store
        current = pair.newest[index]
        if current is not None and current.capacity >= nbytes:
            return current
        freed = 0 if current is None else current.capacity
        room_for(store, capacity - freed,
                 f"{job} rank {rank}: the newest pair's slot of {nbytes} bytes")
        if current is not None:
            current.destroy(store._fd)
            pair.newest[index] = None
        pair.newest[index] = store._allocate(job, rank, pair, capacity, role="newest")
        return pair.newest[index]

    def _rename(self, job: str, rank: int, pair: _Pair, segment: Segment, role: str) -> None:
        store = self._store
        name = f"{store._dir(job, rank)}/{pair.next_serial}.{role}"
        pair.next_serial += 1
        os.rename(segment.name, name, src_dir_fd=store._fd, dst_dir_fd=store._fd)
        segment.name, segment.path = name, os.path.join(store.root, name)
