"""A watch's events, handed from the watch thread to the loop that acts on them.

The daemon's loop follows the node records and the job manager the job records the same way:
list the prefix, watch from the revision after, queue each batch from the watch thread, and take
the queued batches at the next cycle. A batch that is an error (the watch broke, was compacted,
or re-created itself after etcd lost its data) carries no events but means what the loop holds
may be stale: the loop re-lists.
"""

from __future__ import annotations

import queue
from typing import Any, Callable, Sequence

from elasticd.coordination.api import Coordinator, WatchEvent


class WatchFeed:
    """One prefix watch whose batches wait in a queue for the loop.

    Args:
        keep: which events the loop wants (the rest are dropped on the watch thread).
        wake: called after each queued batch (wakes the loop).
    """

    def __init__(self, keep: Callable[[WatchEvent], bool] = lambda _e: True,
                 wake: Callable[[], None] = lambda: None) -> None:
        self._keep = keep
        self._wake = wake
        self._queue: "queue.Queue[Sequence[WatchEvent] | Exception]" = queue.Queue()
        self._watch: Any = None

    def start(self, coord: Coordinator, prefix: bytes, revision: int,
              prev_kv: bool = False) -> None:
        """Watches ``prefix`` from ``revision`` (the one after the listing's); with
        ``prev_kv`` each event carries the key as it was (only for a loop that reads it)."""
        self._watch = coord.watch_prefix(prefix, self.put, revision, prev_kv=prev_kv)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def put(self, batch: Sequence[WatchEvent] | Exception) -> None:
        """The watch callback (the watch thread)."""
        if not isinstance(batch, Exception):
            batch = [e for e in batch if self._keep(e)]
            if not batch:
                return
        self._queue.put(batch)
        self._wake()

    def empty(self) -> bool:
        return self._queue.empty()

    def take(self) -> tuple[list[WatchEvent], bool]:
        """Everything queued: the events in order, and whether the loop must re-list."""
        events: list[WatchEvent] = []
        stale = False
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return events, stale
            if isinstance(batch, Exception):
                stale = True
            else:
                events.extend(batch)
