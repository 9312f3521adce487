"""Replication framing: round trips, typed rejections, and fuzzing of the parsers."""

from __future__ import annotations

import socket
import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticd.replication.api import ConnectionLost, Descriptor, RemoteError
from elasticd.replication.channel import Channel, receive_stream, send_stream
from elasticd.replication.messages import (
    Ack,
    Auth,
    Challenge,
    Data,
    Error,
    Fetch,
    FetchReply,
    Hello,
    Nack,
    PutBegin,
    PutEnd,
    data_prefix,
    encode_frame,
)
from elasticd.replication.wire import (
    CHECKED,
    HEADER,
    HEADER_SIZE,
    BadMagic,
    ChecksumMismatch,
    FrameTooLarge,
    Limits,
    MalformedFrame,
    ProtocolError,
    TruncatedFrame,
    UnexpectedFrame,
    UnknownFlags,
    UnknownFrameType,
    UnsupportedVersion,
    VERSION,
    checksum,
)
from elasticd.testing.replication import decode_frame

D = Descriptor("job-a", 3, 1, 42, 1000, 100)
MESSAGES = [
    Hello("node-1", b"n" * 32, 8 << 20),
    Challenge("node-2", b"s" * 32, 4 << 20),
    Auth(b"q" * 32),
    PutBegin(D),
    PutEnd(1000, 3),
    Ack({"bytes": 1000}),
    Ack(),
    Nack("stale", "holding (1, 43)"),
    Fetch("job-a", 3),
    Fetch("job-a", 3, 1, 42),
    FetchReply(D),
    Error("protocol", "bad magic"),
]


class FakeSocket:
    """A socket that yields preset bytes to ``recv_into`` (at most ``step`` per call)."""

    def __init__(self, data: bytes, step: int = 1 << 30) -> None:
        self.data = memoryview(bytes(data))
        self.pos = 0
        self.step = step
        self.sent = bytearray()

    def recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        n = min(len(view), self.step, len(self.data) - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n

    def sendall(self, data) -> None:
        self.sent += data

    def close(self) -> None:
        pass


def reseal(frame: bytearray, fix_length: bool = False) -> bytes:
    """Recomputes the checksum (and the length), so that a mutated frame reaches the payload
    parsers."""
    if fix_length:
        frame[8:12] = struct.pack("!I", len(frame) - HEADER_SIZE)
    head = bytes(frame[: CHECKED.size])
    frame[CHECKED.size : HEADER_SIZE] = checksum(head, frame[HEADER_SIZE:])
    return bytes(frame)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode_frame(encode_frame(msg)) == msg


def test_data_round_trip_and_stream_into_caller_buffer():
    chunk = bytes(range(256)) * 40
    frame = data_prefix(4096, chunk) + chunk
    msg = decode_frame(frame)
    assert isinstance(msg, Data) and msg.offset == 4096 and bytes(msg.chunk) == chunk

    a, b = socket.socketpair()
    try:
        sender, receiver = Channel(a), Channel(b)
        header, body = memoryview(b"H" * 10), memoryview(bytearray(range(256)) * 3)
        target = bytearray(len(header) + len(body))
        send_stream(sender, (header, body), chunk=100)
        assert receive_stream(receiver, len(target), memoryview(target)) == 1 + 8
        assert bytes(target) == bytes(header) + bytes(body)
    finally:
        a.close()
        b.close()


def test_channel_round_trip_over_socketpair():
    a, b = socket.socketpair()
    try:
        left, right = Channel(a), Channel(b)
        for msg in MESSAGES[:-1]:
            left.send(msg)
            assert right.recv() == msg
        left.send(MESSAGES[-1])
        with pytest.raises(RemoteError, match="bad magic"):
            right.recv(Ack)
        left.send(Ack())
        with pytest.raises(UnexpectedFrame, match="expected NACK, received ACK"):
            right.recv(Nack)
        a.close()
        with pytest.raises(ConnectionLost):
            right.recv()
    finally:
        a.close()
        b.close()


def _header(frame: bytes, **fields) -> bytearray:
    magic, version, ftype, flags, length, check = HEADER.unpack(frame[:HEADER_SIZE])
    values = dict(magic=magic, version=version, ftype=ftype, flags=flags, length=length,
                  check=check) | fields
    return bytearray(HEADER.pack(*values.values()) + frame[HEADER_SIZE:])


@pytest.mark.parametrize(
    "fields,error,needle",
    [
        (dict(magic=b"HTTP"), BadMagic, "not an elasticd replication peer"),
        (dict(version=1), UnsupportedVersion, "v1"),
        (dict(version=3), UnsupportedVersion, "peer speaks replication protocol v3, this "
                                              "elasticd speaks v7"),  # v3 (no pretagged DATA)
        (dict(version=4), UnsupportedVersion, "peer speaks replication protocol v4, this "
                                              "elasticd speaks v7: upgrade elasticd on every "
                                              "node"),  # v4: the old commit protocol
        (dict(version=5), UnsupportedVersion, "peer speaks replication protocol v5, this "
                                              "elasticd speaks v7: upgrade elasticd on every "
                                              "node"),  # v5: one block per pretagged frame
        (dict(version=6), UnsupportedVersion, "peer speaks replication protocol v6, this "
                                              "elasticd speaks v7: upgrade elasticd on every "
                                              "node"),  # v6: one range per fetch
        (dict(ftype=99), UnknownFrameType, "99"),
        (dict(flags=4), UnknownFlags, "0x0004"),
        (dict(flags=2), UnknownFlags, "only a sealed DATA frame"),
        (dict(length=1 << 20), FrameTooLarge, "limit 65536"),
        (dict(check=b"\1" * 16), ChecksumMismatch, "checksum"),
    ],
)
def test_header_rejections_are_typed_and_say_what(fields, error, needle):
    frame = _header(encode_frame(Ack({"x": 1})), **fields)
    with pytest.raises(error, match=needle):
        decode_frame(frame)


def test_truncated_and_trailing_frames():
    frame = encode_frame(PutBegin(D))
    with pytest.raises(TruncatedFrame):
        decode_frame(frame[:-1])
    with pytest.raises(TruncatedFrame):
        decode_frame(frame[:5])
    with pytest.raises(MalformedFrame, match="after"):
        decode_frame(frame + b"x")


@pytest.mark.parametrize(
    "msg_type,payload,needle",
    [
        (PutBegin, b"[1, 2]", "not a JSON object"),
        (PutBegin, b"\xff\xfe", "not JSON"),
        (PutBegin, b"[" * 60000, "not JSON"),
        (PutBegin, b'{"job": "j"}', "invalid descriptor"),
        (PutBegin, b'{"job":"j","owner_rank":-1,"generation":0,"step":0,"total_bytes":1,'
                   b'"header_bytes":0}', "owner_rank"),
        (Fetch, b'{"job":"j","owner_rank":1,"generation":3}', "both or neither"),
        (Auth, b"short", "32 bytes"),
        (Hello, b"x" * 30, "too short"),
        (Hello, b"x" * 40, "does not match"),
        (Hello, b"n" * 32 + b"\0\0\0\x08\0\x01a", "DATA frame limit of 8"),
        (PutEnd, b"\0" * 3, "12 bytes"),
        (Data, b"\0" * 8, "no room"),
    ],
)
def test_payload_rejections(msg_type, payload, needle):
    checked = CHECKED.pack(b"EDRP", VERSION, msg_type.TYPE, 0, len(payload))
    frame = checked + checksum(checked, payload) + payload
    with pytest.raises(MalformedFrame, match=needle):
        decode_frame(frame)


def test_huge_length_is_rejected_before_reading_it():
    # A DATA header announcing 4 GiB: the reader must refuse it having read the header only.
    checked = CHECKED.pack(b"EDRP", VERSION, 5, 0, 2**32 - 1)
    fake = FakeSocket(checked + b"\0" * 16 + b"payload that must not be read")
    with pytest.raises(FrameTooLarge, match="DATA frame announces 4294967295"):
        Channel(fake, Limits(max_frame=1 << 20)).recv_header()
    assert fake.pos == HEADER_SIZE


def test_data_outside_a_transfer_is_unexpected():
    chunk = b"abc"
    with pytest.raises(UnexpectedFrame):
        ch = Channel(FakeSocket(data_prefix(0, chunk) + chunk))
        ch.recv_message(ch.recv_header())


def test_invalid_outgoing_values_are_refused():
    with pytest.raises(ValueError):
        encode_frame(Hello("", b"n" * 32, 1))
    with pytest.raises(ValueError):
        encode_frame(Hello("a", b"short", 1))
    with pytest.raises(ValueError):
        Descriptor("j", 0, 0, 0, total_bytes=10, header_bytes=11)
    with pytest.raises(ValueError):
        Limits(max_frame=4)


# -- fuzzing ----------------------------------------------------------------------------------

valid_frames = st.one_of(
    st.sampled_from([encode_frame(m) for m in MESSAGES]),
    st.binary(min_size=1, max_size=300).map(lambda c: data_prefix(7, c) + c),
)


@st.composite
def mutated(draw):
    frame = bytearray(draw(valid_frames))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "length", "insert", "byte"]))
        if op == "flip" and frame:
            i = draw(st.integers(0, len(frame) * 8 - 1))
            frame[i // 8] ^= 1 << (i % 8)
        elif op == "truncate":
            del frame[draw(st.integers(0, len(frame))):]
        elif op == "length" and len(frame) >= HEADER_SIZE:
            frame[8:12] = struct.pack("!I", draw(st.integers(0, 2**32 - 1)))
        elif op == "insert":
            i = draw(st.integers(0, len(frame)))
            frame[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "byte" and len(frame) > HEADER_SIZE:
            i = draw(st.integers(HEADER_SIZE, len(frame) - 1))
            frame[i] = draw(st.integers(0, 255))
    mode = draw(st.sampled_from(["raw", "checksum", "length+checksum"]))
    if mode != "raw" and len(frame) >= HEADER_SIZE:
        # A consistent header over a damaged payload: the payload parsers see the damage.
        return reseal(frame, fix_length=mode == "length+checksum")
    return bytes(frame)


LIMITS = Limits(max_frame=1 << 20, max_control=4096)
STREAM_LIMITS = Limits(max_frame=1024 + 8, max_control=512)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_fuzz_decode_frame_raises_only_protocol_errors(frame):
    tracemalloc.start()
    try:
        try:
            decode_frame(frame, LIMITS)
        except ProtocolError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 << 10  # never sized by a length field


@settings(max_examples=300, deadline=None)
@given(st.lists(mutated(), min_size=1, max_size=4), st.integers(1, 64))
def test_fuzz_stream_reader_raises_only_protocol_errors(frames, step):
    channel = Channel(FakeSocket(b"".join(frames), step=step), STREAM_LIMITS)
    sink = bytearray(1024)
    with pytest.raises((ProtocolError, ConnectionLost)):
        for _ in range(100):  # bounded: the stream is finite, so this must end in an error
            header = channel.recv_header()
            if header.length > 1024 + 8:
                raise AssertionError("a DATA frame over the sink size passed the limit check")
            if header.type.name == "DATA":
                channel.recv_data_into(header, lambda off, n: memoryview(sink)[:n])
            else:
                channel.recv_message(header)
