"""The replica server's connections: the listening socket and its accept thread
(:class:`Listener`), and the table of the connections being served (:class:`Connections`).
"""

from __future__ import annotations

import dataclasses
import logging
import selectors
import socket
import threading
from typing import Any, Callable

from elasticd.admission import Admission

log = logging.getLogger("elasticd.replication.server")


class Listener:
    """A listening socket and the thread that accepts on it, woken by :meth:`stop`.

    Args:
        host, port: where to listen (port 0: any free port; see :attr:`address`).
        accept: called on the accept thread with each new socket and its address.
        wait: called before each wait; returns seconds until it must be called again (None:
            at the next connection).
        name: who listens (the thread's name and the log's).
    """

    def __init__(self, host: str, port: int, backlog: int,
                 accept: Callable[[socket.socket, Any], None],
                 wait: Callable[[], float | None], name: str) -> None:
        self._sock = socket.create_server((host, port), backlog=backlog)
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]  # port 0 resolved
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, args=(accept, wait, name),
                                        daemon=True, name=f"replica-accept-{name}")

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Wakes and joins the accept thread, then closes the sockets."""
        self._wake_w.send(b"\0")
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._selector.close()
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()

    def _loop(self, accept: Callable[[socket.socket, Any], None],
              wait: Callable[[], float | None], name: str) -> None:
        while True:
            for key, _ in self._selector.select(wait()):
                if key.fileobj is self._wake_r:
                    return
                try:
                    sock, addr = self._sock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    log.warning("replica server %s: accept failed: %s", name, exc)
                    continue
                accept(sock, addr)


class Connections:
    """Every connection being served, by its thread: those still in their handshake (an
    :class:`~elasticd.admission.Admission`: capped, each with a deadline, the oldest of the
    busiest address displaced), how many are authenticated (capped), whether the server stops,
    the fetches being served and when each peer was last heard from. Its lock also guards the
    server's counters.

    Args:
        max_pending, handshake_timeout: connections in their handshake at once, and the
            seconds each may take in total.
        clock: times fetches and when peers were heard from.
    """

    def __init__(self, stats: Any, max_connections: int, max_pending: int,
                 handshake_timeout: float, clock: Any) -> None:
        self.stats, self._max, self._clock = stats, max_connections, clock
        self._lock = threading.Lock()
        self._socks: dict[threading.Thread, Any] = {}
        self._pending = Admission(max_pending, handshake_timeout)
        self._authenticated = 0
        self.stopping = False
        # Fetches being served, by the connection's thread: (peer, job, rank, version, start).
        self._serving: dict[threading.Thread, tuple[str, str, int, Any, float]] = {}
        # When each authenticated peer was last heard from (wall time): a failed peer's last
        # sign of life, for its recovery's timeline (cluster/timeline.py).
        self._heard: dict[str, float] = {}

    def sockets(self) -> dict[threading.Thread, Any]:
        with self._lock:
            return dict(self._socks)

    def bump(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def snapshot(self) -> Any:
        """A consistent copy of the counters."""
        with self._lock:
            return dataclasses.replace(self.stats)

    def stop(self) -> bool:
        """Refuses new connections from now; False when already stopping."""
        with self._lock:
            stopping, self.stopping = self.stopping, True
            return not stopping

    def admit(self, thread: threading.Thread, sock: socket.socket,
              host: str) -> tuple[bool, Any]:
        """Holds a new connection as pending: (False, None) when stopping, else (True, the
        socket of the pending connection it displaced, or None)."""
        with self._lock:
            if self.stopping:
                return False, None
            victim = None
            displaced = self._pending.admit(thread, host)
            if displaced is not None:
                victim = self._socks.get(displaced)
            self._socks[thread] = sock
            return True, victim

    def expire(self) -> tuple[list[Any], float | None]:
        """Drops the handshakes past their deadline: their sockets, and seconds until the next
        is due."""
        expired, wait = self._pending.expire()
        with self._lock:
            return [self._socks[t] for t in expired if t in self._socks], wait

    def authenticate(self, me: threading.Thread) -> str | None:
        """Moves ``me`` from pending to authenticated; the reason when it may not."""
        with self._lock:
            if not self._pending.release(me):
                return "handshake deadline passed, or displaced by a newer connection"
            if self.stopping:
                return "stopping"
            if self._authenticated >= self._max:
                return f"{self._max} peers connected"
            self._authenticated += 1
            return None

    def replace(self, me: threading.Thread, sock: Any) -> None:
        """``me`` now talks over ``sock`` (its TLS wrapping)."""
        with self._lock:
            if me in self._socks:
                self._socks[me] = sock

    def handshake_failed(self, me: threading.Thread) -> tuple[bool, bool]:
        """Lets ``me`` go from pending: (whether its deadline passed or it was displaced,
        whether the server stops)."""
        with self._lock:
            return not self._pending.release(me), self.stopping

    def end(self, me: threading.Thread, authenticated: bool) -> None:
        with self._lock:
            self._socks.pop(me, None)
            self._pending.release(me)
            self._authenticated -= authenticated

    def hear(self, node: str) -> None:
        with self._lock:
            if node not in self._heard and len(self._heard) >= 4 * self._max:
                self._heard.clear()  # bounded: node ids are the peers' own word
            self._heard[node] = self._clock.wall()

    def last_heard(self, node: str) -> float | None:
        with self._lock:
            return self._heard.get(node)

    def fetching(self, peer: str, job: str, rank: int, version: Any) -> None:
        """This thread serves a fetch from now."""
        with self._lock:
            self._serving[threading.current_thread()] = (peer, job, rank, version,
                                                         self._clock.monotonic())

    def fetched(self) -> None:
        """This thread's fetch is over."""
        with self._lock:
            self._serving.pop(threading.current_thread(), None)

    def serving(self) -> list[dict[str, Any]]:
        now = self._clock.monotonic()
        with self._lock:
            return [{"peer": peer, "job": job, "rank": rank, "version": list(version),
                     "seconds": round(now - started, 3)}
                    for peer, job, rank, version, started in self._serving.values()]
