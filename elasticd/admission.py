"""Bounded admission of connections from untrusted callers: a cap, a deadline, fair displacement.

Anyone who reaches a port can open connections, and a connection that never finishes (sends a
byte every few seconds, or nothing) must neither pile up threads nor keep legitimate callers
out. An :class:`Admission` holds the connections not yet trusted (the replica server's
handshakes, the HTTP endpoint's requests):

* at most ``cap`` at once, each given a thread by its server;
* each must be done within ``deadline`` seconds *in total* (a per-receive timeout alone lets a
  trickle of bytes hold a connection forever); :meth:`expire` names those past it;
* when full, a newcomer displaces the oldest connection of the source address holding the most,
  so a flood from one address only ever displaces its own connections, and a caller that needs
  a round trip or two (a peer's handshake, a scrape) gets in however fast the flood reconnects.

Keys are whatever the server uses to find the connection again (a thread); the server closes
what :meth:`admit` and :meth:`expire` return. Time is the real monotonic clock, as for the
socket timeouts it works beside.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
from typing import Any, Callable, Hashable

from elasticd.clock import SYSTEM_CLOCK


class Admission:
    """Connections admitted but not yet done, bounded in number and in time.

    Args:
        cap: connections held at once (>= 1).
        deadline: seconds each may take in total (> 0).
    """

    def __init__(self, cap: int, deadline: float,
                 now: Callable[[], float] = SYSTEM_CLOCK.monotonic) -> None:
        if cap < 1 or deadline <= 0:
            raise ValueError(f"admission needs cap >= 1 and deadline > 0, got {cap}, {deadline}")
        self.cap, self.deadline, self._now = cap, deadline, now
        self._lock = threading.Lock()
        self._held: dict[Hashable, tuple[float, str]] = {}  # key -> (due, source)

    def admit(self, key: Hashable, source: str) -> Hashable | None:
        """Holds ``key`` (from ``source``); returns the key it displaced to make room, if any."""
        with self._lock:
            victim = None
            if len(self._held) >= self.cap:
                per_source = collections.Counter(src for _, src in self._held.values())
                most = max(per_source.values())
                victim = min((k for k, (_, src) in self._held.items() if per_source[src] == most),
                             key=lambda k: self._held[k][0])
                del self._held[victim]
            self._held[key] = (self._now() + self.deadline, source)
            return victim

    def release(self, key: Hashable) -> bool:
        """Lets ``key`` go (done, or trusted now); False if already displaced or expired."""
        with self._lock:
            return self._held.pop(key, None) is not None

    def expire(self) -> tuple[list[Hashable], float | None]:
        """Drops and returns the keys past their deadline, and seconds until the next is due."""
        now = self._now()
        with self._lock:
            gone = [k for k, (due, _) in self._held.items() if due <= now]
            for key in gone:
                del self._held[key]
            nearest = min((due for due, _ in self._held.values()), default=None)
        return gone, None if nearest is None else max(0.0, nearest - now)


def shut(sock: Any) -> None:
    """Ends a displaced or expired connection: its thread's blocked read returns end-of-file
    and the thread closes the socket (closing it from here could race a reused descriptor)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
