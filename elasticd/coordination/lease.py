"""The node's lease: granted once, kept alive from a thread of its own, re-granted when lost.

The keep-alive runs apart from the daemon's main loop so that a slow cycle never costs the lease.
It refreshes every TTL/3, so that two refreshes in a row may fail (etcd busy, a leader election)
before the lease expires. When the server says the lease is gone, the keeper grants a new one at
once and queues the old id: the daemon decides (was I declared dead? then fence) before it binds
its node record to the new lease.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence, TypeVar

from elasticd.clock import Clock, SystemClock
from elasticd.coordination.api import (
    AuthError,
    Compare,
    CoordinationError,
    Coordinator,
    LeaseLost,
    Put,
    Unavailable,
)
from elasticd.coordination.health import EtcdHealth

log = logging.getLogger(__name__)
T = TypeVar("T")


class LeaseKeeper:
    """Keeps one lease alive; replaces it when the server lost it.

    Args:
        health: shared record of etcd reachability (the keeper reports every attempt).
        on_change: called (from the keeper's thread) when the lease was lost or replaced, so
            that the main loop can wake up.
    """

    def __init__(self, coord: Coordinator, ttl: int, health: EtcdHealth,
                 on_change: Callable[[], None] = lambda: None,
                 clock: Clock | None = None, on_failure: Callable[[], None] = lambda: None) -> None:
        self._coord = coord
        self.ttl = ttl
        self._health = health
        self._on_change = on_change
        self._on_failure = on_failure
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._lost: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def lease(self) -> int | None:
        with self._lock:
            return self._lease

    def take_lost(self) -> list[int]:
        """Returns (and forgets) the ids of leases found lost since the last call."""
        with self._lock:
            lost, self._lost = self._lost, []
            return lost

    def grant(self) -> int:
        """Grants the first lease synchronously (raises if etcd is unreachable)."""
        lease = self._coord.grant_lease(self.ttl)
        with self._lock:
            self._lease = lease
        self._health.ok()
        return lease

    def replace(self, lease: int) -> int:
        """A caller's request found ``lease`` gone on the server (expired, or etcd lost its
        data) before the keep-alive did: forgets it and grants a new one now, rather than
        failing the caller until the next keep-alive. Returns the lease to use.

        Raises:
            CoordinationError: the grant failed (the keeper's thread retries).
        """
        current = self._forget(lease)
        if current is not None:
            return current  # already replaced (by the keeper's thread)
        log.warning("lease %x is gone (expired or revoked); granting a new one", lease)
        new = self.grant()
        self._on_change()
        return new

    def _forget(self, lease: int | None) -> int | None:
        """Drops ``lease`` as lost if it is still the kept one; returns the lease kept now."""
        with self._lock:
            if lease is not None and self._lease == lease:
                self._lease = None
                self._lost.append(lease)
            return self._lease

    def put(self, key: bytes, value: bytes) -> int:
        """Writes ``key`` bound to the kept lease (granted first if there is none); when etcd
        lost that lease before the keep-alive noticed (an etcd restarted empty loses every
        lease at once), replaces it and writes once more. Returns the write's revision."""
        return self._bound(lambda lease: self._coord.put(key, value, lease=lease))

    def put_if(self, key: bytes, value: bytes, compares: Sequence[Compare]) -> bool:
        """:meth:`put`, only if every compare holds (one transaction). Returns whether it
        wrote."""
        return self._bound(lambda lease: self._coord.transaction(
            compares, [Put(key, value, lease)])[0])

    def _bound(self, write: Callable[[int], T]) -> T:
        lease = self.lease
        if lease is None:
            lease = self.grant()
        try:
            return write(lease)
        except LeaseLost:
            return write(self.replace(lease))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def step(self) -> None:
        """One keep-alive (or re-grant) attempt; the thread calls this every TTL/3."""
        lease = self.lease
        try:
            if lease is None:
                log.info("granted new lease %x", self.grant())
                self._on_change()
                return
            self._coord.keep_alive(lease)
            self._health.ok()
        except LeaseLost:
            self._health.ok()  # the server answered: etcd is up, our lease is not
            self._on_failure()
            log.warning("lease %x is gone (expired or revoked); granting a new one", lease)
            self._forget(lease)
            self._on_change()
            self.step()
        except CoordinationError as exc:
            self._on_failure()
            self._health.failed(exc)
            if not isinstance(exc, (Unavailable, AuthError)):  # those: once per outage, there
                log.warning("lease keep-alive failed: %s", exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self._clock.monotonic()
            self.step()
            elapsed = self._clock.monotonic() - started
            self._stop.wait(max(0.05, self.ttl / 3.0 - elapsed))  # every TTL/3: module docstring

    def stop(self, revoke: bool = False) -> None:
        """Stops the thread; with ``revoke`` also revokes the lease (a clean departure)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        lease = self.lease
        if revoke and lease is not None:
            self._coord.revoke_lease(lease)
            with self._lock:
                self._lease = None
