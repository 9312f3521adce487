"""In the torchrun agent: whether the job is at a committed step, for the ``interval:MIN`` grow.

Under the ``interval:MIN`` grow policy a node that returns or is added enters a running job
(every node stops once to let it in) only "at a committed step": when the stop loses nothing
that was already safe elsewhere. The workers resume from the job's committed step
(:mod:`elasticd.replication.commit`), so a stop right after a commit loses only the steps since
that commit, while a stop just before the next commit loses a whole snapshot interval and the
replication work that was about to complete.

The rule (:func:`at_committed_step`): the job is at a committed step when its committed version
is at least the newest version any rank has with ``m`` verified copies. The job's commit
coordinator, which hears every node's replicated versions, writes that newest version to the
*ahead* record (``ckpt/committed.ahead``) when it passes the commit (at most once per commit),
so the rule holds from a commit until the first rank's next snapshot is replicated: a window of
about one snapshot interval less the replication time, once per commit. Without a committed
record it does not hold (nothing to resume from but step 0: growing then would throw the run
away).

:class:`CommitWatch` mirrors the committed record's prefix (``ckpt/committed``: the committed
record, the ahead record, and two small keys that change rarely) through one etcd watch (listing
first, again after a watch error), so the rendezvous handler's ``commit_gate``, asked from
``num_nodes_waiting`` every monitor interval while a newcomer waits, answers from memory with no
etcd request. The watch exists only while the gate is asked: it starts at the first ask (which
answers no: the newcomer waits for the next) and ends once the gate went unasked for
:data:`IDLE` seconds (held for the whole run, it would double every node's watch events per
committed step, beside its daemon's watch of the same prefix). The rendezvous plugin may import
only the coordination layer; :mod:`.torchrun` passes this gate in, as it does the join gate.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable

from elasticd.clock import Clock, SystemClock
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Coordinator, EventType, KeyValue
from elasticd.coordination.keys import Keyspace
from elasticd.replication.api import Version
from elasticd.replication.commit import decode_ahead, decode_committed

log = logging.getLogger(__name__)

#: Seconds the gate may go unasked before its watch ends (the next ask starts it again).
IDLE = 60.0


def at_committed_step(committed: Version | None, newest: Iterable[Version]) -> bool:
    """Whether the job is at a committed step (see the module docstring); ``newest``: the
    ahead record's versions."""
    return committed is not None and all(v <= committed for v in newest)


class CommitWatch:
    """The job's committed version and the ahead record's version, kept by a watch."""

    def __init__(self, coordinator: Coordinator, keys: Keyspace, job: str,
                 clock: Clock | None = None) -> None:
        self._coord = coordinator
        self._clock = clock or SystemClock()
        self._prefix = self._committed_key = keys.replication(job).committed
        self._ahead_key = keys.replication(job).commit_ahead
        self._job = job
        self._lock = threading.Lock()
        self._committed: Version | None = None
        self._ahead: Version | None = None
        self._revision = 0
        #: False until listed, and from a watch error until the re-list: the gate says no.
        self._fresh = False
        self._relisting = False
        self._watch = None
        self._stopped = False
        self._asked_at = float("-inf")

    def stop(self) -> None:
        self._stopped = True
        if self._watch is not None:
            self._watch.cancel()

    def __call__(self) -> bool:
        """The gate: whether the job is at a committed step, from memory (False while the
        mirror is not known to be current: at the first ask, it starts)."""
        with self._lock:
            self._asked_at = self._clock.monotonic()
            start = self._watch is None and not self._relisting and not self._stopped
            self._relisting = self._relisting or start
        if start:
            threading.Thread(target=self._relist_patiently, name="commit-watch-start",
                             daemon=True).start()
        with self._lock:
            return self._fresh and at_committed_step(
                self._committed, [self._ahead] if self._ahead is not None else [])

    def _relist(self) -> None:
        kvs, revision = self._coord.get_prefix(self._prefix)
        with self._lock:
            self._committed = self._ahead = None
            for kv in kvs:
                self._put(kv)
            went_back = revision < self._revision
            self._revision = revision
        if self._watch is None or went_back:
            # After an etcd data loss a watch resumed from the old revision delivers nothing.
            if self._watch is not None:
                self._watch.cancel()
            self._watch = self._coord.watch_prefix(self._prefix, self._on_watch, revision + 1)
        with self._lock:
            self._fresh = True
            self._relisting = False

    def _on_watch(self, batch: object) -> None:
        if isinstance(batch, Exception):
            with self._lock:
                self._fresh = False
                if self._relisting or self._stopped:
                    return
                self._relisting = True
            threading.Thread(target=self._relist_patiently, name="commit-watch-relist",
                             daemon=True).start()
            return
        with self._lock:
            idle = self._clock.monotonic() - self._asked_at > IDLE
            if idle:  # nobody asks: the watch ends (the next ask lists and watches again)
                watch, self._watch, self._fresh = self._watch, None, False
        if idle:
            if watch is not None:
                watch.cancel()
            return
        with self._lock:
            for e in batch:  # type: ignore[attr-defined]
                if e.kv.mod_revision <= self._revision:
                    continue  # already in the listing
                if e.type is EventType.PUT:
                    self._put(e.kv)
                else:
                    self._delete(e.kv.key)
                self._revision = e.kv.mod_revision

    def _relist_patiently(self) -> None:
        delay = 0.25
        while not self._stopped:
            try:
                self._relist()
                return
            except CoordinationError as exc:
                log.debug("re-listing the commit records of %s failed: %s", self._job, exc)
            self._clock.sleep(delay)
            delay = min(2 * delay, 5.0)

    def _put(self, kv: KeyValue) -> None:
        try:
            if kv.key == self._committed_key:
                self._committed = decode_committed(kv.value, kv.key).version
            elif kv.key == self._ahead_key:
                self._ahead = decode_ahead(kv.value, kv.key)
        except records.RecordError as exc:
            log.debug("commit watch: ignoring %r: %s", kv.key, exc)

    def _delete(self, key: bytes) -> None:
        if key == self._committed_key:
            self._committed = None
        elif key == self._ahead_key:
            self._ahead = None
