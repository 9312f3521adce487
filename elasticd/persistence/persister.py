"""The daemon's asynchronous flusher of complete snapshots to the persistent tier.

The checkpoint service offers steps — with peer replication, each committed step as this node
learns it; without, each step every local rank completed — and the persister decides whether it
is due (every K steps, or T seconds after the last flush). If so a single background thread
copies this node's ranks out of shared memory into private buffers (the slots are pinned only for
that memcpy, so the bytes cannot change under it), writes them to disk and completes the step's
manifest when it can. The private buffers, one snapshot's worth per local rank, are kept between
flushes and are daemon memory outside the slot store's cap. The queue is bounded: a step offered
while the writer is still busy is skipped and counted, never queued without bound and never
waited for — the training loop must not feel a slow disk — except a step offered with a way to
take it again (``retry``), which waits, one per job, unpinned, for the writer to be free, and is
taken then if its copies are still held (a committed step is: every node keeps it until the next
commit).

Several nodes flush the same step into a shared directory; :mod:`~elasticd.persistence.tier`
makes that race-free, and a step is complete only once every rank is written, so every node must
pick the same steps: ``every_steps`` is decided on the commits, which every node learns alike
(not on its own snapshots, which a skip moves), and ``every_seconds`` in periods of the wall
clock since the epoch (not T after this node's last flush, which keeps two nodes a commit apart
for good); docs/operations.md (``persist_every_steps``) says where nodes can still differ.

A node that writes its ranks of a step before its peers do finds no manifest after its flush
(the last writer completes the step), so it checks that step again at its next flush of the job;
and :meth:`Persister.listed` has the writer list the tier for a job on request, so that the
newest complete step (:meth:`Persister.persisted`) is known truly before a job is called
``persist_stale`` (:mod:`~elasticd.store.protection`) — on the writer's thread, never on the
caller's: a hung shared filesystem must not stall the daemon's cycle. No torch.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np

from elasticd.clock import Clock, SystemClock
from elasticd.persistence.tier import Manifest, Tier

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Flushed:
    """What one flush did, for the ``on_flushed`` callback; ``error``: why it failed ("" when
    it did not)."""

    job: str
    version: tuple[int, int]
    nbytes: int
    seconds: float
    error: str = ""


@dataclasses.dataclass
class _Seen:
    """What the persister knows of other nodes' completions (see the module docstring)."""

    #: job -> the last step this node flushed that was not complete yet (peers still
    #: writing): checked again at the job's next flush. The writer thread's only.
    unconfirmed: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    #: job -> when the writer last listed its steps (under the persister's lock).
    listed_at: dict[str, float] = dataclasses.field(default_factory=dict)
    #: jobs whose listing is queued (under the persister's lock).
    listing: set[str] = dataclasses.field(default_factory=set)


class Persister:
    """Flushes complete snapshots to ``root`` in the background.

    Args:
        keep: complete steps kept per job (older ones are pruned after each flush).
        every_steps: flush steps that are multiples of this (or, when a multiple's snapshot was
            skipped, the first step offered after it).
        every_seconds: flush the first step offered in each period of this many seconds of
            the wall clock (see the module docstring).
            With neither, every step offered is flushed (when the writer is free).
        node_id: recorded in the markers.
        on_flushed: called on the writer thread after each flush (metrics, events).
    """

    def __init__(self, root: str, keep: int = 3, every_steps: int | None = None,
                 every_seconds: float | None = None, *, node_id: str = "",
                 clock: Clock | None = None, on_flushed: Callable[[Flushed], None] | None = None
                 ) -> None:
        if type(keep) is not int or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        if every_steps is not None and (type(every_steps) is not int or every_steps < 1):
            raise ValueError(f"every_steps must be an integer >= 1 or None, got {every_steps!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be > 0 or None, got {every_seconds!r}")
        self.tier = Tier(root, node_id)
        self.root, self.keep = root, keep
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.clock = clock or SystemClock()
        self.on_flushed = on_flushed
        self._queue: "queue.Queue[Any]" = queue.Queue()  # bounded by _pending, in submit
        self._lock = threading.Lock()
        self._last_period: dict[str, int] = {}  # job -> the wall-clock period last flushed
        self._offered_step: dict[str, int] = {}  # job -> the last step due() was asked about
        self._persisted: dict[str, tuple[int, int]] = {}
        self._seen = _Seen()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        # job -> (retry, uid): a step offered while the writer was busy, taken again once it
        # is free (see submit); a newer one replaces it.
        self._waiting: dict[str, tuple[Callable[[], Sequence[Any] | None], int | None]] = {}
        self._buffers: list[np.ndarray] = []
        self._thread = threading.Thread(target=self._run, name="elasticd-persist", daemon=True)
        self._closed = False
        self._thread.start()

    # -- the service's side -------------------------------------------------------------

    def due(self, job: str, step: int) -> bool:
        """Whether a step of ``job`` should be flushed (the policy; nothing is reserved)."""
        if self.every_steps is None and self.every_seconds is None:
            return True
        if self.every_steps is not None:
            # Due when a multiple of K lies in (previous step offered, step]: a multiple whose
            # snapshot was skipped (both slots held copies waiting for a commit) moves the flush
            # to the next step offered instead of leaving the tier a whole period behind (CI saw
            # steps 5, 10, 15 and 20 all skipped under a slow commit, and no tier step to fall
            # back on). Nodes that skipped the same steps still pick the same one.
            k = self.every_steps
            with self._lock:
                prev = self._offered_step.get(job, 0)
                self._offered_step[job] = step
            if step % k == 0 or (prev < step and step // k > prev // k):
                return True
        if self.every_seconds is not None:
            with self._lock:
                last = self._last_period.get(job)
            return last is None or self._period() > last
        return False

    def _period(self) -> int:
        return int(self.clock.wall() // self.every_seconds) if self.every_seconds else 0

    def submit(self, job: str, views: Sequence[Any], uid: int | None = None,
               retry: Callable[[], Sequence[Any] | None] | None = None) -> bool:
        """Queues this node's ranks of one step for flushing.

        Args:
            views: pinned :class:`~elasticd.store.shm.SnapshotView` objects of the same
                (generation, step), one per local rank. The persister releases them — at once
                when the step is skipped, else after writing.
            uid: owner to give the files to (the job's user) when the daemon runs as root.
            retry: pins the same step's views again (None when they are gone). Given, a step
                offered while the writer is busy waits for it (unpinned; a newer step of the
                job offered meanwhile replaces it) instead of being skipped, so that this node
                writes the step its peers write.

        Returns:
            False when the writer is busy (the views are released; the step is skipped, or
            waits when ``retry`` is given).
        """
        with self._lock:
            taken = not self._closed and not self._pending
            if taken:
                self._queue.put_nowait((job, list(views), uid))
                self._pending += 1
                self._last_period[job] = self._period()
            elif not self._closed and retry is not None:
                self._waiting[job] = (retry, uid)
                self._last_period[job] = self._period()
        if not taken:
            for v in views:
                v.release()
        return taken

    def persisted(self, job: str) -> tuple[int, int] | None:
        """The newest step of ``job`` this persister saw complete on disk."""
        with self._lock:
            return self._persisted.get(job)

    def listed(self, job: str, max_age: float) -> bool:
        """Whether the tier was listed for ``job`` (so :meth:`persisted` is the truth) at most
        ``max_age`` seconds ago; if not, queues a listing on the writer's thread (at most one
        per job) and returns False at once."""
        with self._lock:
            at = self._seen.listed_at.get(job)
            if at is not None and self.clock.monotonic() - at <= max_age:
                return True
            if job not in self._seen.listing and not self._closed:
                self._seen.listing.add(job)
                self._queue.put_nowait(job)
        return False

    def steps(self, job: str) -> list[Manifest]:
        """Complete steps of ``job`` on disk, newest first (lists the directory)."""
        found = self.tier.complete_steps(job)
        if found:
            self._note(job, found[0].version())
        return found

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued flush is written (and listing done); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0 and not self._seen.listing,
                                       timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finishes the queued flushes and stops the writer thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a step offered now is dropped, not late)."""
        return self._closed

    # -- the writer thread ----------------------------------------------------------------

    def _note(self, job: str, version: tuple[int, int]) -> None:
        with self._lock:
            if version > self._persisted.get(job, (-1, -1)):
                self._persisted[job] = version

    def _staging(self, index: int, size: int) -> np.ndarray:
        """A private buffer per local rank, kept between flushes (pages already touched)."""
        while len(self._buffers) <= index:
            self._buffers.append(np.empty(0, np.uint8))
        if len(self._buffers[index]) < size:
            self._buffers[index] = np.empty(size, np.uint8)
        return self._buffers[index]

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, str):  # a listing (see listed)
                self._list(item)
                continue
            while item is not None:
                self._flush(*item)
                item = self._next_waiting()

    def _list(self, job: str) -> None:
        try:
            # Read only: a manifest repaired here would not be given to the job's user.
            found = self.tier.complete_steps(job, repair=False)
            if found:
                self._note(job, found[0].version())
        except Exception:  # noqa: BLE001 — the writer thread must go on; the tier is unread
            log.exception("persistent tier: cannot list the steps of %s", job)
        with self._idle:
            self._seen.listing.discard(job)
            self._seen.listed_at[job] = self.clock.monotonic()
            self._idle.notify_all()

    def _next_waiting(self) -> tuple[str, list[Any], int | None] | None:
        """A step that waited for the writer, pinned again; None when none is left (a step
        whose copies went meanwhile is counted and dropped), and then the writer is free: in
        the same hold of the lock, so that no step is left waiting for a writer that idles."""
        while True:
            with self._idle:
                if not self._waiting:
                    self._pending -= 1
                    self._idle.notify_all()
                    return None
                job, (retry, uid) = self._waiting.popitem()
            try:
                views = retry()
            except Exception:  # noqa: BLE001 — the writer thread must go on
                log.exception("persist of %s: taking a waiting step again failed", job)
                views = None
            if views:
                return job, list(views), uid
            log.info("persist of %s: the step that waited for the writer is no longer held "
                     "here; the next due step is written instead", job)

    def _flush(self, job: str, views: list[Any], uid: int | None) -> None:
        start = self.clock.monotonic()
        version, nbytes, error = (-1, -1), 0, ""
        try:
            # Copy out at memory speed and let the slots go at once: a pin held for the whole
            # disk write would make the worker's next-but-one snapshot find its slot busy.
            copies = []
            for i, view in enumerate(views):
                size = view.header.layout.total_size
                buf = self._staging(i, size)
                np.copyto(buf[:size], np.frombuffer(view.buffer, np.uint8, size))
                copies.append((view.header, buf[:size]))
                view.release()
            for header, buf in copies:
                version = header.version()
                nbytes += self.tier.write_rank(header, buf, uid)["bytes"]
            self.tier.try_finish(job, version, uid)
            complete = self.tier.manifest(job, version) is not None
            # The previous step this node wrote first was completed by the last of its peers.
            previous = self._seen.unconfirmed.pop(job, None)
            if previous is not None and previous != version \
                    and self.tier.manifest(job, previous) is not None:
                self._note(job, previous)
            if complete:
                self._note(job, version)
                self.tier.prune(job, self.keep)
            else:
                self._seen.unconfirmed[job] = version
        except Exception as exc:  # noqa: BLE001 — a full disk must not kill the daemon
            error = f"{type(exc).__name__}: {exc}"
            log.warning("persist of %s step %s failed: %s", job, version, error)
        finally:
            for view in views:
                view.release()
        seconds = self.clock.monotonic() - start
        if self.on_flushed is not None:
            try:
                self.on_flushed(Flushed(job, version, nbytes, seconds, error))
            except Exception:  # noqa: BLE001
                log.exception("persist callback failed")
