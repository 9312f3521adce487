"""A thread that runs one function when it says it is next due, or sooner when woken.

The commit reporter's periodic work (:meth:`~elasticd.replication.reporter.Reporter.tick`)
runs on one: ``tick`` returns the seconds until it is due again, and whoever makes work due
earlier sets ``wake``. A simulator drives the same ``tick`` itself, without a :class:`Ticker`.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class Ticker:
    """Runs ``tick`` on a thread of its own, after the seconds its last call returned or when
    ``wake`` is set (by whoever makes work due before then), from :meth:`start` until
    :meth:`stop`; ``first``: seconds before the first call (and after one that raised).
    """

    def __init__(self, tick: Callable[[], float], wake: threading.Event, first: float,
                 name: str) -> None:
        self.tick, self.wake, self.first, self.name = tick, wake, first, name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
        self._thread.start()

    def _run(self) -> None:
        due_in = self.first
        while not self._stop.is_set():
            self.wake.wait(due_in)
            self.wake.clear()
            if self._stop.is_set():
                return
            try:
                due_in = self.tick()
            except Exception:  # noqa: BLE001 - the ticker must outlive a bug in one tick
                log.exception("%s failed", self.name)
                due_in = self.first

    def stop(self) -> None:
        """Ends the thread (waiting up to 5 s for a tick in progress)."""
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
