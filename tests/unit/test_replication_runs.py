"""Runs of blocks (replication protocol v6): a pretagged DATA frame carries consecutive blocks,
each with its owner's block tag, under one session tag over the frame's prefix.

Over real loopback sockets: a holder sends a fetch's small blocks in runs and nothing
docs/security.md promises weakens (a relay that alters, moves, reorders or repeats a block or a
run fails); a sender that holds the session keys but whose run does not add up (short,
overlong, reordered, duplicated, empty or too long) is refused and counted, and nothing it sent
is stored.
"""

from __future__ import annotations

import pytest

from elasticd.replication.api import Descriptor
from elasticd.replication.messages import Ack, PutBegin, PutEnd
from elasticd.replication.seal import BlockTagger
from elasticd.replication.transport import ReplicaClient
from elasticd.replication.wire import (
    CHECKED,
    FLAG_PRETAGGED,
    FLAG_SEALED,
    MAGIC,
    MAX_RUN_BLOCKS,
    RUN,
    RUN_ENTRY,
    VERSION,
    BlockTagMismatch,
    ForgedFrame,
    FrameType,
)
from elasticd.testing.replication import MemorySink
from tests.unit.test_replication_attacks import (
    BLOCK,
    SECRET,
    blocks_start,
    relayed_fetch,
    sealed_push,
    server,
    wait_for,
)

RUN_BYTES = 4 * BLOCK  # the holder's chunk: one run carries the four 256 KiB blocks


def swap_first_two(payload: bytearray, at: int, size: int) -> None:
    """Swaps the ``size``-byte items at ``at`` and ``at + size``."""
    first, second = bytes(payload[at : at + size]), bytes(payload[at + size : at + 2 * size])
    payload[at : at + 2 * size] = second + first


def test_a_holder_serves_consecutive_blocks_in_one_run_checked_block_by_block():
    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        header, payload = sealed_push(srv.address)
        relay, into, error, channel = relayed_fetch(srv.address, nth=0)
    assert error is None
    # The 64-byte header tagged on the way, then the four blocks in one pretagged frame.
    assert [bool(f & FLAG_PRETAGGED) for f in relay.data_flags] == [False, True]
    assert bytes(into[: 64 + len(payload)]) == header + payload
    assert channel.tag_checked_bytes == len(payload)


def test_a_relay_rewriting_a_block_in_the_middle_of_a_run_fails_its_block_tag():
    def flip(seen: int, payload: bytearray) -> bool:
        if seen != 2:
            return False
        payload[blocks_start(payload) + 2 * BLOCK + 5] ^= 0x01  # inside the third block
        return True

    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        sealed_push(srv.address)
        relay, _, error, _ = relayed_fetch(srv.address, rewrite=flip)
    assert relay.rewritten == 1
    assert isinstance(error, BlockTagMismatch), error
    assert "offset" in str(error) and str(64 + 2 * BLOCK) in str(error)


def test_a_relay_swapping_two_blocks_of_a_run_fails_their_block_tags():
    """Blocks of the same length swapped within the run (prefix untouched): each is checked
    under its own offset as nonce, so a block moved within a run fails as one moved across."""
    def swap(seen: int, payload: bytearray) -> bool:
        if seen == 2:
            swap_first_two(payload, blocks_start(payload), BLOCK)
        return seen == 2

    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        sealed_push(srv.address)
        _, _, error, _ = relayed_fetch(srv.address, rewrite=swap)
    assert isinstance(error, BlockTagMismatch), error


def test_a_relay_reordering_the_tags_of_a_run_fails_the_session_tag():
    """The relay swaps two blocks and their (length, tag) entries alike: every block still
    matches the tag beside it, but the prefix is the session tag's, so the frame is refused
    before a block is read."""
    def swap(seen: int, payload: bytearray) -> bool:
        if seen == 2:
            swap_first_two(payload, RUN.size, RUN_ENTRY.size)  # the (length, tag) entries
            swap_first_two(payload, blocks_start(payload), BLOCK)
        return seen == 2

    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        sealed_push(srv.address)
        _, _, error, _ = relayed_fetch(srv.address, rewrite=swap)
    assert isinstance(error, ForgedFrame) and not isinstance(error, BlockTagMismatch), error


def test_a_relay_repeating_a_run_fails_the_session_tag():
    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        sealed_push(srv.address)
        relay, _, error, _ = relayed_fetch(srv.address, nth=0, repeat=2)
    assert relay.rewritten == 1
    assert isinstance(error, ForgedFrame) and not isinstance(error, BlockTagMismatch), error


# -- a sender holding the session keys whose runs do not add up ------------------------------

HEADER_BYTES = 64


def blocks_of(payload: bytes) -> tuple[bytes, dict[int, tuple[int, bytes]]]:
    """The snapshot (64-byte header, then ``payload``) and its block tags, 256 KiB blocks."""
    whole = b"{}".ljust(HEADER_BYTES) + payload
    ranges = [(a, min(a + BLOCK, len(whole))) for a in range(HEADER_BYTES, len(whole), BLOCK)]
    return whole, BlockTagger(SECRET).tag(whole, ranges)


def send_forged_run(channel, offset: int, entries: list[tuple[int, bytes]], data: bytes,
                    count: int | None = None) -> None:
    """A pretagged DATA frame sealed as the session wants, whose prefix says ``entries`` (and
    ``count`` blocks) whatever ``data`` holds."""
    prefix = RUN.pack(offset, len(entries) if count is None else count) + b"".join(
        RUN_ENTRY.pack(*e) for e in entries)
    checked = CHECKED.pack(MAGIC, VERSION, FrameType.DATA, FLAG_SEALED | FLAG_PRETAGGED,
                           len(prefix) + len(data))
    channel._send(checked + channel.send_key.seal(checked, prefix) + prefix, data)


def push_runs(address, frames) -> Exception | None:
    """Pushes 1 MiB in 256 KiB tagged blocks, its header as plain DATA, then whatever
    ``frames(channel, whole, tags)`` sends, then PUT_END; returns what the push raised."""
    whole, tags = blocks_of(bytes(range(256)) * 4096)
    d = Descriptor("job", 0, 0, 1, len(whole), HEADER_BYTES)
    with ReplicaClient.connect(*address, SECRET, "node-a", timeout=10.0) as client:
        channel = client.channel
        channel.send(PutBegin(d, tags.salt))
        channel.recv(Ack)
        try:
            channel.send_data(0, memoryview(whole)[:HEADER_BYTES])
            sent = frames(channel, whole, tags.tags)
            channel.send(PutEnd(len(whole), 1 + sent))
            channel.recv(Ack)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
    return None


def run_of(whole: bytes, tags, starts: list[int]) -> tuple[list[tuple[int, bytes]], bytes]:
    return [tags[a] for a in starts], b"".join(whole[a : a + tags[a][0]] for a in starts)


STARTS = [HEADER_BYTES + i * BLOCK for i in range(4)]


def honest(channel, whole, tags) -> int:
    send_forged_run(channel, STARTS[0], *run_of(whole, tags, STARTS[:2]))
    send_forged_run(channel, STARTS[2], *run_of(whole, tags, STARTS[2:]))
    return 2


def short(channel, whole, tags) -> int:  # the lengths say less than the frame carries
    entries, data = run_of(whole, tags, STARTS)
    send_forged_run(channel, STARTS[0], [(entries[0][0] - 1, entries[0][1]), *entries[1:]], data)
    return 1


def overlong(channel, whole, tags) -> int:  # the lengths say more than the frame carries
    entries, data = run_of(whole, tags, STARTS)
    send_forged_run(channel, STARTS[0], entries, data[:-BLOCK])
    return 1


def reordered(channel, whole, tags) -> int:  # the second run first
    send_forged_run(channel, STARTS[2], *run_of(whole, tags, STARTS[2:]))
    send_forged_run(channel, STARTS[0], *run_of(whole, tags, STARTS[:2]))
    return 2


def duplicated(channel, whole, tags) -> int:  # a run sent twice (each sealed in turn)
    for _ in range(2):
        send_forged_run(channel, STARTS[0], *run_of(whole, tags, STARTS[:2]))
    send_forged_run(channel, STARTS[2], *run_of(whole, tags, STARTS[2:]))
    return 3


def moved(channel, whole, tags) -> int:  # a run announced one block later than it is
    send_forged_run(channel, STARTS[0], *run_of(whole, tags, STARTS[:1]))
    entries, data = run_of(whole, tags, STARTS[1:])
    send_forged_run(channel, STARTS[1] + 1, entries, data)
    return 2


def empty(channel, whole, tags) -> int:
    send_forged_run(channel, STARTS[0], [], whole[STARTS[0] :], count=0)
    return 1


def too_long(channel, whole, tags) -> int:  # more blocks announced than a run may carry
    entries, data = run_of(whole, tags, STARTS)
    send_forged_run(channel, STARTS[0], entries, data, count=MAX_RUN_BLOCKS + 1)
    return 1


def test_an_honest_run_sender_is_accepted():
    """The frames the refusals below are variations of are good ones: the test can fail."""
    sink = MemorySink()
    with server(sink) as srv:
        assert push_runs(srv.address, honest) is None
        assert srv.snapshot_stats().protocol_errors == 0
    whole, _ = blocks_of(bytes(range(256)) * 4096)
    assert sink.get("job", 0) == whole


@pytest.mark.parametrize("frames,needle", [
    (short, "does not fill"), (overlong, "does not fill"), (reordered, "does not continue"),
    (duplicated, "does not continue"), (moved, "does not continue"), (empty, "run of 0"),
    (too_long, f"run of {MAX_RUN_BLOCKS + 1}"),
])
def test_a_run_that_does_not_add_up_is_refused_and_counted(frames, needle):
    sink = MemorySink()
    with server(sink) as srv:
        error = push_runs(srv.address, frames)
        assert error is not None and needle in str(error), error
        wait_for(lambda: srv.snapshot_stats().protocol_errors == 1)
        assert srv.snapshot_stats().pushes_committed == 0
    assert sink.get("job", 0) is None
    assert [e[0] for e in sink.events] == ["begin", "abort"]


def test_at_the_default_limits_a_run_carries_seven_one_mib_blocks():
    """Each DATA frame costs both ends Python (header, session tag, run prefix, the blocks'
    checks set up) that runs cold right after the frame's multi-MiB socket call: at the
    defaults a holder sends a fetch of the snapshot format's 1 MiB blocks to a peer with the
    default limits (8 MiB frames) in runs of 7, not the 4 that 4 MiB chunks made."""
    from elasticd.replication.channel import frame_chunk
    from elasticd.replication.runs import send_runs
    from elasticd.replication.seal import BlockTags
    from elasticd.replication.server import DEFAULT_CHUNK
    from elasticd.replication.wire import Limits
    from elasticd.snapshot.format import DEFAULT_BLOCK_SIZE

    mib = DEFAULT_BLOCK_SIZE
    chunk, limit = frame_chunk(DEFAULT_CHUNK, Limits().max_frame), Limits().max_frame
    tags = BlockTags(bytes(16), {i * mib: (mib, bytes(16)) for i in range(40)})
    view = memoryview(bytearray(40 * mib))
    runs: list[tuple[int, int]] = []

    class Recorder:
        def send_run(self, offset, blocks):
            runs.append((offset, len(blocks)))

        def send_data(self, offset, chunk):
            raise AssertionError("every block here has its tag")

    frames = send_runs(Recorder(), [(i * mib, view[i * mib : (i + 1) * mib]) for i in range(40)],
                       tags, chunk, limit)
    assert runs == [(i * mib, 7) for i in range(0, 35, 7)] + [(35 * mib, 5)] and frames == 6


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("session", [True, False])
def test_pieces_cover_the_spans_in_order_runs_hold_whole_tagged_blocks_and_cross_no_gap(
        seed, session):
    """send_spans over random spans (adjacent or apart) of a copy whose blocks are partly
    tagged: the frames carry exactly the spans' bytes, in order; with a session every whole
    tagged block inside a span goes in a run (within the run limits, never across a gap),
    without one each goes alone as DATA; no DATA frame crosses a tagged block's start (the
    sender knows no other)."""
    import random

    from elasticd.replication.channel import send_spans
    from elasticd.replication.seal import BlockTags

    rng = random.Random(seed)
    block, total = 100, 4000
    tagged = {o: (min(block, total - o), bytes([o // block]) * 16)
              for o in range(0, total, block) if rng.random() < 0.8}
    buf = memoryview(bytes(rng.getrandbits(8) for _ in range(total)))
    spans, at = [], rng.choice([0, rng.randrange(1, 150)])
    while at < total:
        n = rng.randrange(1, 900)
        if rng.random() < 0.5:  # ending on a block's end, as a stripe's spans do
            n = max(block, (at + n) // block * block - at)
        n = min(n, total - at)
        spans.append((at, buf[at : at + n]))
        at, r = at + n, rng.random()
        if 0.3 <= r < 0.7:  # apart, the next span starting on a block (as a stripe's do)
            at = (at // block + rng.randrange(1, 3)) * block
        elif r >= 0.7:  # apart, anywhere
            at += rng.randrange(1, 300)
    chunk, max_frame = 350, 350 + 12 + 3 * 20  # at most 3 blocks' entries beside 350 bytes
    sent: list[tuple[str, int, bytes, int]] = []

    class Recorder:
        send_key = object() if session else None

        def send_run(self, offset, blocks):
            got, size = b"".join(bytes(c) for _, c in blocks), sum(len(c) for _, c in blocks)
            assert len(blocks) * 20 + 12 + size <= max_frame and size <= chunk
            assert [(len(c), t) for t, c in blocks] == [
                tagged[o] for o in range(offset, offset + size, block)]
            sent.append(("run", offset, got, len(blocks)))

        def send_data(self, offset, piece):
            sent.append(("data", offset, bytes(piece), 0))

        def send(self, end):
            sent.append(("end", end.total_bytes, b"", end.frames))

    frames = send_spans(Recorder(), spans, chunk, BlockTags(bytes(16), tagged), max_frame)
    assert sent.pop() == ("end", sum(len(p) for _, p in spans), b"", frames)
    assert frames == len(sent)
    assert b"".join(s[2] for s in sent) == b"".join(bytes(p) for _, p in spans)
    starts = {o for o, _ in spans}
    ends = {o + len(p) for o, p in spans}
    for kind, offset, data, _ in sent:
        assert data == bytes(buf[offset : offset + len(data)])
        gaps = [e for e in ends if offset < e < offset + len(data) and e not in starts]
        assert not gaps, f"a frame at {offset} crosses the gap at {gaps}"
        if kind == "data":
            assert not any(offset < b < offset + len(data) for b in tagged), \
                f"a DATA frame at {offset} crosses a tagged block's start"
            if not session and offset in tagged and len(data) == tagged[offset][0]:
                continue  # a whole tagged block, sent alone without a session
            assert not session or offset not in tagged or len(data) < tagged[offset][0]
    whole = {o for o, (n, _) in tagged.items()
             for so, p in spans if so <= o and o + n <= so + len(p)}
    in_runs = {o for kind, offset, data, _ in sent if kind == "run"
               for o in range(offset, offset + len(data), block)}
    assert in_runs == (whole if session else set())
