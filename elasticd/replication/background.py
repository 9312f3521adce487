"""The replicator's background work: one thread pool for pushes, commits and repairs, whose
tracked tasks :meth:`Background.wait_idle` waits for (a test's or a drain's "nothing pending")."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)


class Background:
    """A thread pool that never lets a task's exception kill it, counts its tracked tasks and
    refuses new ones once closing."""

    def __init__(self, name: str, workers: int) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._name = name
        self._idle = threading.Condition()
        self._busy = 0
        self._closing = False

    def submit(self, fn: Callable[..., Any], *args: Any, track: bool = True) -> None:
        """Runs ``fn(*args)`` on the pool; ``track``: :meth:`wait_idle` waits for it."""
        with self._idle:
            if self._closing:
                return
            self._busy += track

        def run() -> None:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 — background work must never kill the pool
                log.exception("%s: %s failed", self._name, fn.__name__)
            finally:
                with self._idle:
                    self._busy -= track
                    self._idle.notify_all()

        try:
            self.executor.submit(run)
        except RuntimeError:  # shut down meanwhile
            with self._idle:
                self._busy -= track

    def wait_idle(self, timeout: float) -> bool:
        """Blocks (real time) until no tracked task is pending; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, max(0.0, timeout))

    def refuse(self) -> None:
        """Takes no new task from now on (those queued or running go on)."""
        with self._idle:
            self._closing = True

    def close(self) -> None:
        """Refuses new tasks, drops the queued ones and joins the running ones."""
        self.refuse()
        self.executor.shutdown(wait=True, cancel_futures=True)
