"""How long one network call of the snapshot and recovery path may take.

A frozen peer (SIGSTOP, a black-holed port) keeps its sockets open and answers nothing, so a
per-receive socket timeout costs the whole timeout on every call that reaches it. Instead each
call gets a whole-call deadline sized to what it moves: ``floor + slack * bytes / rate``, where
``rate`` is the measured link rate (an exponentially weighted mean of recent transfers' bytes
per second, per peer) or, before any measurement, a conservative default. Pure: time is only
what callers report; no sockets here.
"""

from __future__ import annotations

import dataclasses
import threading

DEFAULT_FLOOR = 2.0  # seconds: see DeadlinePolicy.floor
#: Transfers smaller than this are mostly round trips: they say little about the link.
MIN_SAMPLE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class DeadlinePolicy:
    """The constants of :meth:`LinkRates.deadline`.

    Attributes:
        floor: seconds any call may take regardless of its size (round trips, a busy peer's
            scheduling).
        slack: factor over the expected transfer time (a link that slows down temporarily, a
            peer serving several fetches at once).
        default_rate: bytes/s assumed before a peer was measured: a rate most links beat.
    """

    floor: float = DEFAULT_FLOOR
    slack: float = 4.0
    default_rate: float = 50e6

    def __post_init__(self) -> None:
        if self.floor <= 0 or self.slack < 1 or self.default_rate <= 0:
            raise ValueError(f"deadline policy needs floor > 0, slack >= 1, default_rate > 0; "
                             f"got {self}")


class LinkRates:
    """Measured transfer rates, per peer; thread-safe (a striped fetch's threads share one).
    ``alpha``: the weight of the newest measurement in the mean."""

    def __init__(self, policy: DeadlinePolicy = DeadlinePolicy(),
                 alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.policy, self.alpha = policy, alpha
        self._rates: dict[str, float] = {}
        self._lock = threading.Lock()

    def rate(self, peer: str) -> float:
        """The measured rate to ``peer`` (bytes/s), or the policy's default."""
        with self._lock:
            return self._rates.get(peer, self.policy.default_rate)

    def record(self, peer: str, nbytes: int, seconds: float) -> None:
        """Adds one completed transfer; ignored when too small to measure the link."""
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        sample = nbytes / seconds
        with self._lock:
            old = self._rates.get(peer)
            self._rates[peer] = sample if old is None else (
                self.alpha * sample + (1 - self.alpha) * old)

    def deadline(self, peer: str, nbytes: int) -> float:
        """Seconds a call moving ``nbytes`` to or from ``peer`` may take."""
        if nbytes < 0:
            raise ValueError(f"a call moves nbytes >= 0, got {nbytes}")
        return self.policy.floor + self.policy.slack * nbytes / self.rate(peer)
