"""An in-memory :class:`Coordinator` for fast unit tests.

It follows etcd's model closely enough that the same contract tests pass against it and a real
server: one global revision, mod/create revisions per key, leases that expire on an injected
clock, transactions on mod_revision, and watches that replay history from a start revision and
report compaction. Several daemons in one test share one :class:`MemoryStore` through their own
:class:`MemoryCoordinator` handles, the way several clients share one etcd server.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Sequence

from elasticd.clock import Clock, SystemClock
from elasticd.coordination.api import (
    Compacted,
    Compare,
    Coordinator,
    CoordinationError,
    Delete,
    EventType,
    KeyValue,
    LeaseLost,
    Op,
    Put,
    Refused,
    Unavailable,
    Watch,
    WatchCallback,
    WatchEvent,
)


@dataclasses.dataclass
class _Lease:
    ttl: int
    expires_at: float
    keys: set[bytes] = dataclasses.field(default_factory=set)


class _MemoryWatch(Watch):
    def __init__(self, store: "MemoryStore", prefix: bytes, callback: WatchCallback,
                 prev_kv: bool = False) -> None:
        self._store = store
        self.prefix = prefix
        self._callback = callback
        self.prev_kv = prev_kv
        self.cancelled = False
        # Events below this revision are not delivered: a watch resumed from an older
        # cluster's revision after a wipe (see MemoryStore.wipe).
        self.resume_from = 0

    def callback(self, batch: "Sequence[WatchEvent] | CoordinationError") -> None:
        """Delivers a batch, without each event's previous key unless the watch asked for it
        (as etcd does: a caller that reads ``prev`` without asking fails here too)."""
        if not self.prev_kv and not isinstance(batch, CoordinationError):
            batch = [dataclasses.replace(e, prev=None) for e in batch]
        self._callback(batch)

    def cancel(self) -> None:
        self.cancelled = True
        with self._store._lock:
            if self in self._store._watches:
                self._store._watches.remove(self)


class MemoryStore:
    """The shared server state behind any number of :class:`MemoryCoordinator` clients."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()
        self._lock = threading.RLock()
        self._kv: dict[bytes, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._next_lease = 0x1000
        self._revision = 1
        self._compacted = 0
        self._history: list[tuple[int, WatchEvent]] = []
        self._watches: list[_MemoryWatch] = []
        # Events not yet delivered, in revision order, and the one delivering them: as an
        # etcd watch stream does, every watch gets events in revision order. Each caller
        # delivering its own events let two threads' events cross (a lease expiry's delete
        # after the put of the key's next holder) -- a reorder etcd never makes.
        # Items: (None, event) for every watch, or (watch, batch or error) for one watch (a
        # new watch's replay).
        self._outbox: collections.deque[tuple[_MemoryWatch | None, object]] = collections.deque()
        self._delivering = threading.Lock()
        self.available = True
        self.refusing = False

    # -- fault injection ------------------------------------------------------------------

    def set_available(self, available: bool) -> None:
        """Simulates an outage: while False every client call raises :class:`Unavailable`."""
        with self._lock:
            self.available = available
            watches = list(self._watches)
        if not available:
            for w in watches:
                w.callback(Unavailable("memory store is down"))

    def set_refusing(self, refusing: bool) -> None:
        """Simulates etcd refusing every request, unapplied, while its users keep changing:
        while True every client call raises :class:`Refused` (what the etcd adapter raises
        once it has repeated a refused request for as long as it waits)."""
        with self._lock:
            self.refusing = refusing

    def wipe(self) -> None:
        """Simulates etcd restarted on an empty data directory: every key and lease is gone
        and revisions restart at 1. Each watch sees the stream break (``Unavailable``) and is
        then stuck, as a real one resumed from the old cluster's next revision is: it delivers
        nothing until the new revisions pass the old ones (docs/facts.md), unless reset
        (:meth:`MemoryCoordinator.reset_watches`)."""
        with self._lock:
            old = self._revision
            self._kv.clear()
            self._leases.clear()
            self._history.clear()
            self._outbox.clear()  # the old cluster's stream broke with them
            self._revision, self._compacted = 1, 0
            watches = list(self._watches)
            for w in watches:
                w.resume_from = old + 1
        for w in watches:
            w.callback(Unavailable("memory store restarted"))

    def compact(self, revision: int) -> None:
        with self._lock:
            self._compacted = max(self._compacted, revision)
            self._history = [(r, e) for r, e in self._history if r > revision]

    def expire_leases(self) -> None:
        """Expires every lease whose deadline passed on the store's clock."""
        now = self.clock.monotonic()
        with self._lock:
            due = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
            for lid in due:
                self._drop_lease(lid)
        self._deliver()

    # -- internals (call with the lock held) ----------------------------------------------

    def _check(self) -> None:
        if not self.available:
            raise Unavailable("memory store is down")
        if self.refusing:
            raise Refused("memory store: revision of auth store is old")

    def _drop_lease(self, lease_id: int) -> list[WatchEvent]:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return []
        return [e for key in sorted(lease.keys) if (e := self._delete(key)) is not None]

    def _put(self, key: bytes, value: bytes, lease: int, same: bool = False) -> WatchEvent:
        """``same``: a later operation of one transaction, at the revision the first made
        (etcd gives every change of a transaction the same mod_revision)."""
        if lease and lease not in self._leases:
            raise LeaseLost(f"lease {lease:x} not found")
        self._revision += not same
        old = self._kv.get(key)
        if old is not None and old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        kv = KeyValue(
            key=key,
            value=value,
            create_revision=old.create_revision if old else self._revision,
            mod_revision=self._revision,
            version=(old.version + 1) if old else 1,
            lease=lease,
        )
        self._kv[key] = kv
        if lease:
            self._leases[lease].keys.add(key)
        event = WatchEvent(EventType.PUT, kv, old)
        self._history.append((self._revision, event))
        self._outbox.append((None, event))
        return event

    def _delete(self, key: bytes, same: bool = False) -> WatchEvent | None:
        old = self._kv.pop(key, None)
        if old is None:
            return None
        self._revision += not same
        if old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        event = WatchEvent(
            EventType.DELETE,
            KeyValue(key=key, value=b"", create_revision=0, mod_revision=self._revision, version=0),
            old,
        )
        self._history.append((self._revision, event))
        self._outbox.append((None, event))
        return event

    def _deliver(self) -> None:
        """Delivers the events not yet delivered, in revision order.

        While another thread delivers, this returns at once: that thread delivers these too,
        after the ones before them (so a watch callback that calls the store, or that waits
        on a lock held by a thread calling the store, cannot deadlock here)."""
        while self._delivering.acquire(blocking=False):
            try:
                while True:
                    with self._lock:
                        items = list(self._outbox)
                        self._outbox.clear()
                        watches = list(self._watches)
                    if not items:
                        break
                    for target, batch in _runs(items):
                        if target is not None:
                            if not target.cancelled:
                                target.callback(batch)
                            continue
                        for w in watches:
                            mine = [e for e in batch if e.kv.key.startswith(w.prefix)
                                    and e.kv.mod_revision >= w.resume_from]
                            if mine and not w.cancelled:
                                w.callback(mine)
            finally:
                self._delivering.release()
            with self._lock:
                if not self._outbox:  # none queued after this thread's last look
                    return


def _runs(items: list[tuple[_MemoryWatch | None, object]]) -> list[tuple[_MemoryWatch | None, object]]:
    """The outbox's items with consecutive events for every watch joined into one batch."""
    runs: list[tuple[_MemoryWatch | None, object]] = []
    for target, payload in items:
        if target is None and runs and runs[-1][0] is None:
            runs[-1][1].append(payload)  # type: ignore[attr-defined]
        elif target is None:
            runs.append((None, [payload]))
        else:
            runs.append((target, payload))
    return runs


class MemoryCoordinator(Coordinator):
    """One client of a :class:`MemoryStore`."""

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.store = store or MemoryStore()
        self._watches: list[_MemoryWatch] = []
        self._closed = False

    def _enter(self) -> threading.RLock:
        """Checks the client and the store, as each call does first; returns the store's lock."""
        if self._closed:
            raise CoordinationError("client is closed")
        self.store.expire_leases()
        self.store._check()
        return self.store._lock

    def get(self, key: bytes) -> KeyValue | None:
        with self._enter():
            return self.store._kv.get(key)

    def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        with self._enter():
            kvs = [kv for k, kv in self.store._kv.items() if k.startswith(prefix)]
            return sorted(kvs, key=lambda kv: kv.key), self.store._revision

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        with self._enter():
            event = self.store._put(key, value, lease)
        self.store._deliver()
        return event.kv.mod_revision

    def delete(self, key: bytes) -> bool:
        with self._enter():
            event = self.store._delete(key)
        self.store._deliver()
        return event is not None

    def delete_prefix(self, prefix: bytes) -> int:
        with self._enter():
            keys = [k for k in self.store._kv if k.startswith(prefix)]
            events = [e for k in keys if (e := self.store._delete(k)) is not None]
        self.store._deliver()
        return len(events)

    def transaction(self, compares: Sequence[Compare], ops: Sequence[Op]) -> tuple[bool, int]:
        events: list[WatchEvent] = []
        with self._enter():
            for c in compares:
                kv = self.store._kv.get(c.key)
                have = 0 if kv is None else (
                    kv.create_revision if c.target == "create"
                    else kv.lease if c.target == "lease" else kv.mod_revision)
                if have != c.mod_revision:
                    return False, self.store._revision
            for op in ops:
                if isinstance(op, Put) and op.lease and op.lease not in self.store._leases:
                    raise LeaseLost(f"lease {op.lease:x} not found")
            for op in ops:
                if isinstance(op, Put):
                    events.append(self.store._put(op.key, op.value, op.lease, bool(events)))
                elif isinstance(op, Delete):
                    if (e := self.store._delete(op.key, bool(events))) is not None:
                        events.append(e)
            revision = self.store._revision
        self.store._deliver()
        return True, revision

    def grant_lease(self, ttl: int) -> int:
        with self._enter():
            self.store._next_lease += 1
            lease_id = self.store._next_lease
            self.store._leases[lease_id] = _Lease(ttl, self.store.clock.monotonic() + ttl)
            return lease_id

    def keep_alive(self, lease: int) -> float:
        with self._enter():
            entry = self.store._leases.get(lease)
            if entry is None:
                raise LeaseLost(f"lease {lease:x} not found")
            entry.expires_at = self.store.clock.monotonic() + entry.ttl
            return float(entry.ttl)

    def revoke_lease(self, lease: int) -> None:
        with self._enter():
            self.store._drop_lease(lease)
        self.store._deliver()

    def watch_prefix(self, prefix: bytes, callback: WatchCallback, start_revision: int,
                     prev_kv: bool = False) -> Watch:
        compacted = None
        with self._enter():
            if start_revision and start_revision <= self.store._compacted:
                # etcd reports this on the stream, not to the caller: so do we.
                compacted = Compacted(self.store._compacted)
                start_revision = self.store._revision + 1
            replay = [
                e for r, e in self.store._history
                if r >= start_revision and e.kv.key.startswith(prefix)
            ]
            w = _MemoryWatch(self.store, prefix, callback, prev_kv)
            # Events up to now come by the replay, in order before any later one.
            w.resume_from = self.store._revision + 1
            self.store._watches.append(w)
            self._watches.append(w)
            if compacted is not None:
                self.store._outbox.append((w, compacted))
            if replay:
                self.store._outbox.append((w, replay))
        self.store._deliver()
        return w

    def watch_key(self, key: bytes, callback: WatchCallback, start_revision: int) -> Watch:
        def only_key(batch: "Sequence[WatchEvent] | CoordinationError") -> None:
            if isinstance(batch, CoordinationError):
                callback(batch)
            elif events := [e for e in batch if e.kv.key == key]:
                callback(events)

        return self.watch_prefix(key, only_key, start_revision)

    def reset_watches(self) -> None:
        with self._enter():
            for w in self._watches:
                w.resume_from = 0

    def revision(self, probe: bytes = b"\0") -> int:
        with self._enter():
            return self.store._revision

    def close(self) -> None:
        self._closed = True
        for w in self._watches:
            w.cancel()
