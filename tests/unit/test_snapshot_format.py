"""The snapshot format: layout, round trips, and rejection of truncated, corrupt, mismatched input.

The hypothesis tests are the contract with every reader of a peer's bytes: whatever is done to a
valid snapshot, the parser answers with a snapshot or a SnapshotError, never anything else.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticd.snapshot.format import (
    ALIGNMENT,
    DATA_ALIGNMENT,
    FORMAT_VERSION,
    MAGIC,
    PREAMBLE_SIZE,
    CorruptSnapshot,
    SnapshotError,
    SnapshotHeader,
    SnapshotMismatch,
    TensorSpec,
    TruncatedSnapshot,
    _digest,
    encode_header,
    invalidate,
    layout,
    seal,
)
from elasticd.snapshot.reader import SnapshotReader, parse_header, verify_block, verify_payload
from tests.snapshot_entries import named

RNG = np.random.default_rng(0)

ARRAYS = {
    "model/w": ("float32", RNG.standard_normal((7, 5)).astype(np.float32)),
    "model/b": ("float64", RNG.standard_normal(3)),
    "optim/step": ("int64", np.array(12, dtype=np.int64)),  # 0-dim
    "empty": ("float32", np.zeros((0, 4), dtype=np.float32)),
    "mask": ("bool", RNG.integers(0, 2, 9).astype(bool)),
    "half": ("float16", RNG.standard_normal(6).astype(np.float16)),
    # numpy has no bfloat16: the bytes travel as raw uint16 under the torch dtype name.
    "bf16": ("bfloat16", RNG.integers(0, 2**16, (2, 3), dtype=np.uint16)),
    "big": ("uint8", RNG.integers(0, 256, 20_000, dtype=np.uint8)),
}


def build(arrays=ARRAYS, *, job="job-a", rank=1, world_size=4, step=7, generation=2,
          meta=None, block_size=4096):
    meta = {"epoch": 3, "note": "x"} if meta is None else meta
    specs = [TensorSpec(n, dt, a.shape) for n, (dt, a) in arrays.items()]
    lay = layout(specs, job=job, meta=meta, block_size=block_size)
    buf = bytearray(lay.total_size)
    for e in lay.entries:
        buf[e.offset : e.offset + e.nbytes] = arrays[e.name][1].tobytes()
    header = seal(buf, SnapshotHeader(job, step, generation, rank, world_size, lay, meta))
    return buf, header


def reencode(buf: bytearray, obj, version: int = FORMAT_VERSION) -> bytearray:
    """Writes header JSON ``obj`` with a *valid* checksum, to reach the schema checks."""
    body = json.dumps(obj).encode()
    out = bytearray(buf)
    raw = struct.pack("<8sIIQ", MAGIC, version, len(body), _digest(version, body)) + body
    out[: len(raw)] = raw
    return out


def header_obj(buf) -> dict:
    (length,) = struct.unpack_from("<I", buf, 12)
    return json.loads(bytes(buf[PREAMBLE_SIZE : PREAMBLE_SIZE + length]))


def test_layout_aligns_every_entry_and_reserves_the_header():
    buf, header = build()
    lay = header.layout
    assert lay.data_offset % DATA_ALIGNMENT == 0
    assert len(encode_header(header)) <= lay.data_offset
    ends = lay.data_offset
    for e in lay.entries:
        assert e.offset % ALIGNMENT == 0 and e.offset >= ends
        ends = e.offset + e.nbytes
    assert lay.total_size >= ends and len(buf) == lay.total_size
    assert [e.name for e in lay.entries] == list(ARRAYS)
    assert lay.num_blocks == -(-(lay.total_size - lay.data_offset) // 4096) > 1


def test_layout_rejects_duplicates_and_bad_specs():
    with pytest.raises(ValueError, match="duplicate"):
        layout([TensorSpec("a", "int8", (1,)), TensorSpec("a", "int8", (2,))], job="j")
    with pytest.raises(ValueError, match="dtype"):
        TensorSpec("a", "float128", (1,))
    with pytest.raises(ValueError, match="shape"):
        TensorSpec("a", "int8", (-1,))


def test_empty_snapshot_round_trips():
    buf, header = build({}, meta={})
    assert header.layout.num_blocks == 0
    assert SnapshotReader(bytes(buf)).header == header


def test_round_trip_is_bitwise_and_zero_copy():
    buf, header = build()
    reader = SnapshotReader(buf, job="job-a", rank=1, world_size=4)
    assert reader.header == header
    assert reader.header.meta == {"epoch": 3, "note": "x"}
    assert reader.header.version() == (2, 7)
    # Read as the product reads a slot (the worker's tensors over the buffer, no copy).
    import torch

    from elasticd.worker.copier import tensor_views

    start = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    views = dict(zip((e.name for e in header.layout.entries),
                     tensor_views(buf, header.layout)))
    for name, (_, arr) in ARRAYS.items():
        got = views[name]
        assert tuple(got.shape) == arr.shape
        assert got.reshape(-1).view(torch.uint8).numpy().tobytes() == arr.tobytes()
        if got.numel():  # a view of the buffer, not a copy (an empty tensor has no address)
            assert start <= got.data_ptr() < start + len(buf)


def test_snapshot_in_a_larger_buffer_reads_fine():
    buf, header = build()
    assert SnapshotReader(bytes(buf) + b"\0" * 10_000).header == header


@pytest.mark.parametrize("cut", [0, 10, PREAMBLE_SIZE + 5, -1])
def test_truncated_snapshot_is_rejected(cut):
    buf, header = build()
    cut = cut if cut >= 0 else header.layout.total_size - 1
    with pytest.raises(TruncatedSnapshot, match="short"):
        SnapshotReader(bytes(buf[:cut]))


def test_header_byte_flip_is_detected():
    buf, _ = build()
    buf[PREAMBLE_SIZE + 20] ^= 0x01
    with pytest.raises(CorruptSnapshot, match="header checksum"):
        parse_header(buf)


def test_payload_byte_flip_is_detected_and_located():
    buf, header = build()
    e = named(header.layout, "big")
    buf[e.offset + 10_000] ^= 0x80
    parse_header(buf)  # the header alone is still fine
    with pytest.raises(CorruptSnapshot, match="payload block") as info:
        SnapshotReader(buf)
    assert "step 7" in str(info.value)
    reader = SnapshotReader(buf, verify=False)
    with pytest.raises(CorruptSnapshot):
        verify_payload(buf, reader.header)


def test_verify_block_incrementally():
    buf, header = build()
    for i in range(header.layout.num_blocks):
        a, b = header.layout.block_range(i)
        verify_block(header, i, bytes(buf[a:b]))
    a, b = header.layout.block_range(0)
    with pytest.raises(CorruptSnapshot, match="bytes, expected"):
        verify_block(header, 0, bytes(buf[a : b - 1]))
    with pytest.raises(CorruptSnapshot, match="checksum"):
        verify_block(header, 0, bytes(b - a))


def test_bad_magic_and_invalidated_buffers_are_rejected():
    buf, _ = build()
    invalidate(buf)
    with pytest.raises(CorruptSnapshot, match="magic"):
        parse_header(buf)
    with pytest.raises(CorruptSnapshot, match="magic"):
        parse_header(b"not a snapshot at all, no no no")


@pytest.mark.parametrize(
    "expect, pattern",
    [({"job": "other"}, "job 'job-a', expected 'other'"), ({"rank": 0}, "rank 1, expected 0"),
     ({"world_size": 8}, "world size 4, expected 8")],
)
def test_mismatched_snapshot_is_rejected(expect, pattern):
    buf, _ = build()
    with pytest.raises(SnapshotMismatch, match=pattern):
        SnapshotReader(buf, **expect)


def test_newer_and_invalid_format_versions():
    buf, _ = build()
    with pytest.raises(SnapshotMismatch, match="v2.*upgrade"):
        parse_header(reencode(buf, header_obj(buf), version=FORMAT_VERSION + 1))
    with pytest.raises(CorruptSnapshot, match="version 0"):
        parse_header(reencode(buf, header_obj(buf), version=0))


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda h: h.pop("step"), "lacks field 'step'"),
        (lambda h: h.update(rank=True), "'rank' must be an integer"),
        (lambda h: h.update(rank=9), "outside world size"),
        (lambda h: h["entries"][0].update(nbytes=4), "do not match"),
        (lambda h: h["entries"][1].update(offset=h["entries"][0]["offset"]), "overlaps"),
        (lambda h: h["entries"][0].update(dtype="float128"), "unknown dtype"),
        (lambda h: h["blocks"].pop(), "block checksums"),
        (lambda h: h.update(meta=[]), "meta must be"),
        (lambda h: h.update(data_offset=10), "'data_offset' must be an integer >="),
    ],
)
def test_invalid_headers_say_what_is_wrong(mutate, pattern):
    buf, _ = build()
    obj = header_obj(buf)
    mutate(obj)
    with pytest.raises(CorruptSnapshot, match=pattern):
        parse_header(reencode(buf, obj))


def test_encode_header_refuses_unsealed_or_oversized_headers():
    buf, header = build()
    with pytest.raises(ValueError, match="seal"):
        encode_header(dataclasses.replace(header, blocks=()))
    with pytest.raises(ValueError, match="reserves"):
        encode_header(dataclasses.replace(header, job="j" * 5000))
    with pytest.raises(ValueError, match="plain JSON"):
        layout([], job="j", meta={"x": object()})


def _check_parser(data: bytes) -> None:
    try:
        reader = SnapshotReader(data)
    except SnapshotError:
        return
    for e in reader.header.layout.entries:  # whatever parses must also be readable
        assert e.offset + e.nbytes <= len(data)


_VALID, _ = build(block_size=1024)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(1, 255)), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, len(_VALID))),
)
def test_random_byte_mutations_only_raise_snapshot_errors(flips, cut):
    data = bytearray(_VALID)
    for pos, xor in flips:
        data[pos] ^= xor
    _check_parser(bytes(data[:cut] if cut is not None else data))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_TOP = ["job", "step", "generation", "rank", "world_size", "data_offset", "total_size",
        "block_size", "blocks", "entries", "meta"]
_ENTRY = ["name", "dtype", "shape", "offset", "nbytes"]


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(_TOP + [f"entries.{i}.{k}" for i in (0, 3) for k in _ENTRY]),
                  st.one_of(st.just("<delete>"), _JSON,
                            st.sampled_from([0, -1, 1, 2**63, 4096, 64, "float32", []]))),
        min_size=1, max_size=3),
    whole=st.one_of(st.none(), _JSON),
)
def test_structured_header_mutations_only_raise_snapshot_errors(edits, whole):
    obj = header_obj(_VALID)
    for path, value in edits:
        parts = path.split(".")
        target = obj
        try:
            for p in parts[:-1]:
                target = target[int(p)] if isinstance(target, list) else target[p]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced the container
        if not isinstance(target, dict):
            continue
        if value == "<delete>":
            target.pop(parts[-1], None)
        else:
            target[parts[-1]] = value
    _check_parser(bytes(reencode(_VALID, whole if whole is not None else obj)))
