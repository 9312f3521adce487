"""The snapshot format: one rank's state at one step, as a checksummed header plus raw bytes.

The same bytes live in a daemon's shared memory, travel between daemons and are checked by every
reader, so the format is self-describing and never executes anything it reads (JSON, not pickle)::

    offset 0    preamble (24 bytes, little endian): magic b"ELSDSNAP", format version (u32),
                header length (u32), xxh3_64 of the preamble's first 16 bytes + the header (u64)
    offset 24   header: UTF-8 JSON object (job, step, generation, rank, world size, entries,
                payload block checksums, and a small JSON "meta" blob for plain-value extras)
    data_offset payload: each entry's raw bytes at its own offset, aligned to ALIGNMENT

The payload is checksummed in fixed-size blocks (xxh3_64, ~26 GB/s here) rather than as one
digest, so that a replicator streaming 4 MiB chunks can verify each block as it arrives and a
reader can verify only the entries it touches. Everything here is numpy and xxhash only: the
daemon side must not import torch. Dtypes are named as torch names them (``"bfloat16"``), and
dtypes numpy lacks are viewed as unsigned integers of the same width. This module writes and
describes snapshots; :mod:`elasticd.snapshot.reader` parses and verifies them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from typing import Any, Iterable, Iterator

import xxhash

from elasticd.errors import CheckpointError

MAGIC = b"ELSDSNAP"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<8sIIQ")
PREAMBLE_SIZE = _PREAMBLE.size
#: Every entry starts at a multiple of this (a cache line; also enough for any dtype and SIMD copy).
ALIGNMENT = 64
#: The payload starts on a page boundary, so that pinning or registering it for DMA later works.
DATA_ALIGNMENT = 4096
#: Payload checksum granularity: the unit a reshard fetches (whole blocks around the rows a new
#: rank needs) and a block tag checks. 1 MiB, not 4: a resharding restore fetched 727 MB per new
#: rank for 577 MB of rows at 4 MiB, 616 MB at 1 MiB (bench/results/restore25/), and consecutive
#: blocks travel in runs of up to the replication chunk (4 MiB) a frame, so smaller blocks cost
#: no more frames, only a tag check per block.
DEFAULT_BLOCK_SIZE = 1 << 20
#: A larger header is taken for corruption rather than allocated.
MAX_HEADER_SIZE = 64 << 20
#: A snapshot's job name as the slot store and the persistence tier take it: it names a
#: directory in each (no separator, no leading dot, at most 128 characters).
JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

#: dtype name (torch's spelling) -> (item size, numpy dtype or None when numpy lacks it).
DTYPES: dict[str, tuple[int, str | None]] = {
    "float64": (8, "float64"),
    "float32": (4, "float32"),
    "float16": (2, "float16"),
    "bfloat16": (2, None),
    "complex128": (16, "complex128"),
    "complex64": (8, "complex64"),
    "complex32": (4, None),
    "int64": (8, "int64"),
    "int32": (4, "int32"),
    "int16": (2, "int16"),
    "int8": (1, "int8"),
    "uint64": (8, "uint64"),
    "uint32": (4, "uint32"),
    "uint16": (2, "uint16"),
    "uint8": (1, "uint8"),
    "bool": (1, "bool"),
    "float8_e4m3fn": (1, None),
    "float8_e5m2": (1, None),
    "float8_e4m3fnuz": (1, None),
    "float8_e5m2fnuz": (1, None),
    "float8_e8m0fnu": (1, None),
    "float4_e2m1fn_x2": (1, None),
}


class SnapshotError(CheckpointError):
    """Base class: these bytes are not a usable snapshot. The message says what is wrong."""


class TruncatedSnapshot(SnapshotError):
    """The buffer ends before the header or the payload it announces."""


class CorruptSnapshot(SnapshotError):
    """Bad magic, a checksum mismatch, or a header that is not a valid description."""


class SnapshotMismatch(SnapshotError):
    """A valid snapshot, but not the one asked for (job, rank, world size) or a newer format."""


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor to be placed: its name, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor {self.name!r}: unsupported dtype {self.dtype!r}")
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: bad shape {self.shape!r}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][0]


@dataclasses.dataclass(frozen=True)
class Entry:
    """A placed tensor: ``nbytes`` raw bytes at absolute ``offset`` in the snapshot."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every entry goes, where the payload starts and how big the snapshot is.

    Attributes:
        entries: in payload order (ascending offsets).
        data_offset: start of the payload; the header must fit below it.
        total_size: bytes the whole snapshot occupies (header reserve plus payload).
    """

    entries: tuple[Entry, ...]
    data_offset: int
    total_size: int
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def num_blocks(self) -> int:
        return -(-(self.total_size - self.data_offset) // self.block_size)

    def block_range(self, index: int) -> tuple[int, int]:
        """Absolute ``[start, end)`` of payload block ``index``."""
        if not 0 <= index < self.num_blocks:
            raise IndexError(f"block {index} out of range (snapshot has {self.num_blocks})")
        start = self.data_offset + index * self.block_size
        return start, min(start + self.block_size, self.total_size)


@dataclasses.dataclass(frozen=True)
class SnapshotHeader:
    """Everything a snapshot says about itself.

    ``blocks`` holds one xxh3_64 per payload block; it is empty until :func:`seal` fills it.
    """

    job: str
    step: int
    generation: int
    rank: int
    world_size: int
    layout: Layout
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    blocks: tuple[int, ...] = ()

    def version(self) -> tuple[int, int]:
        """Ordering key: a higher (generation, step) is newer."""
        return (self.generation, self.step)


def layout_json(lay: Layout, blocks: Iterable[int]) -> dict[str, Any]:
    """The header's fields that describe ``lay`` and its block checksums ``blocks``."""
    return {"data_offset": lay.data_offset, "total_size": lay.total_size,
            "block_size": lay.block_size,
            # Hex strings, not JSON numbers: 64-bit values lose precision in many JSON readers.
            "blocks": [f"{b:016x}" for b in blocks],
            "entries": [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape),
                         "offset": e.offset, "nbytes": e.nbytes} for e in lay.entries]}


def _header_json(h: SnapshotHeader) -> dict[str, Any]:
    return {"job": h.job, "step": h.step, "generation": h.generation, "rank": h.rank,
            "world_size": h.world_size, **layout_json(h.layout, h.blocks), "meta": h.meta}


def _encode_body(h: SnapshotHeader) -> bytes:
    try:
        return json.dumps(_header_json(h), separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"snapshot meta is not plain JSON: {exc}") from exc


def _digest(version: int, body: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(_PREAMBLE.pack(MAGIC, version, len(body), 0)[:16])
    h.update(body)
    return h.intdigest()


def encode_header(header: SnapshotHeader) -> bytes:
    """Preamble plus JSON header, ready to be written at offset 0.

    Raises:
        ValueError: the header is not sealed, or does not fit below ``layout.data_offset``
            (the layout was computed for another job name or meta).
    """
    if len(header.blocks) != header.layout.num_blocks:
        raise ValueError(
            f"header has {len(header.blocks)} block checksums, layout needs "
            f"{header.layout.num_blocks}: seal() the snapshot first"
        )
    body = _encode_body(header)
    if PREAMBLE_SIZE + len(body) > header.layout.data_offset:
        raise ValueError(
            f"header needs {PREAMBLE_SIZE + len(body)} bytes but the layout reserves "
            f"{header.layout.data_offset}: compute the layout with this job and meta"
        )
    return _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(body), _digest(FORMAT_VERSION, body)) + body


def layout(
    specs: Iterable[TensorSpec],
    *,
    job: str,
    meta: dict[str, Any] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Layout:
    """Places ``specs`` after a header reserve big enough for any step, rank and checksums.

    Args:
        specs: tensors in the order they should appear. Names must be unique.
        job, meta: the job name and meta blob the header will carry (they size the reserve).

    Raises:
        ValueError: duplicate names, a bad block size, or meta that is not plain JSON.
    """
    specs = list(specs)
    if block_size <= 0 or block_size % ALIGNMENT:
        raise ValueError(f"block_size must be a positive multiple of {ALIGNMENT}, got {block_size}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dup[:5]}")
    offsets, payload = [], 0
    for s in specs:
        offsets.append(payload)
        payload = _align(payload + s.nbytes, ALIGNMENT)
    # Size the reserve with the widest values the header can hold, so any real header fits.
    big = 2**63 - 1
    probe = Layout(tuple(Entry(s.name, s.dtype, tuple(s.shape), big, s.nbytes) for s in specs),
                   big, big, block_size)
    nblocks = -(-payload // block_size)
    body = _encode_body(SnapshotHeader(job, big, big, big, big, probe, meta or {}, (big,) * nblocks))
    data_offset = _align(PREAMBLE_SIZE + len(body) + 64, DATA_ALIGNMENT)
    entries = tuple(Entry(s.name, s.dtype, tuple(s.shape), data_offset + off, s.nbytes)
                    for s, off in zip(specs, offsets))
    return Layout(entries, data_offset, data_offset + payload, block_size)


def byte_view(buf: Any) -> memoryview:
    """A flat, unsigned-byte memoryview of any buffer (bytes, mmap, numpy array), no copy."""
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def checksum_blocks(buf: Any, lay: Layout) -> tuple[int, ...]:
    """xxh3_64 of every payload block of ``buf`` laid out as ``lay``."""
    view = byte_view(buf)
    if len(view) < lay.total_size:
        raise TruncatedSnapshot(f"buffer holds {len(view)} bytes, layout needs {lay.total_size}")
    return tuple(xxhash.xxh3_64_intdigest(view[slice(*lay.block_range(i))])
                 for i in range(lay.num_blocks))


def seal(buf: Any, header: SnapshotHeader) -> SnapshotHeader:
    """Checksums the payload already in ``buf`` and writes the header, the snapshot's last
    write; returns the header with its block checksums filled in."""
    view = byte_view(buf)
    sealed = dataclasses.replace(header, blocks=checksum_blocks(view, header.layout))
    write_header(view, sealed)
    return sealed


def write_header(buf: Any, header: SnapshotHeader) -> None:
    """Writes a sealed header at the start of ``buf``: the body first and the preamble (with the
    magic) last, so that a reader never takes a half-written header for a valid one (the header
    checksum would not match either)."""
    raw = encode_header(header)
    view = byte_view(buf)
    view[PREAMBLE_SIZE : len(raw)] = raw[PREAMBLE_SIZE:]
    view[:PREAMBLE_SIZE] = raw[:PREAMBLE_SIZE]


def invalidate(buf: Any) -> None:
    """Wipes the preamble so the buffer no longer reads as a snapshot (before reusing it)."""
    byte_view(buf)[:PREAMBLE_SIZE] = bytes(PREAMBLE_SIZE)


def dtensor_nodes(meta: Any) -> Iterator[dict[str, Any]]:
    """Every ``dtensor`` node of a snapshot's state meta: a sharded tensor's entry index
    (``"i"``), global ``shape``, this rank's ``offsets`` in it, and its placements (written by
    :func:`elasticd.worker.shards.describe`)."""
    stack = [meta]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("@") == "dtensor":
                yield node
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def dtensors_only(meta: Any) -> bool:
    """Whether a snapshot's sharded state is DTensors and nothing else (no
    ZeroRedundancyOptimizer, whose reshard reads every old rank's whole snapshot): a reshard of
    it needs only the rows its new shards overlap, which its worker fetches itself
    (``elasticd/worker/direct.py``). ``meta`` is a job's own words: anything malformed is
    simply not that."""
    objects = meta.get("objects") if isinstance(meta, dict) else None
    kinds = ([o[1] for o in objects if isinstance(o, list) and len(o) > 1]
             if isinstance(objects, list) else [])
    return "zero" not in kinds and next(dtensor_nodes(meta), None) is not None
