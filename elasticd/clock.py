"""Injected time.

Everything that waits, times out or stamps a record takes a :class:`Clock`, so that tests can
drive time with a fake (``elasticd.testing.clock.FakeClock``) instead of patching ``time``. This
is the only module that imports ``time`` (``tests/unit/test_clock.py`` checks it): code with no
injection point (the CLI, code inside a worker or an agent) uses :data:`SYSTEM_CLOCK`.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol


class Clock(Protocol):
    """Source of time for the daemon and its parts."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for deadlines and durations)."""

    def wall(self) -> float:
        """Seconds since the epoch (for records other nodes read)."""

    def perf_counter(self) -> float:
        """Seconds on the finest clock there is (for measured durations)."""

    def sleep(self, seconds: float) -> None:
        """Blocks for ``seconds``."""

    def wait(self, cond: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
        """Polls ``cond`` (at once, then every ``interval`` seconds) until it holds or
        ``timeout`` seconds pass; returns its last answer."""


def poll(clock: Clock, cond: Callable[[], bool], timeout: float, interval: float) -> bool:
    """:meth:`Clock.wait` for any clock, sleeping on ``clock`` between two polls."""
    deadline = clock.monotonic() + timeout
    while not cond():
        left = deadline - clock.monotonic()
        if left <= 0:
            return False
        clock.sleep(min(interval, left))
    return True


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def perf_counter(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, cond: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
        return poll(self, cond, timeout, interval)


#: The real clock, for code with no injection point.
SYSTEM_CLOCK = SystemClock()


def format_local(at: float, fmt: str = "%Y-%m-%dT%H:%M:%S") -> str:
    """``at`` (seconds since the epoch) as local time in ``fmt`` (``time.strftime``'s codes)."""
    return time.strftime(fmt, time.localtime(at))


def thread_cpu() -> float:
    """CPU seconds the calling thread has used: a measurement for benches and stats, never a
    time a decision reads (those take a :class:`Clock`)."""
    return time.thread_time()
