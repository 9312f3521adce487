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
