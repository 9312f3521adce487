"""Restore scratch a job let go of, kept with its pages touched for the job's next restore.

A restore at another world size lands the rows a new rank needs in scratch segments
(:meth:`ScratchSpace.new <elasticd.store.scratch_space.ScratchSpace.new>`), which the worker
maps and releases once it has loaded them. Fresh memory costs its first touch: ~0.5 s per GiB
on small pages here, ~2 s per GiB on huge pages the host took back after idle
(bench/results/first_touch.json), as much as the transfer itself. A restore often comes again
soon (a round aborted and retried, a second failure while the job recovers), so a released
segment is kept, its pages still touched, for ``keep`` seconds, for the same job only: it
holds the bytes of the copy it held, which no other job may map. :func:`prefill` sets such
segments aside when a membership change is first seen, touched behind the detection and the
rendezvous. Kept segments count against the job's scratch cap and the node's cap like live
ones (:class:`~elasticd.store.scratch.ScratchAccounts` holds the pool); the store deletes
them (emptied, as any dropped scratch) first when a partial copy, a booking or a slot needs
the room, when the job leaves the node, and when they expire.

Bookkeeping only: the store makes, maps and destroys the segments under its lock; this picks
which one to reuse and which have expired.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

#: Seconds a released scratch segment stays for its job's next restore.
KEEP_SECONDS = 30.0


class ScratchPool:
    """Released scratch segments by job, each with the time it was released.

    Args:
        keep: seconds a segment is kept (0: none is; the store destroys it at once).
    """

    def __init__(self, keep: float = KEEP_SECONDS) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0 seconds, got {keep}")
        self.keep = keep
        #: job -> [(segment, time released, what its last copy was of)]
        self._kept: dict[str, list[tuple[Any, float, Any]]] = {}

    def put(self, job: str, segment: Any, now: float, of: Any = None) -> bool:
        """Keeps ``segment`` for ``job``; ``of`` names what the copy it held was of (the old
        rank, :meth:`take`). False when nothing is kept (``keep`` is 0)."""
        if self.keep <= 0:
            return False
        self._kept.setdefault(job, []).append((segment, now, of))
        return True

    def take(self, job: str, nbytes: int, of: Any = None) -> tuple[Any, Any] | None:
        """A segment kept for ``job``, and what its last copy was of (for ``of`` None, a
        segment set aside, which keeps it), that holds ``nbytes`` and not more than twice that (a
        bigger one would hold memory the copy does not need), taken out; or None. One whose
        last copy was ``of`` the same (not None) first: the next restore of the same old
        rank needs the same blocks, whose pages that one has touched already (another's
        would be touched again where the ranges differ, and grow: old ranks 0 and 1 of a
        world of 3 are the same size, and a worker lets go of them in the other order, so
        each timed round after the first took the other rank's). Then the smallest."""
        fits = [(kept_of != of or of is None, s.capacity, i)
                for i, (s, _, kept_of) in enumerate(self._kept.get(job, ()))
                if nbytes <= s.capacity <= 2 * nbytes]
        if not fits:
            return None
        segment, _, kept_of = self._kept[job].pop(min(fits)[2])
        return segment, kept_of

    def expired(self, now: float) -> list[Any]:
        """The segments kept longer than ``keep``, taken out."""
        out = []
        for job in list(self._kept):
            out += [s for s, at, _ in self._kept[job] if now - at >= self.keep]
            self._kept[job] = [entry for entry in self._kept[job] if now - entry[1] < self.keep]
            if not self._kept[job]:
                del self._kept[job]
        return out

    def drain(self, job: str | None = None) -> list[Any]:
        """Every segment kept (for ``job``, or for every job), oldest first, taken out."""
        jobs = list(self._kept) if job is None else [job]
        kept = sorted((entry for j in jobs for entry in self._kept.pop(j, ())),
                      key=lambda entry: entry[1])
        return [s for s, _, _ in kept]

    def pop_oldest(self, job: str | None = None) -> Any | None:
        """The segment released longest ago (of ``job``, or of any job), taken out; None when
        none is kept."""
        entries = [(at, j, i) for j, kept in self._kept.items() if job in (None, j)
                   for i, (_, at, _) in enumerate(kept)]
        if not entries:
            return None
        _, j, i = min(entries)
        segment, _, _ = self._kept[j].pop(i)
        if not self._kept[j]:
            del self._kept[j]
        return segment

    def held(self, job: str | None = None) -> int:
        """Bytes of the segments kept (for ``job``, or for every job)."""
        return sum(s.capacity for j, kept in self._kept.items() if job in (None, j)
                   for s, _, _ in kept)


def prefill(store: Any, job: str, sizes: list[int]) -> int:
    """Sets scratch aside in ``store`` (a :class:`~elasticd.store.shm.SlotStore`) for a
    restore of ``job`` expected soon (its membership changed): a segment of each size, kept
    for the job as a released one is (counted against its cap and the node's), its pages
    touched by a thread of its own, so that the restore's partial copies land in memory
    touched while the cluster detects the failure and forms the new round. What does not fit
    under the caps is left out. Returns the bytes set aside."""
    from elasticd.store.api import OverBudget

    made = []
    for nbytes in sizes:
        try:
            made.append(store.scratch.new(nbytes, job=job))
        except OverBudget as exc:
            log.info("%s: no more scratch set aside for the next restore: %s", job, exc)
            break
    for segment in made:
        store.scratch.drop(segment)  # kept for the job, pages not touched yet
    if made:
        threading.Thread(target=touch, args=(made,), daemon=True,
                         name=f"elasticd-scratch-{job}").start()
    return sum(s.capacity for s in made)


def touch(segments: list[Any]) -> None:
    """Faults every page of ``segments`` in (scratch set aside ahead of a restore,
    :func:`prefill`); a segment deleted meanwhile, or a mount with no room left, ends it (the
    restore reserves what it writes anyway)."""
    for segment in segments:
        try:
            segment.reserve_range(0, segment.capacity)
        except (OSError, ValueError) as exc:
            log.info("setting scratch aside stopped at %s: %s", segment.path, exc)
            return
