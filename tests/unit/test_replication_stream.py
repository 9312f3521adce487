"""A sealed stream (elasticd/replication/channel.py ``send_stream`` / ``receive_stream``):
every frame checked in order under its sequence number, a forged or replayed frame anywhere in
the stream refused.
"""

from __future__ import annotations

import pytest

from elasticd.replication.channel import Channel, receive_stream, send_stream
from elasticd.replication.seal import FrameKey
from elasticd.replication.wire import HEADER, HEADER_SIZE, OFFSET, ForgedFrame, FrameType

KEY = bytes(range(32))
CHUNK = 64 << 10


class Recorder:
    """A sending end that keeps every byte (not a socket: one sendall per part)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def sendall(self, part) -> None:
        self.data += part


class Replay:
    """A receiving end that serves recorded bytes."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = memoryview(data), 0

    def recv_into(self, view) -> int:
        n = min(len(view), len(self.data) - self.pos, 48 << 10)  # several pieces per frame
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def sealed_stream(payload: bytes) -> bytes:
    sender = Channel(Recorder())
    sender.send_key = FrameKey(KEY)
    frames = send_stream(sender, (memoryview(payload),), CHUNK)
    assert frames == -(-len(payload) // CHUNK)
    assert sender.send_key._sequence == frames + 1  # every DATA frame and PUT_END, in order
    return bytes(sender.sock.data)


def receiver(data: bytes) -> Channel:
    channel = Channel(Replay(data))
    channel.recv_key = FrameKey(KEY)
    return channel


def frame_starts(data: bytes) -> list[tuple[int, int]]:
    """(offset in the stream, type) of each frame."""
    out, pos = [], 0
    while pos < len(data):
        _, _, ftype, _, length, _ = HEADER.unpack(data[pos : pos + HEADER_SIZE])
        out.append((pos, ftype))
        pos += HEADER_SIZE + length
    return out


PAYLOAD = bytes(i * 7 % 251 for i in range(20 * CHUNK + 123))


def test_a_sealed_stream_arrives_intact():
    data = sealed_stream(PAYLOAD)
    target = bytearray(len(PAYLOAD))
    assert receive_stream(receiver(data), len(PAYLOAD), memoryview(target)) == 21
    assert bytes(target) == PAYLOAD


@pytest.mark.parametrize("nth", [0, 9, 20])
def test_a_forged_frame_anywhere_in_the_stream_is_refused(nth):
    data = bytearray(sealed_stream(PAYLOAD))
    start = [pos for pos, ftype in frame_starts(data) if ftype == FrameType.DATA][nth]
    data[start + HEADER_SIZE + OFFSET.size + 5] ^= 0x01  # one data bit, tag left as it was
    with pytest.raises(ForgedFrame, match=f"at offset {nth * CHUNK} fails its authentication"):
        receive_stream(receiver(bytes(data)), len(PAYLOAD), memoryview(bytearray(len(PAYLOAD))))


def test_a_frame_replayed_from_an_earlier_stream_is_refused():
    """Same offset, same bytes, a valid tag: but made under another sequence number."""
    sender = Channel(Recorder())
    sender.send_key = FrameKey(KEY)
    send_stream(sender, (memoryview(PAYLOAD),), CHUNK)
    first = bytes(sender.sock.data)
    send_stream(sender, (memoryview(PAYLOAD),), CHUNK)
    second = bytes(sender.sock.data[len(first) :])
    (a, _), (b, _) = frame_starts(first)[3:5]
    (c, _), (d, _) = frame_starts(second)[3:5]
    replayed = second[:c] + first[a:b] + second[d:]
    channel = receiver(first + replayed)
    target = memoryview(bytearray(len(PAYLOAD)))
    assert receive_stream(channel, len(PAYLOAD), target) == 21
    with pytest.raises(ForgedFrame, match=f"at offset {3 * CHUNK} fails"):
        receive_stream(channel, len(PAYLOAD), target)

