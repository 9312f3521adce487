"""Reading snapshots: header parsing and validation, payload verification.

Everything a snapshot's bytes claim is checked before it is used, because those bytes may come
from a peer or from a segment a crashed process left half-written: :func:`parse_header` turns any
bad input into a :class:`~elasticd.snapshot.format.SnapshotError` subclass whose message says
what is wrong (truncated, corrupt, or the wrong job/rank/world size/format version), never into
another exception. Like :mod:`~elasticd.snapshot.format`, this module never imports torch.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import xxhash

from elasticd.snapshot.format import (
    _PREAMBLE,
    ALIGNMENT,
    DTYPES,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_SIZE,
    PREAMBLE_SIZE,
    CorruptSnapshot,
    Entry,
    Layout,
    SnapshotHeader,
    SnapshotMismatch,
    TruncatedSnapshot,
    _digest,
    _short,
    byte_view,
)


def verify_block(header: SnapshotHeader, index: int, data: Any) -> None:
    """Checks one payload block (e.g. as it arrives over the network).

    Raises:
        CorruptSnapshot: wrong length or checksum mismatch.
    """
    start, end = header.layout.block_range(index)
    view = byte_view(data)
    if len(view) != end - start:
        raise CorruptSnapshot(f"block {index}: {len(view)} bytes, expected {end - start}")
    got = xxhash.xxh3_64_intdigest(view)
    if got != header.blocks[index]:
        raise CorruptSnapshot(
            f"{header.job} rank {header.rank} step {header.step}: payload block {index} "
            f"(bytes {start}..{end}) checksum {got:016x} != {header.blocks[index]:016x}"
        )


def verify_payload(buf: Any, header: SnapshotHeader) -> None:
    """Checks every payload block of ``buf`` against ``header`` (raises CorruptSnapshot)."""
    view = byte_view(buf)
    for i in range(header.layout.num_blocks):
        a, b = header.layout.block_range(i)
        verify_block(header, i, view[a:b])


_HEX16 = re.compile(r"[0-9a-f]{16}")


def _get(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise CorruptSnapshot(f"{where}: header lacks field {key!r}")
    return obj[key]


def _int(obj: dict[str, Any], key: str, where: str, minimum: int = 0) -> int:
    value = _get(obj, key, where)
    # bool is an int subclass; a header saying "rank": true is corrupt, not rank 1.
    if type(value) is not int or value < minimum:
        raise CorruptSnapshot(
            f"{where}: header field {key!r} must be an integer >= {minimum}, found {_short(value)}"
        )
    return value


def _entry_from_json(raw: Any, index: int, where: str) -> Entry:
    here = f"{where}: entry {index}"
    if not isinstance(raw, dict):
        raise CorruptSnapshot(f"{here} is not an object: {_short(raw)}")
    name, dtype, shape = _get(raw, "name", here), _get(raw, "dtype", here), _get(raw, "shape", here)
    if not isinstance(name, str):
        raise CorruptSnapshot(f"{here}: name must be a string, found {_short(name)}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CorruptSnapshot(f"{here} ({name!r}): unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
        raise CorruptSnapshot(f"{here} ({name!r}): bad shape {_short(shape)}")
    offset, nbytes = _int(raw, "offset", here), _int(raw, "nbytes", here)
    if nbytes != math.prod(shape) * DTYPES[dtype][0]:
        raise CorruptSnapshot(
            f"{here} ({name!r}): {nbytes} bytes do not match {dtype} of shape {tuple(shape)}"
        )
    if offset % ALIGNMENT:
        raise CorruptSnapshot(f"{here} ({name!r}): offset {offset} not aligned to {ALIGNMENT}")
    return Entry(name, dtype, tuple(shape), offset, nbytes)


def _header_from_json(obj: Any, header_end: int, where: str) -> SnapshotHeader:
    if not isinstance(obj, dict):
        raise CorruptSnapshot(f"{where}: header is not a JSON object")
    job = _get(obj, "job", where)
    if not isinstance(job, str):
        raise CorruptSnapshot(f"{where}: job must be a string, found {_short(job)}")
    world_size = _int(obj, "world_size", where, minimum=1)
    rank = _int(obj, "rank", where)
    if rank >= world_size:
        raise CorruptSnapshot(f"{where}: rank {rank} outside world size {world_size}")
    data_offset = _int(obj, "data_offset", where, minimum=header_end)
    total_size = _int(obj, "total_size", where, minimum=data_offset)
    block_size = _int(obj, "block_size", where, minimum=1)
    raw_entries, raw_blocks = _get(obj, "entries", where), _get(obj, "blocks", where)
    meta = _get(obj, "meta", where)
    if not isinstance(meta, dict):
        raise CorruptSnapshot(f"{where}: meta must be a JSON object, found {_short(meta)}")
    if not isinstance(raw_entries, list):
        raise CorruptSnapshot(f"{where}: entries must be a list, found {_short(raw_entries)}")
    entries, names, end = [], set(), data_offset
    for i, raw in enumerate(raw_entries):
        e = _entry_from_json(raw, i, where)
        if e.name in names:
            raise CorruptSnapshot(f"{where}: duplicate entry name {e.name!r}")
        if e.offset < end or e.offset + e.nbytes > total_size:
            raise CorruptSnapshot(
                f"{where}: entry {e.name!r} at {e.offset}..{e.offset + e.nbytes} overlaps its "
                f"neighbour or lies outside the payload {data_offset}..{total_size}"
            )
        names.add(e.name)
        entries.append(e)
        end = e.offset + e.nbytes
    lay = Layout(tuple(entries), data_offset, total_size, block_size)
    if not isinstance(raw_blocks, list) or len(raw_blocks) != lay.num_blocks:
        raise CorruptSnapshot(
            f"{where}: expected {lay.num_blocks} payload block checksums, found {_short(raw_blocks)}"
        )
    blocks = []
    for b in raw_blocks:
        if not isinstance(b, str) or not _HEX16.fullmatch(b):
            raise CorruptSnapshot(f"{where}: bad block checksum {_short(b)}")
        blocks.append(int(b, 16))
    return SnapshotHeader(job=job, step=_int(obj, "step", where),
                          generation=_int(obj, "generation", where), rank=rank,
                          world_size=world_size, layout=lay, meta=meta, blocks=tuple(blocks))


def parse_header(
    buf: Any,
    *,
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    where: str = "snapshot",
) -> SnapshotHeader:
    """Reads and checks a snapshot's header (not its payload: see :class:`SnapshotReader`).

    Args:
        buf: the snapshot's bytes; may be longer than the snapshot.
        job, rank, world_size: when given, a snapshot for anything else is rejected.
        where: names the snapshot in error messages (a path, a peer).

    Raises:
        TruncatedSnapshot: ``buf`` ends before the header or the payload it announces.
        CorruptSnapshot: bad magic, header checksum mismatch, or an invalid header.
        SnapshotMismatch: a newer format version, or another job, rank or world size.
    """
    view = byte_view(buf)
    if len(view) < PREAMBLE_SIZE:
        raise TruncatedSnapshot(
            f"{where}: {len(view)} bytes, shorter than the {PREAMBLE_SIZE}-byte preamble"
        )
    magic, version, header_len, digest = _PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise CorruptSnapshot(f"{where}: bad magic {magic!r} (not a complete elasticd snapshot)")
    if version == 0:
        raise CorruptSnapshot(f"{where}: format version 0 is not valid")
    if version > FORMAT_VERSION:
        raise SnapshotMismatch(
            f"{where}: written in snapshot format v{version}, this elasticd reads up to "
            f"v{FORMAT_VERSION}; upgrade elasticd on this node"
        )
    if header_len > MAX_HEADER_SIZE:
        raise CorruptSnapshot(f"{where}: header length {header_len} exceeds {MAX_HEADER_SIZE}")
    header_end = PREAMBLE_SIZE + header_len
    if len(view) < header_end:
        raise TruncatedSnapshot(
            f"{where}: header announces {header_len} bytes, buffer ends {header_end - len(view)} "
            "bytes short"
        )
    body = view[PREAMBLE_SIZE:header_end]
    if _digest(version, body) != digest:
        raise CorruptSnapshot(f"{where}: header checksum mismatch (header bytes were altered)")
    try:
        obj = json.loads(bytes(body))
    except (ValueError, RecursionError) as exc:
        raise CorruptSnapshot(f"{where}: header is not valid JSON ({exc})") from exc
    header = _header_from_json(obj, header_end, where)
    for field, want, got in (("job", job, header.job), ("rank", rank, header.rank),
                             ("world size", world_size, header.world_size)):
        if want is not None and want != got:
            raise SnapshotMismatch(f"{where}: snapshot is for {field} {got!r}, expected {want!r}")
    if len(view) < header.layout.total_size:
        raise TruncatedSnapshot(
            f"{where}: snapshot of {header.layout.total_size} bytes, buffer ends "
            f"{header.layout.total_size - len(view)} bytes short"
        )
    return header


class SnapshotReader:
    """A checked snapshot in any buffer (bytes, mmap, memoryview): its :attr:`header`.

    Args:
        buf, job, rank, world_size, where: as for :func:`parse_header`.
        verify: check every payload block now (:func:`verify_payload`).

    Raises:
        SnapshotError: see :func:`parse_header`, plus CorruptSnapshot for a payload mismatch.
    """

    def __init__(
        self,
        buf: Any,
        *,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        verify: bool = True,
        where: str = "snapshot",
    ) -> None:
        view = byte_view(buf)
        self.header = parse_header(view, job=job, rank=rank, world_size=world_size, where=where)
        if verify:
            verify_payload(view, self.header)
