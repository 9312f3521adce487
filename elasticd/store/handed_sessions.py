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

log = logging.getLogger(__name__)

#: Seconds a handed set lives when the request names none, and the most it may name.
SESSION_SECONDS = 600.0
MAX_SESSION_SECONDS = 1800.0

Key = tuple[str, int, int]  # (job, rank asking, old rank)


class HandedSessions:
    """The live sets of handed sessions, by (job, rank, old rank)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: dict[Key, tuple[Sequence[Any], threading.Timer]] = {}

    def give(self, key: Key, clients: Sequence[Any], seconds: float) -> None:
        """Keeps ``clients`` (the daemon's side of the sessions just handed over for ``key``)
        until ``seconds`` from now; ends the set ``key`` had before."""
        timer = threading.Timer(seconds, self._expire, args=(key, clients))
        timer.daemon = True
        with self._lock:
            old = self._sets.pop(key, None)
            self._sets[key] = (clients, timer)
        timer.start()
        if old is not None:
            self._end(old)

    def cut_off(self, key: Key) -> int:
        """Ends ``key``'s live set now; returns how many sessions it had."""
        with self._lock:
            found = self._sets.pop(key, None)
        return self._end(found) if found is not None else 0

    def live(self) -> int:
        """Sessions handed over and not cut off yet."""
        with self._lock:
            return sum(len(clients) for clients, _ in self._sets.values())

    def cut_off_job(self, job: str) -> int:
        """Ends every set of ``job`` (it left the node); returns how many sessions they had."""
        with self._lock:
            found = [self._sets.pop(k) for k in [k for k in self._sets if k[0] == job]]
        return sum(self._end(entry) for entry in found)

    def _expire(self, key: Key, clients: Sequence[Any]) -> None:
        with self._lock:
            entry = self._sets.get(key)
            if entry is None or entry[0] is not clients:  # replaced meanwhile
                return
            del self._sets[key]
        log.info("%s rank %d: the sessions handed over for old rank %d reached their deadline "
                 "and were cut off", *key)
        self._end(entry)

    @staticmethod
    def _end(entry: tuple[Sequence[Any], threading.Timer]) -> int:
        clients, timer = entry
        timer.cancel()
        for client in clients:
            client.close()  # shuts the session down both ways: the worker's copy ends too
        return len(clients)
