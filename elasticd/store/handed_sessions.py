"""Replication sessions the daemon handed to its job's workers (``ckpt_sessions``), each kept to
be cut off: one live set per (job, rank, old rank) asked for (asking again ends the set before,
so a worker cannot pile up sessions against its holders' connection caps), and every set at
its deadline, when its reply could not be delivered, and when the job leaves the node.

The daemon's side of a handed session is the client it opened (:mod:`elasticd.replication.
handed`): closing it shuts the session down both ways, which ends the worker's use of it at
its next send or receive.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

from elasticd.clock import SYSTEM_CLOCK

log = logging.getLogger(__name__)

#: Seconds a handed set lives when the request names none, and the most it may name.
SESSION_SECONDS = 600.0
MAX_SESSION_SECONDS = 1800.0

Key = tuple[str, int, int]  # (job, rank asking, old rank)


class HandedSessions:
    """The live sets of handed sessions, by (job, rank, old rank).

    One thread (started with the first set, ended with the last) cuts each set off at its
    deadline: a reshard from a large world asks for a set per old rank it needs (a shrink
    from 1,000 ranks to 10 needs ~101 on each new rank), and a timer thread a set would put
    hundreds of threads into the daemon for up to :data:`MAX_SESSION_SECONDS`. A request that
    got no session keeps nothing, so a job's process cannot pile up state by naming old ranks
    that have no holder; the sets it can keep are bounded by the old ranks that have one.

    Args:
        clock: ``monotonic()`` seconds, the deadlines' clock.
    """

    def __init__(self, clock: Any = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._sets: dict[Key, tuple[Sequence[Any], float]] = {}
        self._thread: threading.Thread | None = None

    def give(self, key: Key, clients: Sequence[Any], seconds: float) -> None:
        """Keeps ``clients`` (the daemon's side of the sessions just handed over for ``key``)
        until ``seconds`` from now; ends the set ``key`` had before."""
        with self._lock:
            old = self._sets.pop(key, None)
            if clients:
                self._sets[key] = (list(clients), self.clock.monotonic() + seconds)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._expire, daemon=True,
                                                    name="elasticd-handed-sessions")
                    self._thread.start()
                self._wake.notify()
        if old is not None:
            self._end(old)

    def cut_off(self, key: Key) -> int:
        """Ends ``key``'s live set now; returns how many sessions it had."""
        with self._lock:
            found = self._sets.pop(key, None)
            self._wake.notify()  # the deadline thread leaves once no set is left
        return self._end(found) if found is not None else 0

    def live(self, job: str | None = None) -> int:
        """Sessions handed over (to ``job``'s processes, or any) and not cut off yet."""
        with self._lock:
            return sum(len(clients) for key, (clients, _) in self._sets.items()
                       if job is None or key[0] == job)

    def sets(self) -> int:
        """Live sets (each a (job, rank, old rank) with sessions not cut off yet)."""
        with self._lock:
            return len(self._sets)

    def cut_off_job(self, job: str) -> int:
        """Ends every set of ``job`` (it left the node); returns how many sessions they had."""
        with self._lock:
            found = [self._sets.pop(k) for k in [k for k in self._sets if k[0] == job]]
            self._wake.notify()
        return sum(self._end(entry) for entry in found)

    def _expire(self) -> None:
        """The deadline thread: ends each set at its deadline; leaves when none is left."""
        while True:
            with self._lock:
                if not self._sets:
                    self._thread = None
                    return
                now = self.clock.monotonic()
                due = [k for k, (_, deadline) in self._sets.items() if deadline <= now]
                if not due:
                    self._wake.wait(min(d for _, d in self._sets.values()) - now)
                    continue
                ended = [(k, self._sets.pop(k)) for k in due]
            for key, entry in ended:
                log.info("%s rank %d: the sessions handed over for old rank %d reached their "
                         "deadline and were cut off", *key)
                self._end(entry)

    @staticmethod
    def _end(entry: tuple[Sequence[Any], float]) -> int:
        clients, _ = entry
        for client in clients:
            client.close()  # shuts the session down both ways: the worker's copy ends too
        return len(clients)
