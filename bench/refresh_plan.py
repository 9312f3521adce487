"""When the scale simulator's keep-alive process refreshes each lease, and on which stream.

A lease is refreshed TTL/3 after its last refresh was sent (at once if the answer came later),
as elasticd's :class:`~elasticd.coordination.lease.LeaseKeeper` does. Its stream is its ID
modulo the streams, or, given its node's slot (``by_node``), the node's own stream, and then its
refresh goes with the next one due on that stream when that one comes sooner: a refresh a
little earlier than TTL/3 after the last, never later. Once a node's daemon and agent leases
were sent together, their answers come back together and their next refreshes fall due
together: one DATA frame sent and one read per node per TTL/3 instead of two. In the keep-alive
process a send and a read on a stream of its own cost ~50 us each (asyncio's hand-offs, the
syscalls): at N = 1,000, 3,000 refreshes a second on a stream per node, that was ~1/3 of a
core of this 2-core machine, for what a real node's daemon and agent do 3 times a second on
machines of their own. etcd receives the same LeaseKeepAlive messages, in half the frames.
"""

from __future__ import annotations

import heapq


class RefreshPlan:
    """Each lease's next refresh (see the module docstring); times are monotonic seconds."""

    def __init__(self, streams: int, by_node: bool) -> None:
        self.streams, self.by_node = streams, by_node
        self._heap: list[tuple[float, int]] = []
        self._stream_of: dict[int, int] = {}  # lease -> its node's stream (by_node)
        self._next: dict[int, float] = {}  # stream -> the soonest refresh scheduled on it

    def stream(self, lease: int) -> int:
        k = self._stream_of.get(lease)
        return lease % self.streams if k is None else k

    def add(self, lease: int, slot: int | None, due: float, now: float) -> None:
        """A new lease (of node ``slot``, if known): first refreshed at ``due`` or sooner."""
        if self.by_node and slot is not None:
            self._stream_of[lease] = slot % self.streams
        self.schedule(lease, due, now)

    def remove(self, lease: int) -> None:
        self._stream_of.pop(lease, None)  # a heap entry left behind is skipped by its owner

    def schedule(self, lease: int, due: float, now: float) -> float:
        """The lease's next refresh at ``due``, or with its stream's next one if that one
        comes sooner (``by_node``); returns when."""
        k = self._stream_of.get(lease)
        if k is not None:
            d = self._next.get(k)
            if d is not None and now < d < due:
                due = d
            elif d is None or d <= now or due < d:
                self._next[k] = due
        heapq.heappush(self._heap, (due, lease))
        return due

    def retry(self, lease: int, at: float) -> None:
        """Sent again at ``at`` whatever the stream's others do (its stream was reopening)."""
        heapq.heappush(self._heap, (at, lease))

    def due(self, now: float) -> list[tuple[float, int]]:
        """Every (due time, lease) due by ``now``, removed from the plan, soonest first."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            out.append(heapq.heappop(heap))
        return out
