"""A fetch landing in several places (elasticd/replication/scatter.py): a reshard's rows
straight in the live tensors, the rest of their blocks in a staging buffer.

Over real loopback sockets and a real holder: the routed bytes land in their destinations and
nowhere else, every other byte in staging, every block checked against its owner's tag
wherever its bytes landed; a relay that alters a byte of a block split across places fails
that block's tag, whichever part the byte lies in. A striped fetch from three holders that
kept no block tags lands the same way, each block checked against the header's checksum
(a corrupt byte in a split block's routed part is refused). Beside them, how a Scatter cuts
its slices and which routes it refuses.
"""

from __future__ import annotations

import pytest

from elasticd.clock import SystemClock
from elasticd.recovery.fetch import ShardLost, fetch_shard
from elasticd.replication.scatter import Scatter, Spans, landing, staged
from elasticd.replication.wire import BlockTagMismatch
from elasticd.testing.replication import MemorySink
from tests.unit.test_replication_attacks import (
    BLOCK,
    blocks_start,
    relayed_fetch,
    sealed_push,
    server,
)
from tests.unit.test_striped_fetch import BLOCK as S_BLOCK
from tests.unit.test_striped_fetch import JOB as S_JOB
from tests.unit.test_striped_fetch import (  # noqa: F401 — holders: the fixture
    STRIPE,
    FailingSink,
    holders,
    sealed_snapshot,
)

HEAD = 64  # sealed_push's header: blocks start here
RUN_BYTES = 4 * BLOCK
FILL = 0xEE  # what staging holds where nothing landed

# (snapshot offset, length) of each route: inside one block; across the boundary of blocks
# 1 and 2; exactly block 3.
ROUTES = [(HEAD + 100, 5000), (HEAD + 2 * BLOCK - 300, 1000), (HEAD + 3 * BLOCK, BLOCK)]


def scatter_for(total: int) -> tuple[Scatter, bytearray, list[bytearray]]:
    staging = bytearray([FILL]) * total
    dests = [bytearray(n) for _, n in ROUTES]
    return Scatter(staging, [(at, d) for (at, _), d in zip(ROUTES, dests)],
                   header_end=HEAD), staging, dests


def routed(offset: int) -> bool:
    return any(at <= offset < at + n for at, n in ROUTES)


@pytest.mark.parametrize("chunk", [BLOCK, RUN_BYTES], ids=["a block a frame", "runs"])
def test_a_fetch_into_a_scatter_lands_each_byte_once_where_it_is_routed(chunk):
    with server(MemorySink(), chunk_size=chunk) as srv:
        header, payload = sealed_push(srv.address)
        total = HEAD + len(payload)
        into, staging, dests = scatter_for(total)
        _, _, error, channel = relayed_fetch(srv.address, nth=0, into=into)
    assert error is None
    whole = header + payload
    for (at, n), dest in zip(ROUTES, dests):
        assert bytes(dest) == whole[at : at + n]
    # Staging holds every other byte, and nothing where a route took the bytes.
    expect = bytes(FILL if routed(i) else b for i, b in enumerate(whole))
    assert bytes(staging[:total]) == expect
    assert channel.tag_checked_bytes == len(payload)  # every block, split or not


@pytest.mark.parametrize("where", ["the routed part", "the staged part"])
def test_a_relay_altering_a_block_split_across_places_fails_its_block_tag(where):
    # Block 1 ends in the second route: its last 300 bytes land in a destination, the rest
    # in staging. The relay flips one byte of it on the way.
    at = HEAD + 2 * BLOCK - 10 if where == "the routed part" else HEAD + BLOCK + 10
    assert routed(at) == (where == "the routed part")

    def flip(seen: int, payload: bytearray) -> bool:
        if seen != 2:  # the header's frame, then the run of the four blocks
            return False
        payload[blocks_start(payload) + at - HEAD] ^= 0x01
        return True

    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        sealed_push(srv.address)
        into, _, _ = scatter_for(HEAD + (1 << 20))
        relay, _, error, _ = relayed_fetch(srv.address, into=into, rewrite=flip)
    assert relay.rewritten == 1
    assert isinstance(error, BlockTagMismatch), error
    assert str(HEAD + BLOCK) in str(error)  # block 1, by its offset


def test_slices_without_a_route_are_the_staging_buffers_own_views():
    into, staging, dests = scatter_for(HEAD + (1 << 20))
    plain = into[HEAD + BLOCK : HEAD + BLOCK + 100]
    assert isinstance(plain, memoryview) and plain.obj is staging
    inside = into[ROUTES[0][0] + 10 : ROUTES[0][0] + 20]
    assert isinstance(inside, memoryview) and inside.obj is dests[0]
    across = into[ROUTES[0][0] - 3 : ROUTES[0][0] + ROUTES[0][1] + 4]
    assert isinstance(across, Spans)
    assert [len(p) for p in across.parts] == [3, ROUTES[0][1], 4]
    assert [p.obj for p in across.parts] == [staging, dests[0], staging]
    assert len(across) == ROUTES[0][1] + 7
    # A slice of Spans within one part is that part's view; across parts, Spans again.
    assert across[5:9].obj is dests[0]
    assert [len(p) for p in across[1:6].parts] == [2, 3]
    assert staged(into) is into.staging and landing(into) is into
    assert landing(bytearray(10), 4).nbytes == 4


@pytest.mark.parametrize("routes, why", [
    ([(HEAD - 1, bytearray(8))], "overlaps"),                      # into the header
    ([(100, bytearray(8)), (104, bytearray(8))], "overlaps"),      # two routes overlapping
    ([(HEAD + (1 << 20) - 4, bytearray(8))], "passes the end"),
    ([(HEAD, bytes(8))], "read-only"),
])
def test_a_route_that_overlaps_passes_the_end_or_is_read_only_is_refused(routes, why):
    with pytest.raises(ValueError, match=why):
        Scatter(bytearray(HEAD + (1 << 20)), routes, header_end=HEAD)


# -- a striped fetch (recovery/fetch.py) into a Scatter, from holders that kept no block tags:
# each block is checked against the header's checksum, read back from wherever it landed.

SPLIT = [(1000, 5000), (3 * S_BLOCK - 700, 2 * S_BLOCK + 1400), (10 * S_BLOCK, S_BLOCK)]


def striped_into_scatter(pool, names, d):
    staging = bytearray([FILL]) * d.total_bytes
    dests = [bytearray(n) for _, n in SPLIT]
    into = Scatter(staging, [(d.header_bytes + at, dest) for (at, _), dest in zip(SPLIT, dests)],
                   header_end=d.header_bytes)
    result = fetch_shard(S_JOB, 1, d.version, into, me="me", holders=names, connections=pool,
                         own=(), clock=SystemClock(), stripe_bytes=STRIPE)
    return result, staging, dests


def test_a_striped_fetch_into_a_scatter_lands_routed_rows_in_place_every_block_checked(holders):
    d, buf = sealed_snapshot()
    _, pool = holders([FailingSink(), FailingSink(), FailingSink()], d, buf)
    result, staging, dests = striped_into_scatter(pool, ["n0", "n1", "n2"], d)
    assert result.attempts == () and sum(dict(result.served).values()) == d.total_bytes
    assert result.tag_checked_bytes == 0  # untagged copies: checked against the checksums
    for (at, n), dest in zip(SPLIT, dests):
        assert bytes(dest) == bytes(buf[d.header_bytes + at : d.header_bytes + at + n])
    expect = bytearray(buf)
    for at, n in SPLIT:
        expect[d.header_bytes + at : d.header_bytes + at + n] = bytes([FILL]) * n
    assert staging == expect


def test_a_corrupt_block_split_across_places_is_refused_by_its_checksum(holders):
    d, buf = sealed_snapshot()
    sink = FailingSink()
    _, pool = holders([sink], d, buf)
    held = sink._held[(S_JOB, 1)][1]
    # Block 2 lands in staging up to 700 bytes before its end, the rest in the second route;
    # the byte flipped lies in the routed part.
    held[d.header_bytes + 3 * S_BLOCK - 100] ^= 0x01
    with pytest.raises(ShardLost) as lost:
        striped_into_scatter(pool, ["n0"], d)
    assert "corrupt" in str(lost.value.attempts) and "block 2" in str(lost.value.attempts)
