"""Waiting until a TCP port accepts connections: a round's store, which the round's rank 0
hosts, before its clients connect to it.

A TCPStore client that finds nothing listening sleeps torch's connect back-off before it tries
again (500 ms ± 50 % at first; seen: 0.7 s of a 0.86 s in-process re-formation), and a round's
ranks learn their round at the same moment as rank 0, so they often try before it listens.
Polling the port first costs a few milliseconds instead. Both paths that connect to a round's
store use it: warm workers' store creation (:mod:`elasticd.agent.store_connect`) and an
in-process worker's re-formation (:mod:`elasticd.worker.in_process`). It imports nothing of
elasticd but the clock.
"""

from __future__ import annotations

import contextlib
import socket

from elasticd.clock import Clock, SystemClock

#: Seconds between connection attempts while nothing listens yet.
POLL = 0.005


def wait_listening(host: str, port: int, timeout: float, clock: Clock | None = None) -> bool:
    """Waits until ``host:port`` accepts a TCP connection (then closes it; a TCPStore server
    takes that silently).

    Returns:
        True once a connection was accepted, False if none was within ``timeout`` seconds
        (the caller's own connect then fails and says why).
    """
    clock = clock or SystemClock()
    deadline = clock.monotonic() + timeout
    while True:
        left = deadline - clock.monotonic()
        with contextlib.suppress(OSError):  # refused (not listening yet), unreachable, timed out
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, left))):
                return True
        if clock.monotonic() + POLL >= deadline:
            return False
        clock.sleep(POLL)
