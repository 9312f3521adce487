"""Who is told of the commits a node learns, and in which order.

The persistent tier takes its flushes from the commits (every node learns the same ones, and
keeps its ranks' copies of the committed step until the next commit): the node's checkpoint
service listens here. Commits are learned on several threads (the watch, a re-read, this node's
own write as coordinator); the order the tracker learned them in is the order they are told in,
because :meth:`CommitFeed.claim` is called under the tracker's lock and the listeners run under
the feed's own lock, taken there and let go by :meth:`CommitFeed.tell`, after the tracker's lock
is released (a listener takes the service's and the slot store's locks, never the tracker's).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from elasticd.hooks import call_hooks
from elasticd.replication.api import Version

log = logging.getLogger(__name__)

Listener = Callable[[str, Version], None]


class CommitFeed:
    """The listeners of one node's commits (see the module docstring)."""

    def __init__(self) -> None:
        self.listeners: list[Listener] = []
        self._order = threading.Lock()

    def add(self, listener: Listener) -> None:
        """Calls ``listener(job, version)`` for each newer commit of a live generation."""
        self.listeners.append(listener)

    def claim(self, newer: bool) -> bool:
        """Call under the tracker's lock, for a commit just learned (``newer``: newer than the
        one before, of a generation not abandoned). True when :meth:`tell` must follow."""
        if not newer or not self.listeners:
            return False
        self._order.acquire()
        return True

    def tell(self, job: str, version: Version, claimed: bool) -> None:
        """Call after the tracker's lock is released, with :meth:`claim`'s answer."""
        if not claimed:
            return
        try:
            call_hooks(self.listeners, job, version, log=log,
                       failed=f"{job}: a listener of commit {version} failed")
        finally:
            self._order.release()
