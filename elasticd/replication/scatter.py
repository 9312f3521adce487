"""A fetch's bytes landing in more than one place: most in a buffer laid out like the snapshot,
some byte ranges straight in their final place (a worker's live tensors).

A reshard needs, of each old snapshot, the rows of its tensors that the new local shards hold,
whole checksum blocks around them, and the entries that are not sharded. Landed in restore
scratch and then copied into the live tensors, the rows are written twice; routed here, they
are written once, where the state reads them, and the rest of each block lands in the
staging buffer (bench/results/restore41/). A :class:`Scatter` stands where a fetch takes a
writable buffer (:func:`landing`); slicing it where no route lies gives that buffer's plain
``memoryview``, so a fetch with no routes takes exactly the path it takes without them, and a
slice across routes gives :class:`Spans`, which the channel fills part after part
(:meth:`~elasticd.replication.channel.Channel.recv_data_into`) and whose blocks are checked
against their tags by a streamed MAC over the parts (:class:`~elasticd.replication.runs.RunCheck`).
Nothing about what is checked changes: every block is checked over the bytes exactly as they
landed, wherever that is.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence


class Spans:
    """Consecutive bytes of a snapshot lying in several places: ``parts``, in order."""

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self.parts = list(parts)
        self._ends: list[int] = []
        total = 0
        for part in self.parts:
            total += len(part)
            self._ends.append(total)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @property
    def readonly(self) -> bool:
        return any(p.readonly for p in self.parts)

    def __getitem__(self, cut: slice) -> "memoryview | Spans":
        """Bytes ``[start, stop)`` of these: a plain view when they lie in one part."""
        start, stop, step = cut.indices(len(self))
        if step != 1:
            raise ValueError("Spans are sliced in steps of 1")
        if stop <= start:
            return memoryview(b"")
        first = bisect.bisect_right(self._ends, start)
        parts = []
        for i in range(first, len(self.parts)):
            begin = self._ends[i] - len(self.parts[i])
            if begin >= stop:
                break
            parts.append(self.parts[i][max(start, begin) - begin : min(stop, self._ends[i])
                                       - begin])
        return parts[0] if len(parts) == 1 else Spans(parts)

    def tobytes(self) -> bytes:
        return b"".join(p.tobytes() for p in self.parts)


class Scatter:
    """A snapshot's bytes as a fetch lands them: in ``staging`` (``len(staging)`` bytes laid
    out like the snapshot, offset 0 its first byte), except the byte ranges ``routes`` send
    elsewhere.

    Args:
        staging: the writable buffer the snapshot's other bytes land in (its header included:
            a route may not start before ``header_end``).
        routes: ``(snapshot offset, destination)`` of each byte range landing elsewhere, the
            destination a writable buffer of exactly the range's length.
        header_end: the first byte a route may cover.

    Raises:
        ValueError: routes that overlap, fall outside the staging buffer, cover the header or
            land in read-only memory.
    """

    def __init__(self, staging: Any, routes: Sequence[tuple[int, Any]],
                 header_end: int = 0) -> None:
        self.staging = memoryview(staging).cast("B")
        if self.staging.readonly:
            raise ValueError("the staging buffer is read-only")
        ordered = sorted(((int(at), memoryview(to).cast("B")) for at, to in routes),
                         key=lambda r: r[0])
        end = header_end
        for at, to in ordered:
            if to.readonly:
                raise ValueError(f"the route at offset {at} lands in read-only memory")
            if at < end or at + len(to) > len(self.staging):
                raise ValueError(f"the route of {len(to)} bytes at offset {at} overlaps another "
                                 f"or the header (before {header_end}), or passes the end "
                                 f"({len(self.staging)})")
            end = at + len(to)
        self.routes = [(at, to) for at, to in ordered if len(to)]
        self._starts = [at for at, _ in self.routes]

    readonly = False

    def __len__(self) -> int:
        return len(self.staging)

    def __getitem__(self, cut: slice) -> "memoryview | Spans":
        """Where bytes ``[start, stop)`` land: the staging buffer's own view when no route
        lies among them, else the :class:`Spans` of staging and routed parts in order."""
        start, stop, step = cut.indices(len(self.staging))
        if step != 1:
            raise ValueError("a Scatter is sliced in steps of 1")
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        parts, at = [], start
        while at < stop:
            if i < len(self.routes) and self.routes[i][0] + len(self.routes[i][1]) <= at:
                i += 1
                continue
            if i < len(self.routes) and self.routes[i][0] <= at:
                begin, to = self.routes[i]
                end = min(stop, begin + len(to))
                parts.append(to[at - begin : end - begin])
            else:
                end = min(stop, self.routes[i][0]) if i < len(self.routes) else stop
                parts.append(self.staging[at:end])
            at = end
        if not parts:
            return self.staging[start:start]
        return parts[0] if len(parts) == 1 else Spans(parts)


def landing(buf: Any, size: int | None = None) -> "memoryview | Scatter":
    """``buf`` as the bytes a fetch lands in: a :class:`Scatter` as it is, any other buffer
    as a flat ``memoryview`` of its bytes (its first ``size`` when given)."""
    if isinstance(buf, Scatter):
        return buf
    return memoryview(buf).cast("B")[:size]


def staged(buf: Any) -> memoryview:
    """The bytes of ``buf`` a snapshot's header lands in and is read back from: a
    :class:`Scatter`'s staging buffer, any other buffer's own bytes."""
    return buf.staging if isinstance(buf, Scatter) else memoryview(buf).cast("B")
