"""What a node learns from a job's committed prefix in etcd: the committed record, the
snapshot grid, the ahead record and the coordinator's election key (four small keys, two of
which change per step), through one watch per job (:class:`CommittedPrefix`).

The part writes what it learns into the commit tracker's job states (``committed_rev``,
``ahead``, ``grid``) under the tracker's lock, tells the reporter of the election key and of
every committed record seen, and hands a resolved commit to the tracker's ``learn``; a record
whose holders come from a placement this node does not hold is read again beside its
placement (:meth:`CommittedPrefix.reread`).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator, EventType, Watch
from elasticd.coordination.keys import Keyspace
from elasticd.replication.commit import (
    Committed,
    Grid,
    committed_from,
    complaints,
    decode_committed,
    decode_grid,
)
from elasticd.replication.reporter import decode_ship

if TYPE_CHECKING:
    from elasticd.replication.reporter import Reporter
    from elasticd.replication.tracker import JobState

log = logging.getLogger(__name__)


class _PrefixKeys(NamedTuple):
    commit_grid: bytes
    coordinator: bytes
    commit_ahead: bytes
    committed: bytes


class CommittedPrefix:
    """Lists and watches each job's committed prefix for one node.

    Args:
        lock, jobs: the tracker's job states and the lock that guards them; a job absent
            from ``jobs`` is not followed (or no longer).
        reporter: told of the election key and of each committed record seen.
        learn: takes a commit record whose holders are resolved (the tracker's).
    """

    def __init__(self, coord: Coordinator, keys: Keyspace, lock: threading.Lock,
                 jobs: dict[str, "JobState"], reporter: "Reporter",
                 learn: Callable[[str, Committed], None], submit: Callable[..., None],
                 etcd_error: Callable[[str, Exception], None]) -> None:
        self.coord, self.keys, self.lock, self.jobs = coord, keys, lock, jobs
        self.reporter, self.learn, self.submit, self.etcd_error = (reporter, learn, submit,
                                                                   etcd_error)
        self.watches: dict[str, Watch] = {}  # guarded by ``lock``
        self._keys: dict[str, _PrefixKeys] = {}  # per job (a race builds the same twice)
        #: (job, key) -> watch events taken for it so far (guarded by ``lock``): a listing
        #: leaves alone a key the watch changed while the listing was being read.
        self._events: dict[tuple[str, bytes], int] = {}
        self.closed = False

    def grid(self, job: str) -> int:
        """Local snapshots of ``job`` are taken only at multiples of this step count (the
        job's :class:`~elasticd.replication.commit.Grid`, as the watch last brought it)."""
        with self.lock:
            st = self.jobs.get(job)
            return st.grid.grid if st is not None else 1

    def watch(self, job: str) -> None:
        """Lists the committed prefix and watches it from there on."""
        key = self.keys.replication(job).committed
        try:
            kvs, revision = self.coord.get_prefix(key)
            self._listed(job, kvs)
            watch = self.coord.watch_prefix(key, functools.partial(self._on_watch, job),
                                            revision + 1)
        except CoordinationError as exc:
            self.etcd_error("watch the committed record", exc)
            return
        with self.lock:
            if job in self.jobs and job not in self.watches and not self.closed:
                self.watches[job], watch = watch, None
        if watch is not None:
            watch.cancel()

    def reread(self, job: str) -> None:
        """Reads the committed prefix again (a watch error, a lagging watch)."""
        key = self.keys.replication(job).committed
        with self.lock:
            events = {k: n for k, n in self._events.items() if k[0] == job}
        try:
            kvs, _ = self.coord.get_prefix(key)
            with self.lock:
                st = self.jobs.get(job)
                placements = (st.placement, st.previous) if st is not None else ()
            # The record as the prefix read found it: its revision and its value agree.
            found = next((kv for kv in kvs if kv.key == key), None)
            committed = committed_from(self.coord, self.keys, job, found, placements)
        except CoordinationError as exc:
            self.etcd_error("read the committed record", exc)
            return
        self._listed(job, [kv for kv in kvs if kv.key != key], events)
        revision = found.mod_revision if found is not None else 0
        with self.lock:
            if job in self.jobs:
                self.jobs[job].committed_rev = revision
        self.reporter.committed_seen(job, committed, revision)
        if committed is not None and committed.resolved:
            self.learn(job, committed)

    def forget(self, job: str) -> None:
        """Stops following ``job`` (call once it left ``jobs``)."""
        with self.lock:
            watch = self.watches.pop(job, None)
            for k in [k for k in self._events if k[0] == job]:
                del self._events[k]
        self._keys.pop(job, None)
        if watch is not None:
            watch.cancel()

    def close(self) -> None:
        """Cancels every watch; none starts after this."""
        with self.lock:
            self.closed = True
            watches, self.watches = list(self.watches.values()), {}
        for watch in watches:
            watch.cancel()

    def _listed(self, job: str, kvs: list[Any],
                events: dict[tuple[str, bytes], int] | None = None) -> None:
        """Takes a listing of the committed prefix (keys absent from it are absent).

        ``events``: the watch's event counts when the listing was begun (None: no watch yet).
        A key the watch changed since is left as the watch said: the listing is older news
        (seen: the new coordinator's election key arrived by the watch, then a listing read
        just before it said the key was absent, and the node waited for a coordinator while
        the one in office waited for its report). Counts, not etcd revisions: those start
        again from 1 after etcd lost its data."""
        found = {kv.key: kv for kv in kvs}
        k = self.keys.replication(job)
        for key in (k.committed, k.commit_grid, k.commit_ahead, k.coordinator):
            if events is not None:
                with self.lock:
                    if self._events.get((job, key), 0) != events.get((job, key), 0):
                        continue
            self._changed(job, key, found.get(key))

    def _on_watch(self, job: str, events: Any) -> None:
        if isinstance(events, CoordinationError):
            self.submit(self.reread, job)  # events may have been missed: read it again
            return
        k = self._prefix_keys(job)
        for event in events:
            if event.kv.key in k:  # only its four keys: anyone may write others under it
                with self.lock:
                    seen = (job, event.kv.key)
                    self._events[seen] = self._events.get(seen, 0) + 1
            self._changed(job, event.kv.key, event.kv if event.type is EventType.PUT else None)

    def _prefix_keys(self, job: str) -> _PrefixKeys:
        # Built once per job: used once per watch event, every node, every commit.
        k = self._keys.get(job)
        if k is None:
            r = self.keys.replication(job)
            k = self._keys[job] = _PrefixKeys(r.commit_grid, r.coordinator, r.commit_ahead,
                                              r.committed)
        return k

    def _changed(self, job: str, key: bytes, kv: Any) -> None:
        """One key of the committed prefix as it now is (``kv`` None: absent)."""
        k = self._prefix_keys(job)
        if key == k.commit_grid:
            self._learn_grid(job, kv)
        elif key == k.coordinator:
            self.reporter.coordinator_seen(job, decode_ship(kv) if kv is not None else None)
        elif key == k.commit_ahead:
            # Kept as written, decoded (checked) only when read: a new coordinator's campaign
            # reads it, while every node's watch brings it at every commit.
            with self.lock:
                if job in self.jobs:
                    self.jobs[job].ahead_record = kv.value if kv is not None else None
        elif key == k.committed:
            self._committed_changed(job, kv)

    def _committed_changed(self, job: str, kv: Any) -> None:
        with self.lock:
            st = self.jobs.get(job)
            if st is None:
                return
            st.committed_rev = kv.mod_revision if kv is not None else 0
            placements = (st.placement, st.previous)
        committed = None
        if kv is not None:
            try:
                committed = decode_committed(kv.value, kv.key, placements)
            except records.RecordError as exc:
                complaints.warn(kv.key, kv.value, "unreadable committed record of %s: %s", job,
                                exc)
        self.reporter.committed_seen(job, committed, kv.mod_revision if kv is not None else 0)
        if committed is None:
            return
        if committed.resolved:
            self.learn(job, committed)
        else:  # holders from a placement this node does not hold: read it beside the record
            self.submit(self.reread, job)

    def _learn_grid(self, job: str, kv: Any) -> None:
        try:
            grid = decode_grid(kv.value, kv.key) if kv is not None else Grid()
        except records.RecordError as exc:
            complaints.warn(kv.key, kv.value, "unreadable grid record of %s: %s", job, exc)
            return
        with self.lock:
            st = self.jobs.get(job)
            if st is None or st.grid == grid:
                return
            old, st.grid = st.grid, grid
        log.info("%s: snapshot grid %d -> %d steps (%s)", job, old.grid, grid.grid, "nodes "
                 "snapshotted different steps" if grid.grid > old.grid else "commits kept up")
