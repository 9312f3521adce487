"""How long a worker may go without progress: a timeout set by hand, or learned from the job.

Without ``--hang-timeout`` the timeout is learned from the job's own step intervals (the time
between a rank's consecutive progress reports, as the daemon receives them)::

    timeout = max(floor, FACTOR x the longest of each rank's last WINDOW intervals) x 2**k

Why the longest interval times 5, what the floor and the first steps' allowance cover, and why
each restart this rule caused doubles it (``k``, at most ``MAX_DOUBLINGS`` times): docs/jobs.md
("Hang detection"). ``WINDOW`` = 1000 intervals per rank is long enough to hold the job's
periodic long steps at ordinary step rates, short enough that one anomalous pause (a peer
frozen for a while) is forgotten after 1000 steps. The first :data:`WARMUP_STEPS` intervals of
each worker process are not learned from.

Everything here is a pure decision on numbers; the clock is the caller's
(:class:`elasticd.agent.progress.ProgressTracker`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

__all__ = ["FACTOR", "MAX_DOUBLINGS", "WARMUP_STEPS", "WINDOW", "LearnedTimeout", "SlidingMax",
           "StepHistory"]

FACTOR = 5.0
WINDOW = 1000
WARMUP_STEPS = 2
MAX_DOUBLINGS = 4


class SlidingMax:
    """The largest of the last ``size`` values added, in O(1) amortized per value.

    A monotonic deque: a value that a newer, larger one outlives can never be the maximum
    again, so it is dropped when that one arrives.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size!r}")
        self.size = size
        self._count = 0
        self._q: collections.deque[tuple[int, float]] = collections.deque()

    def add(self, value: float) -> None:
        while self._q and self._q[-1][1] <= value:
            self._q.pop()
        self._q.append((self._count, value))
        self._count += 1
        while self._q[0][0] <= self._count - 1 - self.size:
            self._q.popleft()

    def max(self) -> float | None:
        """The largest value in the window, or None before the first."""
        return self._q[0][1] if self._q else None

    def __len__(self) -> int:
        return min(self._count, self.size)


@dataclasses.dataclass
class StepHistory:
    """What a job's ranks taught about its step times on this node (kept across restarts of
    its worker group: the job is the same).

    Attributes:
        ranks: each rank's last :data:`WINDOW` intervals.
        doublings: restarts the learned timeout caused (each doubles it).
        learned: intervals learned in all.
    """

    ranks: dict[int, SlidingMax] = dataclasses.field(default_factory=dict)
    doublings: int = 0
    learned: int = 0

    def observe(self, rank: int, seconds: float) -> None:
        """Learns one completed step interval of ``rank`` (not a warm-up step)."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        self.ranks.setdefault(rank, SlidingMax(WINDOW)).add(seconds)
        self.learned += 1

    def longest(self) -> float | None:
        """The longest interval in any rank's window, or None before the first."""
        values = [v for v in (sm.max() for sm in self.ranks.values()) if v is not None]
        return max(values, default=None)


@dataclasses.dataclass(frozen=True)
class LearnedTimeout:
    """The learned rule's settings (see the module's docstring; its :data:`FACTOR`,
    :data:`WINDOW` and :data:`MAX_DOUBLINGS` are the rule's own).

    Args:
        first_step: the allowance for a worker process's first steps, seconds.
    """

    floor: float = 60.0
    first_step: float = 600.0

    def __post_init__(self) -> None:
        for name in ("floor", "first_step"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"learned hang timeout: {name} must be positive seconds, got "
                                 f"{value!r}")

    def timeout(self, history: StepHistory) -> float:
        """The timeout in force for a rank past its first steps."""
        longest = history.longest()
        base = max(self.floor, FACTOR * longest) if longest is not None else self.floor
        return base * 2 ** min(history.doublings, MAX_DOUBLINGS)

    def warmup_timeout(self, history: StepHistory) -> float:
        """The timeout for a worker process's first steps (and any step while nothing is
        learned)."""
        return max(self.first_step, self.timeout(history))

    def source(self, history: StepHistory) -> str:
        """``"learned"`` when the step times set the timeout, ``"floor"`` when the floor
        does (steps shorter than floor / factor; or nothing learned yet, when the tracker
        applies the first-step allowance instead)."""
        longest = history.longest()
        return "learned" if longest is not None and FACTOR * longest > self.floor \
            else "floor"

    def fired(self, history: StepHistory) -> None:
        """A restart this rule caused: the next timeout is doubled (up to the cap)."""
        history.doublings = min(history.doublings + 1, MAX_DOUBLINGS)

    def status(self, history: StepHistory) -> dict[str, Any]:
        """A JSON-able summary for ``/status``."""
        longest = history.longest()
        return {"floor_seconds": self.floor, "first_step_seconds": self.first_step,
                "factor": FACTOR, "window": WINDOW,
                "longest_step_seconds": None if longest is None else round(longest, 3),
                "steps_learned": history.learned, "doublings": history.doublings}
