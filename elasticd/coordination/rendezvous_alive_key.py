"""This agent's alive key: an etcd lease kept alive from a thread, and a key bound to it.

Part of liveness by lease (:mod:`.rendezvous_liveness`, which says why and what the key means).
The keeper refreshes the lease every TTL/3, so two refreshes in a row may fail before it expires;
when etcd says the lease is gone, it grants a new one and re-writes the key at once. Unlike the
daemon's :class:`~elasticd.coordination.lease.LeaseKeeper`, it also owns the key and reports
every sign that this agent's view of etcd is doubtful (a failed call, a call slower than TTL/3,
its own lease lost), because the liveness check must not judge other nodes from such a view.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from elasticd.clock import Clock, SystemClock
from elasticd.coordination.api import CoordinationError, Coordinator, LeaseLost, Unavailable

log = logging.getLogger(__name__)


class AliveKeyKeeper:
    """Holds this agent's lease and its alive key; runs the keep-alive thread.

    Every TTL/3 it refreshes the lease; when etcd says the lease is gone it grants a new one and
    re-writes the key at once. It reports everything that makes this agent's view of etcd
    doubtful: a failed call, a call slower than TTL/3, its own lease lost.

    Args:
        coordinator: the etcd connection.
        key: the alive key.
        value: what to store in it (a small JSON record, for operators).
        ttl: lease TTL, seconds.
        on_doubt: called with a reason (from the keep-alive thread) for each of those events.
        clock: time source.
    """

    def __init__(self, coordinator: Coordinator, key: bytes, value: bytes, ttl: int,
                 on_doubt: Callable[[str], None], clock: Clock | None = None) -> None:
        self._coordinator = coordinator
        self.key = key
        self._value = value
        self.ttl = ttl
        self._on_doubt = on_doubt
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._rewrite = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def interval(self) -> float:
        """Seconds between keep-alives: two may fail in a row before the lease expires."""
        return self.ttl / 3.0

    @property
    def lease(self) -> int | None:
        with self._lock:
            return self._lease

    def request_rewrite(self) -> None:
        """Re-write the key at the next step (it was found missing while the lease held)."""
        with self._lock:
            self._rewrite = True

    def establish(self) -> None:
        """Grants the lease (if none) and writes the key, in the caller's thread.

        Raises:
            Unavailable: etcd unreachable (the caller retries through its grace period).
            CoordinationError: anything else etcd refused.
        """
        for _ in range(3):
            try:
                self._refresh(keep_alive=False)
                return
            except LeaseLost:
                self._forget_lease()
        raise Unavailable("the alive key's fresh lease expired three times before its write")

    def step(self) -> bool:
        """One keep-alive (or re-grant and re-write) attempt.

        Returns:
            True when the lease was found lost and a new one should be granted at once.
        """
        lease = self.lease
        start = self._clock.monotonic()
        try:
            self._refresh(keep_alive=True)
            return False
        except LeaseLost:
            self._on_doubt(f"this agent's lease {lease or 0:x} was lost")
            log.warning("lease liveness: lease %x of %s is gone (expired or revoked); granting "
                        "a new one", lease or 0, self.key.decode(errors="replace"))
            self._forget_lease()
            return True
        except Unavailable as exc:
            self._on_doubt(f"etcd unreachable: {exc}")
            return False
        except CoordinationError as exc:
            self._on_doubt(f"etcd failed: {exc}")
            log.warning("lease liveness: keep-alive of %s failed: %s",
                        self.key.decode(errors="replace"), exc)
            return False
        finally:
            took = self._clock.monotonic() - start
            if took > self.interval:
                self._on_doubt(f"a keep-alive took {took:.1f}s")

    def _refresh(self, keep_alive: bool) -> None:
        with self._lock:
            lease, rewrite = self._lease, self._rewrite
        if lease is None:
            lease = self._coordinator.grant_lease(self.ttl)
            with self._lock:
                self._lease, rewrite = lease, True
        elif keep_alive:
            self._coordinator.keep_alive(lease)
        if rewrite:
            with self._lock:
                self._rewrite = False
            try:
                self._coordinator.put(self.key, self._value, lease)
            except BaseException:
                with self._lock:
                    self._rewrite = True
                raise

    def _forget_lease(self) -> None:
        with self._lock:
            self._lease = None
            self._rewrite = True

    def start(self) -> None:
        """Starts the keep-alive thread (a daemon: it never holds the agent's exit)."""
        self._thread = threading.Thread(target=self._run, name="rdzv-liveness", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = self._clock.monotonic()
            if self.step() and not self._stop.is_set():
                self.step()  # the lease was lost: re-grant and re-write without waiting
            elapsed = self._clock.monotonic() - start
            self._stop.wait(max(0.05, self.interval - elapsed))

    def stop(self, revoke: bool) -> None:
        """Stops the thread; with ``revoke``, revokes the lease (the key goes with it)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        lease = self.lease
        if revoke and lease is not None:
            try:
                self._coordinator.revoke_lease(lease)
            except CoordinationError as exc:  # it expires within the TTL anyway
                log.warning("lease liveness: could not revoke lease %x: %s", lease, exc)
            self._forget_lease()
