"""Whether this agent trusts its own view of who is dead (provisional expiry, agent side).

An etcd paused past the TTL expires every lease when it resumes; each agent re-grants and
re-writes its record within a keep-alive period. So an agent whose own keep-alive failed, whose
lease was lost or whose watch broke counts no member as dead for 2 x TTL: what it sees missing
may be coming back. The keeper's thread, the watches' threads and the duty thread all report
failures here, hence the lock.
"""

from __future__ import annotations

import logging
import threading

from elasticd.clock import Clock

# The handler's logger: this is the handler's rule.
log = logging.getLogger("elasticd.rendezvous.handler")


class Trust:
    """Until when this agent counts nobody as dead.

    Args:
        ttl: the agent lease's TTL, seconds; a failure is distrusted for twice that.
    """

    def __init__(self, ttl: int, clock: Clock) -> None:
        self._span, self._clock = 2 * ttl, clock
        self._lock = threading.Lock()
        self._until = float("-inf")

    def distrust(self, reason: str) -> None:
        """Counts nobody as dead for 2 x TTL from now; logs it when the view was trusted."""
        with self._lock:
            now = self._clock.monotonic()
            news = self._until < now
            self._until = now + self._span  # later than before: the clock is read inside
        if news:
            log.info("rendezvous: counting no member as dead for %ds (%s)", self._span, reason)

    @property
    def until(self) -> float:
        """Monotonic time from which the view is trusted again (-inf: it is)."""
        return self._until

    def trusted(self) -> bool:
        return self._clock.monotonic() >= self._until
