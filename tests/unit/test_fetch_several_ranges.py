"""A fetch of several byte ranges in one request (replication protocol v7), over real loopback
sockets: the ranges land at their snapshot offsets and nothing between them is written; the
request is validated on both ends; a holder that sends bytes outside the ranges asked for, or
a run across two of them, is refused; a striped partial copy asks each holder for a piece's
runs of wanted blocks in one request, not one request per run (bench/results/restore38/)."""

from __future__ import annotations

import json

import pytest

from elasticd.clock import SystemClock
from elasticd.recovery.fetch import fetch_shard
from elasticd.replication.api import BAD_RANGE, Refused
from elasticd.replication.messages import (
    MAX_FETCH_RANGES,
    Fetch,
    encode_frame,
    joined_ranges,
)
from elasticd.replication.transport import ReplicaClient
from elasticd.replication.wire import MalformedFrame, ProtocolError
from elasticd.testing.replication import MemorySink, decode_frame
from tests.unit.test_replication_attacks import BLOCK, SECRET, sealed_push, server
from tests.unit import test_striped_fetch as striped
from tests.unit.test_striped_fetch import JOB as STRIPED_JOB
from tests.unit.test_striped_fetch import FailingSink, sealed_snapshot

holders = striped.holders  # the fixture: three real holders of one snapshot

JOB = "job"


def test_a_fetch_frame_carries_ranges_and_refuses_malformed_ones():
    several = Fetch(JOB, 0, 1, 2, ranges=((0, 10), (20, 5)))
    assert decode_frame(encode_frame(several)) == several
    assert b"ranges" not in Fetch(JOB, 0, None, None, 10, 20).payload()
    assert several.byte_ranges(25) == [(0, 10), (20, 25)]
    with pytest.raises(ValueError, match="outside the snapshot of 24 bytes"):
        several.byte_ranges(24)
    for bad in ([], [[0, 0]], [[5, 2], [1, 1]], [[0, 4], [4, 1]], [[0, 4], [2, 4]],
                [[0, -1]], [[0, True]], [[0, "4"]], [[0, 1, 2]], "0-4", [[0, 1]] * 2,
                [[i * 2, 1] for i in range(MAX_FETCH_RANGES + 1)]):
        payload = json.dumps({"job": JOB, "owner_rank": 0, "ranges": bad}).encode()
        with pytest.raises(MalformedFrame, match="ranges"):
            Fetch.parse(memoryview(payload))
    both = json.dumps({"job": JOB, "owner_rank": 0, "offset": 0, "length": 1,
                       "ranges": [[4, 1]]}).encode()
    with pytest.raises(MalformedFrame, match="not both"):
        Fetch.parse(memoryview(both))
    # The client joins adjacent ranges, leaves out empty ones and refuses the rest.
    assert joined_ranges([(0, 4), (4, 2), (9, 0), (10, 1)]) == ((0, 6), (10, 1))
    for bad in ([(0, 4), (3, 1)], [(5, 1), (0, 1)], [(-1, 2)], [(0, 0)],
                [(i * 2, 1) for i in range(MAX_FETCH_RANGES + 1)]):
        with pytest.raises(ValueError):
            joined_ranges(bad)


def test_several_ranges_come_in_one_request_each_at_its_offset_checked_by_its_tags():
    with server(MemorySink(), chunk_size=2 * BLOCK) as srv:
        header, payload = sealed_push(srv.address)
        whole = header + payload
        served, read = [], srv.sink.read
        srv.sink.read = lambda *a: served.append(a) or read(*a)
        # Blocks 0 and 2 of four (pretagged: one run each), an unaligned piece of block 3 (its
        # bytes tagged on the way), and a range in the header.
        b0, b2 = 64, 64 + 2 * BLOCK
        asked = [(3, 20), (b0, BLOCK), (b2, BLOCK), (b2 + BLOCK + 100, 999)]
        into = bytearray(b"\xee" * len(whole))
        with ReplicaClient.connect(*srv.address, SECRET, "node-c", timeout=10.0) as client:
            client.fetch(JOB, 0, into, version=(0, 1), ranges=asked)
            assert client.channel.tag_checked_bytes == 2 * BLOCK
            # A range beyond the snapshot is refused whole (nothing written), the
            # connection stays usable.
            before = bytes(into)
            with pytest.raises(Refused) as refused:
                client.fetch(JOB, 0, into, version=(0, 1),
                             ranges=[(0, 4), (len(whole) - 1, 2)])
            assert refused.value.reason == BAD_RANGE and bytes(into) == before
            client.fetch(JOB, 0, into, version=(0, 1), ranges=[(0, 1), (5, 1)])
    assert len(served) == 3  # one read a request
    written = [False] * len(whole)
    for offset, length in [*asked, (0, 1), (5, 1)]:
        written[offset : offset + length] = [True] * length
        assert into[offset : offset + length] == whole[offset : offset + length]
    assert all(into[i] == 0xEE for i in range(len(whole)) if not written[i])


@pytest.mark.parametrize("chunk,lie", [(BLOCK, "a block from the gap between the ranges"),
                                        (4 * BLOCK, "one run across both ranges")])
def test_a_holder_sending_bytes_outside_the_ranges_asked_for_is_refused(monkeypatch, chunk, lie):
    """A holder with the session keys that serves two ranges as one (from the first range's
    start to the last one's end: the gap's bytes too) is refused at the first frame past the
    first range, before anything lands in the gap: a frame of the gap's block (one block a
    frame), or a run of blocks that spans both ranges."""
    real = Fetch.byte_ranges
    monkeypatch.setattr(Fetch, "byte_ranges", lambda self, total: [
        (real(self, total)[0][0], real(self, total)[-1][1])])
    with server(MemorySink(), chunk_size=chunk) as srv:
        header, payload = sealed_push(srv.address)
        whole = header + payload
        b0 = 64  # blocks 0 and 2 asked for, block 1 between them
        into = bytearray(b"\xee" * len(whole))
        with ReplicaClient.connect(*srv.address, SECRET, "node-c", timeout=10.0) as client:
            with pytest.raises(ProtocolError, match="does not continue"):
                client.fetch(JOB, 0, into, version=(0, 1),
                             ranges=[(b0, BLOCK), (b0 + 2 * BLOCK, BLOCK)])
    assert into[b0 + BLOCK : b0 + 2 * BLOCK] == b"\xee" * BLOCK, lie


def test_a_partial_copy_asks_each_holder_for_several_runs_in_one_request(holders):
    """Every other block wanted (46 runs of one block): striped across three holders in
    pieces of up to 8 wanted blocks, one request a piece (6), not one a run (46); every
    wanted block lands intact and checked, none of the others."""
    d, buf = sealed_snapshot()
    sinks = [FailingSink(), FailingSink(), FailingSink()]
    servers, pool = holders(sinks, d, buf)
    before = sum(s.reads for s in sinks)
    block, start = 64 << 10, d.header_bytes
    blocks = -(-(d.total_bytes - start) // block)
    wanted = list(range(0, blocks - 1, 2))
    into = bytearray(8 << 20)
    result = fetch_shard(STRIPED_JOB, 1, d.version, lambda _: into, me="me",
                         holders=["me", "n0", "n1", "n2"], connections=pool, own=(),
                         clock=SystemClock(), stripe_bytes=8 * block,
                         select=lambda header: wanted)
    assert (blocks, len(wanted)) == (92, 46)
    # The descriptor and the header from the first holder, then ceil(46 / 8) = 6 pieces.
    assert sum(s.reads for s in sinks) - before == 2 + 6
    for b in range(blocks):
        a, z = start + b * block, min(start + (b + 1) * block, d.total_bytes)
        if b in wanted:
            assert into[a:z] == buf[a:z], b
        else:
            assert not any(into[a:z]), b
    assert sum(dict(result.served).values()) == start + len(wanted) * block
