"""Pushing snapshots to peers: what one lane task does.

A :class:`Pusher` runs the tasks of the per-peer lanes (:mod:`elasticd.replication.lanes`).
A newest-wins task passes the retention gate, pins the newest complete local snapshot of its
rank (so the worker's next-but-one snapshot cannot overwrite the bytes in flight; the store
then skips that snapshot instead), pushes it over the peer's reused connection, and reports the
acknowledgement to the :class:`~elasticd.replication.tracker.CommitTracker`. An exact task
(re-replication, drain) pushes one given version from the local store or the replica store. A
connection found closed (e.g. by the peer's idle timeout) is retried once on a fresh one; every
other failure is counted by reason and left to the next snapshot.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from typing import Callable

from elasticd.store.shm import SlotStore, SnapshotView
from elasticd.replication.api import (
    EXISTS,
    ConnectionLost,
    DeadlineExceeded,
    Refused,
    ReplicationError,
)
from elasticd.replication.deadline import LinkRates
from elasticd.replication.lanes import Connections, Lanes, NoAddress, Task, resolve
from elasticd.replication.shm_sink import ShmSink, descriptor_of, pinned_view
from elasticd.replication.tracker import CommitTracker

log = logging.getLogger(__name__)


class Pusher:
    """Runs lane tasks: pushes of local snapshots and of held replicas to peers.

    Args:
        sink: its replica sink (a source for exact pushes), or None.
        tracker: told of acknowledgements; holds the retention gate.
        rates: measured link rates: each push's whole-call deadline comes from them, and
            each acknowledged push is measured into them (None: a fresh one).
    """

    def __init__(self, store: SlotStore, sink: ShmSink | None, connections: Connections,
                 executor: concurrent.futures.Executor, tracker: CommitTracker,
                 rates: LinkRates | None = None) -> None:
        self.store, self.sink, self.connections, self.tracker = store, sink, connections, tracker
        self.rates = rates if rates is not None else LinkRates()
        self.lanes = Lanes(executor, self._run)
        self._lock = threading.Lock()
        self.counters: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        #: Called with (seconds, bytes) after each acknowledged push (the daemon's metrics).
        self.on_push: Callable[[float, int], None] = lambda *_: None

    def _run(self, peer: str, task: Task) -> None:
        if task.exact:
            resolve(task, self._push_exact(peer, task))
        else:
            self._push_newest(peer, task)

    def _push_newest(self, peer: str, task: Task) -> None:
        self.tracker.gate(task.job, task.rank)
        view = pinned_view(self.store, task.job, task.rank, None)
        if view is None:
            return
        try:
            version = view.header.version()
            # Not past an undecided older copy (the holder would let it go): the next
            # snapshot asks again once it is decided.
            done = (self.tracker.is_acked(task.job, task.rank, version, peer)
                    or self.tracker.held_back(task.job, task.rank, version))
            ok = not done and self._send(peer, view)
            if ok:
                # Acknowledged, so it may be committed: from now on its slot is not reused
                # until it is decided. Done while pinned, so the copy is still here; the
                # peer's copy is counted in the same call (one hold of the tracker's lock).
                self.tracker.on_pushed(task.job, version, (task.rank,), peer)
        finally:
            view.release()

    def _push_exact(self, peer: str, task: Task) -> bool:
        stores = [self.store] + ([self.sink.store] if self.sink is not None else [])
        for store in stores:
            view = pinned_view(store, task.job, task.rank, task.version)
            if view is not None:
                try:
                    return self._send(peer, view)
                finally:
                    view.release()
        self.fail("source_missing")
        return False

    def _send(self, peer: str, view: SnapshotView) -> bool:
        d, buf = descriptor_of(view), view.buffer
        for attempt in (0, 1):
            try:
                client, reused = self.connections.get(peer, self.rates.deadline(peer, 0))
            except NoAddress:
                self.fail("no_address")
                return False
            except ReplicationError as exc:
                log.warning("cannot connect to %s: %s", peer, exc)
                self.fail("unreachable")
                return False
            try:
                # A frozen receiver keeps its socket open: bound the whole push, not each send.
                seconds = client.push(d, buf[: d.header_bytes],
                                      buf[d.header_bytes : d.total_bytes], tags=view.tags,
                                      deadline=self.rates.deadline(peer, d.total_bytes))
            except Refused as exc:
                if exc.reason == EXISTS:
                    return True  # the peer already holds this very version, verified
                self.fail(exc.reason)
                log.info("%s refused %s rank %d %s: %s", peer, d.job, d.owner_rank, d.version, exc)
                return False
            except ReplicationError as exc:
                self.connections.discard(peer, client)
                if (reused and attempt == 0 and isinstance(exc, ConnectionLost)
                        and not isinstance(exc, DeadlineExceeded)):
                    continue  # the peer may have closed an idle connection: one fresh try
                self.fail("connection" if isinstance(exc, ConnectionLost) else "remote")
                log.warning("push of %s rank %d %s to %s failed: %s", d.job, d.owner_rank,
                            d.version, peer, exc)
                return False
            self.rates.record(peer, d.total_bytes, seconds)
            with self._lock:
                self.counters["pushes"] += 1
                self.counters["push_bytes"] += d.total_bytes
            self.on_push(seconds, d.total_bytes)
            return True
        return False

    def fail(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        """(push counters, failures by reason), consistent copies."""
        with self._lock:
            return dict(self.counters), dict(self.failures)
