"""Injected time.

Everything that waits, times out or stamps a record takes a :class:`Clock`, so that tests can
drive time with :class:`FakeClock` instead of patching ``time``.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Source of time for the daemon and its parts."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for deadlines and durations)."""

    def wall(self) -> float:
        """Seconds since the epoch (for records other nodes read)."""

    def sleep(self, seconds: float) -> None:
        """Blocks for ``seconds``."""


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class FakeClock:
    """A clock that moves only when told to.

    ``sleep`` advances the clock instead of blocking, so code under test that sleeps in a loop
    runs instantly and deterministically.
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

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
