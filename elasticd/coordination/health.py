"""Whether etcd is reachable, as one node sees it, with outages as first-class periods.

Every part that talks to etcd (the lease keeper, the main loop) reports each success and
failure here. An outage starts at the first failure after a success and ends at the next
success; it is logged once when it starts and once when it ends (never once per retry), counted
in metrics, and remembered for a while, because a peer's lease expiry seen just after an outage
may be the outage's doing rather than the peer's (see :mod:`elasticd.cluster.membership`).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from elasticd.clock import Clock, SystemClock
from elasticd.coordination.api import AuthError, Refused

log = logging.getLogger(__name__)


class EtcdHealth:
    """Thread-safe record of etcd reachability.

    Args:
        on_outage_start / on_outage_end: called once per outage (the second gets its length).
    """

    def __init__(self, clock: Clock | None = None,
                 on_outage_start: Callable[[], None] = lambda: None,
                 on_outage_end: Callable[[float], None] = lambda _s: None,
                 describe: str = "etcd") -> None:
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._on_start = on_outage_start
        self._on_end = on_outage_end
        self._describe = describe
        self.outage_since: float | None = None
        self.last_outage_end: float | None = None
        self._said = ""  # the kind of failure this outage's last line reported
        self._kinds: set[str] = set()  # every kind the outage under way had
        #: Every kind of failure the last ended outage had (what a caller must repair: a
        #: watch stream survives etcd refusing requests, not etcd going away).
        self.last_outage_kinds: frozenset[str] = frozenset()

    @property
    def up(self) -> bool:
        with self._lock:
            return self.outage_since is None

    @property
    def kind(self) -> str | None:
        """What the outage under way is ("unreachable", "refuses our credentials", "refuses
        our requests"), or None while etcd is up."""
        with self._lock:
            return None if self.outage_since is None else self._said

    def failed(self, exc: BaseException) -> None:
        """Records a failed call: one line per outage, and one more if its kind changes
        (etcd back but refusing our credentials, as after a data loss, needs another fix;
        etcd refusing our requests while its users change needs none, but is no outage of
        the network either)."""
        now = self._clock.monotonic()
        what = ("refuses our credentials" if isinstance(exc, AuthError)
                else "refuses our requests" if isinstance(exc, Refused) else "unreachable")
        with self._lock:
            started = self.outage_since is None
            if started:
                self.outage_since = now
                self._kinds = set()
            elif what == self._said:
                return
            self._said = what
            self._kinds.add(what)
        log.warning("%s %s: %s; retrying, workers keep running", self._describe, what, exc)
        if started:
            self._on_start()

    def ok(self) -> None:
        now = self._clock.monotonic()
        with self._lock:
            if self.outage_since is None:
                return
            length = now - self.outage_since
            self.outage_since = None
            self.last_outage_end = now
            self.last_outage_kinds = frozenset(self._kinds)
        log.warning("%s reachable again after %.1f s", self._describe, length)
        self._on_end(length)

    def outage_seconds(self) -> float:
        with self._lock:
            return 0.0 if self.outage_since is None else self._clock.monotonic() - self.outage_since

    def cut_off_within(self, window: float) -> bool:
        """True when etcd is unreachable now or was within the last ``window`` seconds."""
        now = self._clock.monotonic()
        with self._lock:
            return self.outage_since is not None or (
                self.last_outage_end is not None and now - self.last_outage_end <= window)
