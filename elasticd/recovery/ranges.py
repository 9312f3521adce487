"""Which payload blocks of an old rank's snapshot a new rank needs, from the snapshot's own
header and the new rank's local boxes (pure: no torch, no I/O).

After a change of world size a new rank's local shard of a DTensor covers rows that old ranks
held (:class:`elasticd.worker.shards.Resharder`). The worker sends, with ``ckpt_fetch``, the
box its new local shard has for each (global shape, placements) its DTensors have (``[[global
shape, placements, offsets, local shape], ...]``: the model's parameters give them, and an
optimizer's state of a parameter is sharded as the parameter is, so it needs no names and
exists before the first step; two parameters of one key with different boxes leave the key
out); the daemon, once it has read the old snapshot's header from a holder, fetches only the
checksum blocks that hold rows overlapping those boxes, instead of the whole snapshot.

A DTensor's local shard is stored row-major, so the rows of its first dimension that overlap
the box are one contiguous byte range (a superset of the elements needed when the overlap does
not span the other dimensions: the resharder reads within it). Entries that are not sharded,
or whose (global shape, placements) has no box, are needed whole.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable, Mapping, Sequence

from elasticd.snapshot.format import SnapshotHeader, dtensor_nodes

#: A new local shard's box: (offsets, shape) in the global tensor.
Box = tuple[Sequence[int], Sequence[int]]
#: What a box is for: (global shape, placements as the snapshot meta names them).
Key = tuple[tuple[int, ...], tuple[str, ...]]


def parse_boxes(value: Any, limit: int = 1 << 16) -> dict[Key, Box]:
    """``ckpt_fetch``'s ``need`` field (see the module docstring), checked: one entry per key,
    placements as the snapshot meta writes them (e.g. ``"S0"``, ``"R"``).

    Raises:
        ValueError: anything else, with what is wrong.
    """
    if not isinstance(value, list) or len(value) > limit:
        raise ValueError(f"need must be a list of at most {limit} boxes")
    out: dict[Key, Box] = {}
    for item in value:
        ok = (isinstance(item, list) and len(item) == 4
              and all(isinstance(p, list) for p in item)
              and len(item[0]) == len(item[2]) == len(item[3]) <= 64 and len(item[1]) <= 8
              and all(type(x) is int and x >= 0 for p in (item[0], item[2], item[3]) for x in p)
              and all(isinstance(x, str) and len(x) <= 8 for x in item[1]))
        if not ok:
            raise ValueError(f"need entry {str(item)[:80]} is not [global shape, placements, "
                             "offsets, local shape]")
        key = (tuple(item[0]), tuple(item[1]))
        if key in out:
            raise ValueError(f"need names {list(key[0])} {list(key[1])} twice")
        out[key] = (list(item[2]), list(item[3]))
    return out


def needed_bytes(header: SnapshotHeader, boxes: Mapping[Key, Box]) -> list[tuple[int, int]]:
    """The absolute byte ranges of the payload that hold what ``boxes`` need, sorted."""
    entries = header.layout.entries
    sharded: dict[int, tuple[Any, Any]] = {}
    for node in dtensor_nodes(header.meta):
        i, shape, placements = node.get("i"), node.get("shape"), node.get("placements")
        if (type(i) is int and 0 <= i < len(entries) and isinstance(shape, list)
                and isinstance(placements, list)):
            key = (tuple(shape), tuple(placements))
            try:
                hash(key)  # the boxes are looked up by it below
            except TypeError:  # unhashable junk (a list in a list) in a malformed meta: whole
                continue
            sharded[i] = (node.get("offsets"), key)
    out = []
    for i, e in enumerate(entries):
        if not e.nbytes:
            continue
        offsets, key = sharded.get(i, (None, None))
        box = boxes.get(key) if key is not None else None
        if (box is None or not isinstance(offsets, list) or not e.shape
                or not all(type(o) is int and o >= 0 for o in offsets)
                or not len(e.shape) == len(offsets) == len(box[0]) == len(box[1])):
            out.append((e.offset, e.offset + e.nbytes))  # not sharded, or unknown: whole
            continue
        rows = _overlap_rows(offsets, e.shape, box)
        if rows is None:
            continue  # no row of this old shard is in the new one
        per_row = e.nbytes // e.shape[0]
        out.append((e.offset + rows[0] * per_row, e.offset + rows[1] * per_row))
    return sorted(out)


def _overlap_rows(offsets: Sequence[int], shape: Sequence[int], box: Box
                  ) -> tuple[int, int] | None:
    """The rows (of the first dimension, relative to the old shard) in which the old shard
    ``(offsets, shape)`` overlaps ``box``; None when it does not overlap in every dimension."""
    rows = (0, 0)
    for d, (o, n, bo, bn) in enumerate(zip(offsets, shape, box[0], box[1])):
        lo, hi = max(o, bo), min(o + n, bo + bn)
        if lo >= hi:
            return None
        if d == 0:
            rows = (lo - o, hi - o)
    return rows


def needed_blocks(header: SnapshotHeader, boxes: Mapping[Key, Box]) -> list[int]:
    """The payload checksum blocks that hold every byte :func:`needed_bytes` names, in order
    (the unit a holder sends and the receiver checks)."""
    return blocks_holding(header, needed_bytes(header, boxes))


def blocks_holding(header: SnapshotHeader, ranges: Iterable[tuple[int, int]]) -> list[int]:
    """The payload checksum blocks that hold every byte of ``ranges`` (``[start, end)`` each,
    snapshot offsets; the header's bytes are no block's), in order."""
    lay = header.layout
    starts = [lay.block_range(i)[0] for i in range(lay.num_blocks)]
    blocks: set[int] = set()
    for start, end in ranges:
        if end <= lay.data_offset or start >= end:
            continue
        first = max(0, bisect.bisect_right(starts, start) - 1)
        last = bisect.bisect_right(starts, end - 1) - 1
        blocks.update(range(first, last + 1))
    return sorted(blocks)
