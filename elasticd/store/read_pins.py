"""The read pins of the checkpoint service: what a restore's reply holds until ``ckpt_release``.

A worker that opens a snapshot (``ckpt_open``, ``ckpt_fetch``) gets a read-only descriptor and
a pin; the pin keeps the slot from being reused (or a partial copy from being dropped) until the
worker releases it, or until ``ttl`` seconds have passed (its worker died without a word), or
its job leaves the node. One live partial copy per (job, rank) and caller: the pin of each is
remembered, so that asking again gives the earlier copy back first.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from elasticd.clock import Clock
from elasticd.local.wire import RequestError

__all__ = ["ReadPins"]

#: (job, rank, pid) of a worker asking for a partial copy.
Caller = tuple[str, int, Any]


class ReadPins:
    """Pins held for workers, each releasing what it holds once.

    Args:
        clock: when each pin was taken.
        ttl: seconds after which :meth:`sweep` drops a pin its worker never released.
    """

    def __init__(self, clock: Clock, ttl: float) -> None:
        self._clock, self._ttl = clock, ttl
        self._lock = threading.Lock()
        self._pins: dict[int, tuple[Callable[[], None], str, float]] = {}  # release, job, when
        self._scratch: dict[Caller, int] = {}  # the caller's live partial copy -> its pin
        self._next = 0

    def hold(self, descriptor: Callable[[], int], release: Callable[[], None], job: str,
             what: str, caller: Caller | None = None) -> tuple[int, int]:
        """A new read-only descriptor for the worker, and the pin that holds ``release`` until
        :meth:`release` (or the ttl); ``release`` is called at once when the descriptor cannot
        be made. ``caller``: whose partial copy this is (see :meth:`release_scratch`).

        Raises:
            RequestError: no descriptor (one line, for the worker).
        """
        try:
            fd = descriptor()
        except OSError as exc:
            release()
            raise RequestError(f"cannot hand over {what}: {exc}") from exc
        with self._lock:
            self._next += 1
            self._pins[self._next] = (release, job, self._clock.monotonic())
            if caller is not None:
                self._scratch[caller] = self._next
            return self._next, fd

    def release(self, pin: int) -> None:
        """Lets go of ``pin`` (nothing when it is not held)."""
        with self._lock:
            entry = self._pins.pop(pin, None)
        if entry is not None:
            entry[0]()

    def release_scratch(self, caller: Caller) -> None:
        """Gives ``caller``'s live partial copy back, if it holds one."""
        with self._lock:
            earlier = self._scratch.pop(caller, None)
        if earlier is not None:
            self.release(earlier)

    def sweep(self, job: str | None = None) -> None:
        """Drops the pins older than the ttl (their worker died), or all of ``job``'s."""
        now = self._clock.monotonic()
        with self._lock:
            releases = [self._pins.pop(p)[0] for p, (_, j, t) in list(self._pins.items())
                        if (j == job if job is not None else now - t > self._ttl)]
            self._scratch = {k: p for k, p in self._scratch.items() if p in self._pins}
        for release in releases:
            release()
