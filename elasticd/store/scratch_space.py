"""The store's restore scratch: the segment files partial copies are made in, under the caps.

:mod:`elasticd.store.scratch` keeps the accounts (who holds which bytes, whether more fits) and
:mod:`elasticd.store.scratch_pool` the released segments kept for their job's next restore;
this part makes and deletes the files. It lives at the slot store's root and counts against
the node's cap together with the slots, so it runs under the store's lock and asks the store
for the bytes its slots hold: the store owns it as ``SlotStore.scratch``.
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Callable

from elasticd.clock import Clock
from elasticd.snapshot.segment import PAGE, Segment
from elasticd.store.api import OverBudget
from elasticd.store.scratch import ScratchAccounts, ScratchReservation

__all__ = ["ScratchSpace"]


class ScratchSpace:
    """Scratch segments of the slot store rooted at ``root_fd``.

    Args:
        root_fd, root: the store's root directory (a descriptor, and its path for messages).
        lock: the store's lock, held by every call here (the node's cap counts slots and
            scratch together); the ``*_locked`` calls expect the caller to hold it.
        slot_bytes: bytes of the store's slots (called with the lock held).
        cap_bytes: the node's cap (None: none); job_cap, keep: see :class:`ScratchAccounts`.
        check_job: raises ValueError for a job name the store would refuse.
        clock: times how long released segments are kept.
    """

    def __init__(self, root_fd: int, root: str, lock: threading.Lock,
                 slot_bytes: Callable[[], int], cap_bytes: int | None, job_cap: int | None,
                 keep: float, check_job: Callable[[str], object], clock: Clock) -> None:
        self._fd, self._root, self._lock = root_fd, root, lock
        self._slot_bytes, self._cap, self._check_job = slot_bytes, cap_bytes, check_job
        self._clock = clock
        self._accounts = ScratchAccounts(job_cap, keep)
        #: What each live segment's copy is of (``new``'s ``of``), for the pool when dropped.
        self._of: dict[Segment, object] = {}
        #: What :meth:`new` handed out: a kept segment whose last copy was of the same rank
        #: (``same``), another kept one (``other``: a copy that lands in pages another rank's
        #: copy touched, the regression a bench reads this for), a kept one set aside again
        #: for no copy yet (``aside``: ``scratch_pool.prefill`` at a membership change), or a
        #: new file (``new``).
        self.handed = {"same": 0, "other": 0, "aside": 0, "new": 0}

    @property
    def job_cap(self) -> int | None:
        """Most bytes of scratch one job may hold here (None: no per-job cap)."""
        return self._accounts.job_cap

    def held(self, job: str | None = None) -> int:
        """Bytes of scratch and scratch bookings held (for ``job``, or for every job)."""
        with self._lock:
            return self._accounts.held(job)

    def held_locked(self) -> int:
        """Bytes of scratch and bookings of every job (the lock held)."""
        return self._accounts.held()

    def new(self, nbytes: int, *, job: str,
            reservation: ScratchReservation | None = None, of: object = None) -> Segment:
        """A slot file outside every (job, rank) for a partial copy a restore of ``job`` reads
        once (:mod:`elasticd.store.scratch`), counted against the node's cap and ``job``'s
        until :meth:`drop`; it takes over ``reservation``'s booked bytes. Named
        ``.scratch-<random>`` at the root (``SlotStore.scan`` removes it after a crash). Only
        sized: the caller reserves each range before writing it (:meth:`Segment.reserve_range`),
        so a copy takes the memory of what it holds, reserved beside the transfers. Its pages
        are small ones even on a mount that gives huge pages (a fresh huge page the host took
        back after idle costs ~2 s per GiB at first touch, a small one ~0.5,
        bench/results/first_touch.json); one ``job`` released or set aside
        (:mod:`~elasticd.store.scratch_pool`) a moment ago is reused, its pages touched:
        first one that held a copy ``of`` the same (the old rank, when not None), whose
        touched pages are where this copy's blocks land.

        Raises:
            OverBudget: over the node's cap (or the filesystem is full); ScratchOverCap (a
                subclass): over ``job``'s.
        """
        capacity = -(-self._valid(job, nbytes) // PAGE) * PAGE
        with self._lock:
            self._expire()
            kept = self._accounts.kept.take(job, capacity, of)
            if kept is not None:
                segment, was = kept
                self.handed["aside" if of is None else "same" if was == of else "other"] += 1
                # Set aside again (``new`` without ``of``: scratch_pool.prefill at a membership
                # change), it keeps what it held, so the next copy of that rank still lands in
                # the pages it touched.
                of = was if of is None else of
            else:
                self._make_room(job, capacity, reservation)
                self._accounts.check(job, capacity, self._node_held(), self._cap, reservation)
                # Unique across daemons: a crashed one's leftover (removed by scan) never clashes.
                name = f".scratch-{uuid.uuid4().hex[:16]}"
                try:
                    segment = Segment.allocate(self._fd, name, os.path.join(self._root, name),
                                               capacity, reserve=False, small_pages=True)
                except OSError as exc:
                    raise OverBudget(
                        f"cannot allocate {capacity} bytes in {self._root}: {exc}") from exc
                self.handed["new"] += 1
            self._accounts.booked.pop(reservation, None)  # type: ignore[arg-type]
            self._accounts.segments[segment] = job
            self._of[segment] = of
            return segment

    def drop(self, segment: Segment) -> None:
        """Lets go of a :meth:`new` file: kept a while for its job's next restore, counted
        against the job's cap (:mod:`~elasticd.store.scratch_pool`), else deleted, emptied
        first: its memory comes back now even if a worker still maps it (its reads fault)."""
        with self._lock:
            job = self._accounts.segments.pop(segment, None)
            of = self._of.pop(segment, None)
            if job is not None and not self._accounts.kept.put(job, segment,
                                                               self._clock.monotonic(), of):
                self._destroy([segment])
            self._expire()

    def sweep(self) -> None:
        """Deletes the released scratch segments kept past their time (called periodically)."""
        with self._lock:
            self._expire()

    def reserve(self, job: str, nbytes: int) -> ScratchReservation:
        """Books ``nbytes`` of ``job``'s scratch cap and of the node's cap for a partial copy
        not made yet: it counts against both from now until it is handed to :meth:`new`
        (``reservation=``) or released (:meth:`ScratchReservation.release`).

        Raises:
            OverBudget: over the node's cap; ScratchOverCap: over ``job``'s.
        """
        self._valid(job, nbytes)
        with self._lock:
            self._make_room(job, nbytes)
            self._accounts.check(job, nbytes, self._node_held(), self._cap)
            booking = ScratchReservation(job, nbytes, self._unbook)
            self._accounts.booked[booking] = None
            return booking

    def make_room_locked(self, nbytes: int) -> None:
        """Deletes kept segments, oldest first, until ``nbytes`` more of slots fit under the
        node's cap (the lock held): memory kept for a next restore goes before a snapshot is
        refused."""
        self._make_room(None, nbytes)

    def drain_locked(self, job: str | None = None) -> None:
        """Deletes the segments kept for ``job``'s next restore (the job left the node), or,
        for None, every scratch segment (the store closes: partial copies never outlive the
        daemon). The lock held."""
        if job is None:
            self._destroy([*self._accounts.segments, *self._accounts.kept.drain()])
            self._accounts.segments.clear()
            self._of.clear()
        else:
            self._destroy(self._accounts.kept.drain(job))

    def _valid(self, job: str, nbytes: int) -> int:
        self._check_job(job)
        if type(nbytes) is not int or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive integer, got {nbytes!r}")
        return nbytes

    def _node_held(self) -> int:
        return self._slot_bytes() + self._accounts.held()

    def _make_room(self, job: str | None, nbytes: int,
                   reservation: ScratchReservation | None = None) -> None:
        self._destroy(self._accounts.make_room(job, nbytes, self._node_held(), self._cap,
                                               reservation))

    def _expire(self) -> None:
        self._destroy(self._accounts.kept.expired(self._clock.monotonic()))

    def _destroy(self, segments: list[Segment]) -> None:
        for segment in segments:  # emptied first: see drop
            segment.destroy(self._fd, reclaim=True)

    def _unbook(self, booking: ScratchReservation) -> None:
        with self._lock:
            self._accounts.booked.pop(booking, None)
