"""An in-process :class:`~elasticd.replication.api.Sink` for tests and benchmarks, and a decoder
of one whole frame held in memory (the wire tests'; the daemon reads frames off sockets).

It keeps the newest held copy of each shard in a ``bytearray`` and records every
begin/landed/abort, so tests can assert that a torn transfer was aborted and never landed.
A byte budget bounds what it holds (held plus in flight), as the shared-memory sink's will.
"""

from __future__ import annotations

import threading
from typing import Any

from elasticd.replication.api import NO_SPACE, Descriptor, Refused, Sink, Version
from elasticd.replication.messages import Message, decode_payload, open_payload
from elasticd.replication.seal import FrameKey
from elasticd.replication.wire import (
    HEADER_SIZE,
    Limits,
    MalformedFrame,
    TruncatedFrame,
    parse_header,
)


class MemorySink(Sink):
    """Snapshots in process memory.

    Args:
        capacity_bytes: most bytes held at once, held and in flight; None for no limit.

    Attributes:
        events: ``(event, descriptor, reason)`` tuples in order, event one of
            ``"begin"``, ``"landed"``, ``"abort"``.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        super().__init__()
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.events: list[tuple[str, Descriptor, str]] = []
        self._pending: dict[Descriptor, bytearray] = {}
        self._held: dict[tuple[str, int], tuple[Descriptor, bytearray]] = {}
        self._tags: dict[tuple[str, int], Any] = {}
        self._mem_lock = threading.Lock()  # allocate runs outside the base class's lock

    def allocate(self, d: Descriptor) -> memoryview:
        with self._mem_lock:
            used = sum(len(b) for b in self._pending.values())
            used += sum(len(b) for _, b in self._held.values())
            if self.capacity_bytes is not None and used + d.total_bytes > self.capacity_bytes:
                raise Refused(NO_SPACE, f"{d.total_bytes} bytes offered, {used} of "
                                        f"{self.capacity_bytes} in use")
            buf = bytearray(d.total_bytes)
            self._pending[d] = buf
            self.events.append(("begin", d, ""))
        return memoryview(buf)

    def publish(self, d: Descriptor, tags: Any = None) -> None:
        with self._mem_lock:
            self._held[d.shard] = (d, self._pending.pop(d))
            self._tags[d.shard] = tags
            self.events.append(("landed", d, ""))

    def tags(self, d: Descriptor) -> Any:
        with self._mem_lock:
            held = self._held.get(d.shard)
            return self._tags.get(d.shard) if held is not None and held[0] == d else None

    def discard(self, d: Descriptor, reason: str) -> None:
        with self._mem_lock:
            self._pending.pop(d, None)
            self.events.append(("abort", d, reason))

    def held(self, job: str, owner_rank: int) -> Descriptor | None:
        with self._mem_lock:
            entry = self._held.get((job, owner_rank))
        return entry[0] if entry else None

    def lookup(self, job: str, owner_rank: int,
               version: Version | None) -> tuple[Descriptor, memoryview] | None:
        with self._mem_lock:
            entry = self._held.get((job, owner_rank))
        if entry is None or (version is not None and entry[0].version != tuple(version)):
            return None
        # Read-only: a fetch must never write into a held copy.
        return entry[0], memoryview(entry[1]).toreadonly()

    def get(self, job: str, owner_rank: int) -> bytes | None:
        """The held bytes of a shard (a copy; for tests)."""
        with self._mem_lock:
            entry = self._held.get((job, owner_rank))
        return bytes(entry[1]) if entry else None


def decode_frame(buf: bytes | bytearray | memoryview, limits: Limits = Limits(),
                 key: FrameKey | None = None) -> Message:
    """Decodes exactly one whole frame held in memory; sealed ones need ``key``.

    Raises:
        ProtocolError: whatever is wrong with it; nothing else.
    """
    view = memoryview(buf).cast("B")
    if len(view) < HEADER_SIZE:
        raise TruncatedFrame(f"{len(view)} bytes cannot hold a {HEADER_SIZE}-byte frame header")
    header = parse_header(view[:HEADER_SIZE], limits)
    payload = view[HEADER_SIZE:]
    if len(payload) < header.length:
        raise TruncatedFrame(f"{header.type.name} frame announces {header.length} bytes, "
                             f"{len(payload)} present")
    if len(payload) > header.length:
        raise MalformedFrame(f"{len(payload) - header.length} bytes after a "
                             f"{header.type.name} frame")
    open_payload(header, key, payload)
    return decode_payload(header, payload)
