"""What a worker's Checkpointer tells the training script's log about elasticd: each kind of
failure once (then counted), and the daemon's word that the job is unprotected at most once a
minute, and once more when it is protected again. Worker side."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["EVERY", "Notices"]

log = logging.getLogger("elasticd.checkpoint")
EVERY = 60.0  # seconds between two warnings that the job is still unprotected


class Notices:
    """The warnings of one worker.

    Args:
        who: names the worker in the unprotected warnings (``job j rank 0``).
    """

    def __init__(self, who: str) -> None:
        #: Names the worker in the warnings (its rank may change in in-process mode).
        self.who = who
        self._warned: set[str] = set()
        self._said = ""  # what the daemon last said, "" while protected
        #: When the unprotected warning was last logged (monotonic), None while protected.
        self.warned_at: float | None = None

    def once(self, key: str, message: str) -> None:
        """Logs ``message`` the first time ``key`` comes."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning("elasticd: %s", message)

    def heard(self, reply: dict[str, Any] | None, now: float) -> None:
        """Warns (at most once a minute) while the daemon says the job is unprotected."""
        if reply is None:
            return
        said = reply.get("unprotected") or ""
        if said and (said != self._said or self.warned_at is None
                     or now - self.warned_at >= EVERY):
            log.warning("elasticd: %s: %s", self.who, said)
            self.warned_at = now
        elif not said and self._said:
            log.warning("elasticd: %s is protected again", self.who)
            self.warned_at = None
        self._said = said
