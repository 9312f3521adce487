"""Striped fetches over real loopback sockets: one snapshot held by three real ReplicaServers
is fetched in pieces from all of them at once, intact, each serving part of it; a holder that
dies or starts refusing mid-fetch leaves its pieces to the others (no restart)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from elasticd.snapshot.format import SnapshotHeader, TensorSpec, layout, seal
from elasticd.clock import SystemClock
from elasticd.replication.api import ConnectionLost, Descriptor, RemoteError
from elasticd.replication.lanes import Connections
from elasticd.replication.messages import FetchReply, PutEnd
from elasticd.testing.replication import MemorySink
from elasticd.recovery.fetch import (
    MAX_STRIPE_BYTES,
    STRIPE_BYTES,
    ShardLost,
    _reason,
    fetch_shard,
    stripe_size,
)
from elasticd.replication.wire import (
    ChecksumMismatch,
    ForgedFrame,
    MalformedFrame,
    TruncatedFrame,
    UnexpectedFrame,
)
from elasticd.replication.transport import ReplicaClient, ReplicaServer

SECRET = b"cluster-secret-0123456789abcdef"
JOB = "job-s"
KiB = 1 << 10
BLOCK = 64 * KiB
STRIPE = 2 * BLOCK


def sealed_snapshot(n_floats: int = 1_500_001, step: int = 9) -> tuple[Descriptor, bytearray]:
    """A real sealed snapshot (~6 MiB, 64 KiB checksum blocks, an uneven last block)."""
    lay = layout([TensorSpec("w", "float32", (n_floats,))], job=JOB, block_size=BLOCK)
    buf = bytearray(lay.total_size)
    e = lay.entries[0]
    buf[e.offset : e.offset + e.nbytes] = np.random.default_rng(step).random(
        n_floats, dtype=np.float32).tobytes()
    seal(buf, SnapshotHeader(JOB, step, 0, 1, 3, lay, {"step": step}))
    d = Descriptor(JOB, 1, 0, step, lay.total_size, lay.data_offset)
    return d, buf


class FailingSink(MemorySink):
    """A sink that, from its ``nth`` read on, makes its server die (``stop``) or refuse."""

    def __init__(self, nth: int | None = None, mode: str = "die") -> None:
        super().__init__()
        self.nth, self.mode, self.reads = nth, mode, 0
        self.server: ReplicaServer | None = None

    def read(self, job, owner_rank, version=None):
        self.reads += 1
        time.sleep(0.005)  # every holder a little slow, so that all three get pieces
        if self.nth is not None and self.reads >= self.nth:
            if self.mode == "refuse":
                return None
            if self.reads == self.nth:  # dies while it serves this piece
                threading.Thread(target=self.server.stop, daemon=True).start()
        return super().read(job, owner_rank, version)


@pytest.fixture
def holders():
    made: list[ReplicaServer] = []
    pools: list[Connections] = []

    def make(sinks: list[MemorySink], d: Descriptor, buf: bytearray):
        for i, sink in enumerate(sinks):
            srv = ReplicaServer("127.0.0.1", 0, SECRET, f"n{i}", sink, idle_timeout=10.0,
                                chunk_size=32 * KiB).start()
            made.append(srv)
            if isinstance(sink, FailingSink):
                sink.server = srv
            with ReplicaClient.connect(*srv.address, SECRET, "pusher", timeout=10.0) as c:
                c.push(d, buf[: d.header_bytes], buf[d.header_bytes :])
        book = {f"n{i}": s.address for i, s in enumerate(made)}
        pool = Connections("me", SECRET, book.get, timeout=10.0)
        pools.append(pool)
        return made, pool

    yield make
    for pool in pools:
        pool.close()
    for srv in made:
        srv.stop()


def fetch(pool: Connections, names: list[str], version=None):
    into = bytearray(8 << 20)
    result = fetch_shard(JOB, 1, version, lambda d: into, me="me", holders=["me", *names],
                         connections=pool, own=(), clock=SystemClock(),
                         stripe_bytes=STRIPE)
    return result, into


def test_a_snapshot_held_three_times_is_striped_across_all_holders_intact(holders):
    d, buf = sealed_snapshot()
    servers, pool = holders([FailingSink(), FailingSink(), FailingSink()], d, buf)
    result, into = fetch(pool, ["n0", "n1", "n2"], version=d.version)
    assert result.descriptor == d
    assert bytes(into[: d.total_bytes]) == bytes(buf)
    served = dict(result.served)
    assert set(served) == {"n0", "n1", "n2"} and all(served.values()), served
    assert sum(served.values()) == d.total_bytes
    assert result.attempts == ()
    assert all(s.sink.reads >= 2 for s in servers)  # each served a piece, and the header
    assert result.wire_bytes >= d.total_bytes


def test_selected_blocks_only_cross_the_network_striped_and_checked(holders):
    """A fetch with ``select`` (the blocks a new rank's rows are in) moves only those blocks,
    striped across the holders, each checked; the rest of the buffer is left as it was."""
    d, buf = sealed_snapshot()
    servers, pool = holders([FailingSink(), FailingSink(), FailingSink()], d, buf)
    into = bytearray(8 << 20)
    wanted = [*range(3, 9), *range(40, 45)]  # two runs of blocks: pieces never span the gap
    result = fetch_shard(JOB, 1, d.version, lambda _: into, me="me",
                         holders=["me", "n0", "n1", "n2"], connections=pool, own=(),
                         clock=SystemClock(), stripe_bytes=STRIPE, select=lambda header: wanted)
    lay_start = d.header_bytes
    for b in range(-(-(d.total_bytes - lay_start) // BLOCK)):
        a, z = lay_start + b * BLOCK, min(lay_start + (b + 1) * BLOCK, d.total_bytes)
        if b in wanted:
            assert into[a:z] == buf[a:z], b
        else:
            assert not any(into[a:z]), b  # never fetched
    payload = sum(min(BLOCK, d.total_bytes - lay_start - b * BLOCK) for b in wanted)
    assert sum(dict(result.served).values()) == d.header_bytes + payload
    assert result.wire_bytes < d.total_bytes / 3


def test_one_holder_is_the_same_code_fetching_piece_after_piece(holders):
    d, buf = sealed_snapshot(n_floats=300_001)
    servers, pool = holders([FailingSink()], d, buf)
    result, into = fetch(pool, ["n0"])
    assert bytes(into[: d.total_bytes]) == bytes(buf) and result.holder == "n0"
    pieces = -(-(d.total_bytes - d.header_bytes) // STRIPE)
    assert servers[0].sink.reads == 2 + pieces  # describe, header, the pieces


@pytest.mark.parametrize("mode, reason", [("die", "unreachable"), ("refuse", "missing")])
def test_a_holder_failing_mid_fetch_leaves_its_ranges_to_the_others(holders, mode, reason):
    d, buf = sealed_snapshot()
    failing = FailingSink(nth=4, mode=mode)  # the describer: it serves header and 2 pieces
    servers, pool = holders([failing, FailingSink(), FailingSink()], d, buf)
    result, into = fetch(pool, ["n0", "n1", "n2"])
    assert bytes(into[: d.total_bytes]) == bytes(buf)
    served = dict(result.served)
    assert 0 < served["n0"] < d.total_bytes / 3, served
    assert served["n1"] and served["n2"] and sum(served.values()) == d.total_bytes
    assert [h for h, _ in result.attempts] == ["n0"]
    assert result.attempts[0][1].startswith(reason)


def test_every_holder_failing_is_a_lost_shard_naming_each(holders):
    d, buf = sealed_snapshot(n_floats=400_001)
    _, pool = holders([FailingSink(nth=3, mode="refuse"), FailingSink(nth=2, mode="refuse")],
                      d, buf)
    with pytest.raises(ShardLost) as lost:
        fetch(pool, ["n0", "n1"])
    assert sorted(h for h, _ in lost.value.attempts) == ["n0", "n1"]


def test_a_listed_holder_without_the_version_is_not_a_failure(holders):
    d, buf = sealed_snapshot(n_floats=400_001)
    _, pool = holders([FailingSink(), FailingSink(nth=1, mode="refuse")], d, buf)
    result, into = fetch(pool, ["n0", "n1"])
    assert bytes(into[: d.total_bytes]) == bytes(buf)
    assert dict(result.served) == {"n0": d.total_bytes} and result.attempts == ()


def test_a_holder_whose_copy_rotted_is_refused_and_its_pieces_come_from_the_others(holders):
    """Bits flipped in a holder's RAM after its copy landed: its piece fails its blocks'
    check as it lands (the payload is not read a second time at the end), the piece goes to
    the other holders, and the copy is intact."""
    d, buf = sealed_snapshot()
    rotten = FailingSink()
    servers, pool = holders([FailingSink(), rotten, FailingSink()], d, buf)
    held = rotten._held[(JOB, 1)][1]
    for at in range(d.header_bytes, len(held), BLOCK):  # whichever piece it serves
        held[at] ^= 0x01
    result, into = fetch(pool, ["n0", "n1", "n2"])
    assert bytes(into[: d.total_bytes]) == bytes(buf)
    assert [h for h, _ in result.attempts] == ["n1"]
    assert result.attempts[0][1].startswith("corrupt"), result.attempts


def test_a_holder_answering_outside_the_protocol_is_counted_as_protocol_not_unreachable(
        holders):
    """A holder (with the session keys) that ends each piece it is asked for with a PUT_END
    and no bytes broke the protocol: its piece goes to the others, the copy is intact, and
    the reason says ``protocol`` (the metric's label), not ``unreachable``: the network did
    nothing wrong, the holder did."""
    d, buf = sealed_snapshot()
    servers, pool = holders([FailingSink(), FailingSink(), FailingSink()], d, buf)
    liar = servers[1]  # not the describer: every request it gets is for a piece

    def empty_piece(channel, req, peer_max_frame, peer_id=""):
        held, _ = liar.sink.read(req.job, req.owner_rank, None)
        liar.sink.release(held)
        tags = liar.sink.tags(held)
        channel.send(FetchReply(held, tags.salt if tags is not None else None))
        channel.send(PutEnd(0, 0))

    liar._serve_fetch = empty_piece
    result, into = fetch(pool, ["n0", "n1", "n2"])
    assert bytes(into[: d.total_bytes]) == bytes(buf)
    assert [h for h, _ in result.attempts] == ["n1"]
    reason = result.attempts[0][1]
    assert reason.startswith("protocol: ") and "PUT_END says 0 bytes" in reason, reason
    assert "n1" not in dict(result.served)


def test_a_header_changed_after_its_check_refuses_the_striped_copy(holders):
    """The header is checked when it comes, before the pieces; at the end its bytes must be
    the ones checked (compared, not parsed again): a header byte changed meanwhile (here by
    the buffer's own ``reserve`` of a piece) refuses the copy as corrupt."""
    d, buf = sealed_snapshot()
    _, pool = holders([FailingSink(), FailingSink()], d, buf)
    into = bytearray(8 << 20)

    def scribble(start: int, end: int) -> None:
        if start >= d.header_bytes:  # a piece's range: the header came and was checked
            into[100] = buf[100] ^ 0x01

    with pytest.raises(ShardLost) as lost:
        fetch_shard(JOB, 1, None, lambda _: into, me="me", holders=["me", "n0", "n1"],
                    connections=pool, own=(), clock=SystemClock(), stripe_bytes=STRIPE,
                    reserve=scribble)
    assert [r for _, r in lost.value.attempts if "header changed" in r], lost.value.attempts
    assert lost.value.attempts[-1][1].startswith("corrupt: ")


@pytest.mark.parametrize("exc, reason", [
    (ForgedFrame("a frame fails its session tag"), "corrupt"),
    (ChecksumMismatch("a frame fails its xxh3"), "corrupt"),
    (MalformedFrame("PUT_END miscounts"), "protocol"),
    (UnexpectedFrame("expected DATA, received ACK"), "protocol"),
    (RemoteError("internal", "KeyError"), "protocol"),
    (TruncatedFrame("connection closed after 3 of 8 bytes"), "unreachable"),
    (ConnectionLost("reset"), "unreachable"),
])
def test_each_failure_of_a_holder_has_the_reason_its_cause_gives(exc, reason):
    """The reason (the metric's label) says whose fault it was: the bytes (corrupt), the
    holder's conversation (protocol) or the network (unreachable); each drops the holder's
    connection."""
    dropped = []
    pool = SimpleNamespace(discard=lambda holder, *a: dropped.append(holder))
    assert _reason("h1", exc, pool).split(":")[0] == reason
    assert dropped == ["h1"]


def test_pieces_grow_with_the_measured_rate_within_each_holders_share():
    MiB = 1 << 20
    # Unmeasured links (the 50 MB/s default): the smallest pieces, a frozen holder's piece
    # deadline stays short.
    assert stripe_size(1024 * MiB, 3, 50e6) == STRIPE_BYTES
    # A fast link: a quarter second of it, at most a quarter of each holder's share.
    assert stripe_size(1024 * MiB, 1, 2e9) == 256 * MiB
    assert stripe_size(1024 * MiB, 3, 2e9) == 1024 * MiB // 12
    assert stripe_size(1024 * MiB, 3, 200e6) == 50_000_000
    # Never below STRIPE_BYTES (a small payload), never above MAX_STRIPE_BYTES.
    assert stripe_size(8 * MiB, 1, 2e9) == STRIPE_BYTES
    assert stripe_size(64 * 1024 * MiB, 1, 1e10) == MAX_STRIPE_BYTES


def test_a_scratch_copy_reserves_only_the_ranges_it_receives(holders, tmp_path):
    """Into a scratch segment (only sized), each range is reserved before anything writes it,
    a piece's by the thread that fetches it: the file takes the memory of the header and the
    selected blocks, not of the whole snapshot. A failing reservation ends the fetch with its
    own error (no room), not as a fault of the holders."""
    import os
    import shutil
    import uuid

    from elasticd.store.api import OverBudget
    from elasticd.store.shm import SlotStore

    d, buf = sealed_snapshot()
    servers, pool = holders([FailingSink(), FailingSink(), FailingSink()], d, buf)
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    try:
        segments, reserved = [], []

        def into(desc):
            segments.append(store.scratch.new(desc.total_bytes, job=JOB))
            return segments[-1].view

        def reserve(start, end):
            reserved.append((start, end, threading.current_thread().name))
            segments[-1].reserve_range(start, end)

        wanted = [*range(3, 9), *range(40, 45)]
        fetch_shard(JOB, 1, d.version, into, me="me", holders=["me", "n0", "n1", "n2"],
                    connections=pool, own=(), clock=SystemClock(), stripe_bytes=STRIPE,
                    select=lambda header: wanted, reserve=reserve)
        seg = segments[-1]
        lay_start = d.header_bytes
        for b in wanted:  # every selected block lies in a reserved range, and arrived intact
            a, z = lay_start + b * BLOCK, min(lay_start + (b + 1) * BLOCK, d.total_bytes)
            assert any(s <= a and z <= e for s, e, _ in reserved), b
            assert bytes(seg.view[a:z]) == bytes(buf[a:z]), b
        assert any(s == 0 and e >= d.header_bytes for s, e, _ in reserved)
        assert len({name for *_, name in reserved if name.startswith("elasticd-stripe-")}) > 1
        # Reserved in whole 2 MiB pages: the header's and the selected blocks' (0-4 MiB of
        # this 6 MB snapshot), never the last 2 MiB, which holds no selected block.
        held = os.stat(os.path.join(root, seg.name)).st_blocks * 512
        assert held <= 4 << 20 < seg.capacity - (1 << 20), (held, seg.capacity)
        store.scratch.drop(seg)

        def refuse(start, end):
            if start >= lay_start:
                raise OverBudget("no room for a piece")

        with pytest.raises(OverBudget, match="no room for a piece"):
            fetch_shard(JOB, 1, d.version, into, me="me", holders=["me", "n0", "n1", "n2"],
                        connections=pool, own=(), clock=SystemClock(), stripe_bytes=STRIPE,
                        reserve=refuse)
    finally:
        for seg in segments:
            store.scratch.drop(seg)
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_copy_described_already_is_fetched_without_asking_again(holders):
    """A second fetch of the same copy given its descriptor and checked header (the worker's
    own fetch: the header first, for the plan, then the rows) sends the holders piece
    requests only: no describe and no header again."""
    from elasticd.snapshot.reader import parse_header

    d, buf = sealed_snapshot()
    servers, pool = holders([FailingSink(), FailingSink()], d, buf)
    into = bytearray(8 << 20)
    first = fetch_shard(JOB, 1, d.version, lambda _: into, me="me", holders=["n0", "n1"],
                        connections=pool, own=(), clock=SystemClock(), stripe_bytes=STRIPE,
                        select=lambda header: [])
    header = parse_header(memoryview(into), job=JOB, rank=1)
    asked = sum(s.sink.reads for s in servers)
    assert asked >= 2 and not any(into[d.header_bytes:d.total_bytes])
    wanted = [*range(3, 9), *range(40, 45)]
    result = fetch_shard(JOB, 1, d.version, into, me="me", holders=["n0", "n1"],
                         connections=pool, own=(), clock=SystemClock(), stripe_bytes=STRIPE,
                         select=lambda _: wanted, described=(first.descriptor, header))
    pieces = sum(-(-len(run) * BLOCK // STRIPE) for run in (range(3, 9), range(40, 45)))
    assert sum(s.sink.reads for s in servers) - asked == pieces  # one request per piece
    start = d.header_bytes
    for b in wanted:
        a, z = start + b * BLOCK, min(start + (b + 1) * BLOCK, d.total_bytes)
        assert into[a:z] == buf[a:z], b
    assert bytes(into[:start]) == bytes(buf[:start])
    assert sum(dict(result.served).values()) == len(wanted) * BLOCK
