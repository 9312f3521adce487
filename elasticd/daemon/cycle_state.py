"""The daemon loop's own state: its pacing (wake and stop), the notes of the cycle under way,
and what the last completed cycle said and when (what ``/healthz`` and the watchdog judge)."""

from __future__ import annotations

import threading
from typing import Callable


class CycleState:
    """The pacing and the record of the daemon's cycles.

    Args:
        now: the monotonic time at creation (the loop counts as just cycled).

    Attributes:
        sentence: what the last completed cycle said ("starting" before the first).
        notes: what the cycle under way has to say so far.
    """

    def __init__(self, now: float) -> None:
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.sentence = "starting"
        self.cycles = 0
        self.notes: list[str] = []
        self.last_cycle = now

    def wake(self) -> None:
        """Ends the current wait at once (any thread)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait(self, seconds: float, idle: Callable[[], bool]) -> None:
        """Waits up to ``seconds`` for a wake-up; not at all unless ``idle()``."""
        if idle():
            self._wake.wait(seconds)
        self._wake.clear()

    def note(self, note: str | None) -> None:
        if note:
            self.notes.append(note)

    def finish(self, sentence: str, now: float) -> bool:
        """Records a completed cycle; True when its sentence differs from the last one's."""
        changed = sentence != self.sentence
        self.sentence = sentence
        self.cycles += 1
        self.last_cycle = now
        return changed
