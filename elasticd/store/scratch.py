"""Scratch: the partial copies a restore reads once, held per job under a byte cap.

After a change of world size a new rank needs some rows of an old rank's shard; a
``ckpt_fetch`` with ``need`` copies the blocks holding them into a scratch segment of the
store (never a snapshot of it), which the worker maps and then releases. A worker asks for
scratch, so a job must not be able to hold it without bound (issue 26, finding 6: each such
fetch made a segment pinned until ``pin_ttl``, and the node's memory cap is off by default
and shared with other jobs' replicas). Hence:

* a per-job byte cap: a job's scratch segments and its reservations together stay within it;
  a segment or a reservation that would go over is refused with one line
  (:class:`~elasticd.store.api.ScratchOverCap`, which the service counts and reports);
* a dropped segment is emptied (truncated) before it is unlinked, so its memory comes back at
  once even if a worker kept its mapping past its ``ckpt_release`` (or its pin's expiry); one
  kept a while for the job's next restore (issue 30, :mod:`~elasticd.store.scratch_pool`)
  stays counted against the job's cap until then, and gives way before anything is refused;
* one live segment per (job, rank) and requesting worker, which the service keeps
  (:mod:`elasticd.store.service_restores`): a worker that asks again for a shard it holds a
  partial copy of gives the old copy back first.

A *reservation* books bytes of a job's cap (and of the node's) for scratch not made yet: a
restore's scratch set up ahead of need counts from the moment it is booked. This module only
keeps the accounts; :class:`~elasticd.store.scratch_space.ScratchSpace` (``SlotStore.scratch``)
makes and drops the segments under the store's lock, and offers the calls (``new``, ``drop``,
``reserve``).
"""

from __future__ import annotations

from typing import Callable

from elasticd.snapshot.segment import Segment
from elasticd.store.api import OverBudget, ScratchOverCap
from elasticd.store.scratch_pool import KEEP_SECONDS, ScratchPool

__all__ = ["ScratchAccounts", "ScratchReservation"]


class ScratchReservation:
    """Bytes of a job's scratch cap booked ahead of a partial copy
    (:meth:`ScratchSpace.reserve <elasticd.store.scratch_space.ScratchSpace.reserve>`).

    Pass it to ``ScratchSpace.new(..., reservation=)``, which turns the booking into the
    segment, or :meth:`release` it; releasing twice, or after it was used, does nothing.
    """

    def __init__(self, job: str, nbytes: int, release: Callable[["ScratchReservation"], None]):
        self.job, self.nbytes = job, nbytes
        self._release = release

    def release(self) -> None:
        self._release(self)


class ScratchAccounts:
    """Who holds which scratch bytes, and whether more fits (call under the store's lock).

    Args:
        job_cap: most bytes of scratch segments (live or kept), and reservations one job may
            hold on this node; None for no per-job cap.
        keep: seconds a released segment is kept, its pages touched, for its job's next
            restore (:mod:`elasticd.store.scratch_pool`; 0: none is).
    """

    def __init__(self, job_cap: int | None, keep: float = KEEP_SECONDS) -> None:
        if job_cap is not None and job_cap < 0:
            raise ValueError(f"job_cap must be >= 0 or None, got {job_cap}")
        self.job_cap = job_cap
        self.segments: dict[Segment, str] = {}  # segment -> its job
        self.booked: dict[ScratchReservation, None] = {}  # open reservations, in order
        self.kept = ScratchPool(keep)  # released (or set aside), kept for their job

    def held(self, job: str | None = None) -> int:
        """Bytes of scratch segments, live and kept, and open reservations (of ``job``, or of
        every job)."""
        return (sum(s.capacity for s, j in self.segments.items() if job in (None, j))
                + sum(r.nbytes for r in self.booked if job in (None, r.job))
                + self.kept.held(job))

    def make_room(self, job: str | None, nbytes: int, node_held: int, node_cap: int | None,
                  reservation: ScratchReservation | None = None) -> list[Segment]:
        """The kept segments to delete, oldest first, so that ``nbytes`` more (for ``job``'s
        scratch; None: for slots) fit under the node's cap and ``job``'s, taken out (the
        store destroys them): memory kept for a next restore goes before anything is refused.
        """
        gone: list[Segment] = []
        booked = reservation.nbytes if reservation in self.booked else 0
        while True:
            over_node = node_cap is not None and node_held - booked + nbytes > node_cap
            over_job = (job is not None and self.job_cap is not None
                        and self.held(job) - booked + nbytes > self.job_cap)
            segment = (self.kept.pop_oldest(None if over_node else job)
                       if over_node or over_job else None)
            if segment is None:
                return gone
            gone.append(segment)
            node_held -= segment.capacity

    def check(self, job: str, nbytes: int, node_held: int, node_cap: int | None,
              reservation: ScratchReservation | None = None) -> None:
        """Refuses ``nbytes`` more for ``job`` over its cap or the node's (``reservation``'s
        bytes, which they would replace, are not counted twice).

        Args:
            node_held: bytes the store holds now, this scratch included; node_cap: its cap.

        Raises:
            OverBudget: over the node's cap. ScratchOverCap: over ``job``'s; either one line.
        """
        booked = reservation.nbytes if reservation in self.booked else 0
        held = node_held - booked
        if node_cap is not None and held + nbytes > node_cap:
            raise OverBudget(f"a partial copy (restore scratch) of {nbytes} bytes for {job} does "
                             f"not fit: {held} of the node's {node_cap}-byte cap are held")
        held = self.held(job) - booked
        if self.job_cap is not None and held + nbytes > self.job_cap:
            raise ScratchOverCap(
                f"job {job}: {nbytes} more bytes of restore scratch would hold {held + nbytes}, "
                f"over its cap of {self.job_cap} on this node (scratch_cap_mib)")
