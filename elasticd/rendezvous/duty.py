"""The agent's duty thread: re-lists the control keys when asked, and steps the election.

It sleeps on the control copy's condition and wakes when the copy changed, when kicked (a watch
error, a lost lease, an event of the closer's node watch), when the step it last made is due,
and at least every :data:`WAKE_INTERVAL` seconds. A step that fails is logged and tried again
a second later: the duty must go on, as torch's agent does.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from elasticd.clock import Clock
from elasticd.rendezvous.control import Control

log = logging.getLogger("elasticd.rendezvous.handler")

#: While a rendezvous waits, look again at least this often, seconds (a wake-up bound, not a
#: re-list: the copy is re-listed only after a watch error or a lost lease).
WAKE_INTERVAL = 30.0


class Duty:
    """One thread that calls ``step`` (which returns when to step again; None: at the next
    change of the control keys).

    Attributes:
        stopped: whether :meth:`stop` was called (read under ``control.cond``).
    """

    def __init__(self, control: Control, clock: Clock,
                 step: Callable[[], float | None]) -> None:
        self._control, self._clock, self._step = control, clock, step
        self._thread: threading.Thread | None = None
        self._kicked = False
        self.stopped = False

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and not self.stopped

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rendezvous-duty", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """Steps now, even if the control keys did not change."""
        with self._control.cond:
            self._kicked = True
            self._control.cond.notify_all()

    def stop(self) -> None:
        with self._control.cond:
            self.stopped = True
            self._control.cond.notify_all()

    def _loop(self) -> None:
        cond, seen, wake_at = self._control.cond, -1, 0.0
        while True:
            with cond:
                while not self.stopped and not self._kicked and self._control.version == seen:
                    timeout = min(WAKE_INTERVAL, wake_at - self._clock.monotonic())
                    if timeout <= 0:
                        break
                    cond.wait(timeout)
                if self.stopped:
                    return
                self._kicked, seen = False, self._control.version
            try:
                due = self._step()
            except Exception as exc:  # noqa: BLE001 - the duty must go on (torch's agent too)
                log.warning("rendezvous duty: %s", exc)
                due = self._clock.monotonic() + 1.0
            wake_at = due if due is not None else self._clock.monotonic() + WAKE_INTERVAL
