"""A :class:`~elasticd.clock.Clock` that moves only when told to, for tests and benchmarks."""

from __future__ import annotations

import threading
from typing import Callable

from elasticd.clock import poll


class FakeClock:
    """A clock that moves only when told to.

    ``sleep`` advances the clock instead of blocking, and so does ``wait`` between its polls,
    so code under test that sleeps or waits in a loop runs instantly and deterministically and
    a loop that waits for something that never comes ends by its timeout.
    """

    def __init__(self, start: float = 1_000.0, wall_offset: float = 1.7e9) -> None:
        self._now = start
        self._wall_offset = wall_offset
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def wall(self) -> float:
        with self._lock:
            return self._now + self._wall_offset

    def perf_counter(self) -> float:
        return self.monotonic()

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def wait(self, cond: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
        return poll(self, cond, timeout, interval)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
