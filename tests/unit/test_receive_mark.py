"""A channel's bulk reads are woken per low-water mark, not per segment, and a raised mark
never holds up what comes after (``elasticd/replication/wakeups.py``), over real loopback TCP."""

from __future__ import annotations

import fcntl
import os
import struct
import termios
import socket
import threading
import time

import pytest

from elasticd.replication.api import TransferTimeout
from elasticd.replication.channel import Channel, tune
from elasticd.replication.messages import PutEnd, data_prefix, encode_frame
from elasticd.replication.wakeups import RECV_MARK, ReceiveMark
from elasticd.replication.wire import TruncatedFrame

FRAME = 4 << 20


class CountingSocket(socket.socket):
    """A socket that counts its ``recv_into`` calls (the receiver's wake-ups)."""

    receives = 0

    def recv_into(self, *args, **kwargs):  # type: ignore[override]
        self.receives += 1
        return super().recv_into(*args, **kwargs)


@pytest.fixture
def pair():
    """A connected loopback TCP pair with the product's options: (sender, receiving socket)."""
    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    receiver = CountingSocket(fileno=accepted.detach())
    for sock in (sender, receiver):
        tune(sock)
    receiver.settimeout(10)
    yield sender, receiver
    sender.close()
    receiver.close()


def paced(sock: socket.socket, data: bytes, piece: int = 64 << 10, pause: float = 2e-4) -> None:
    """Sends ``data`` a piece at a time, pausing between pieces, so that an unmarked receiver
    would be woken for each one."""
    view = memoryview(data)
    for at in range(0, len(view), piece):
        sock.sendall(view[at : at + piece])
        time.sleep(pause)


def lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def test_a_bulk_read_is_woken_per_mark_and_the_next_frame_at_once(pair):
    sender, receiver = pair
    frames = [os.urandom(FRAME) for _ in range(3)]

    def send() -> None:
        for i, chunk in enumerate(frames):
            sender.sendall(data_prefix(i * FRAME, memoryview(chunk), None))
            paced(sender, chunk)
        sender.sendall(encode_frame(PutEnd(3 * FRAME, 3), None))

    thread = threading.Thread(target=send)
    thread.start()
    channel = Channel(receiver)
    landed = memoryview(bytearray(3 * FRAME))
    for _ in frames:
        channel.recv_data_into(channel.recv_header(), lambda o, n: landed[o : o + n])
        assert lowat(receiver) == 1  # back to any byte once the frame is in
    receiver.settimeout(2)  # a mark left raised would hold the short frame up until this
    end = channel.recv_message(channel.recv_header())
    thread.join()
    assert end == PutEnd(3 * FRAME, 3)
    assert bytes(landed) == b"".join(frames)
    # Unmarked, each 64 KiB piece is a wake-up: 64 a frame. Marked, about one per MiB.
    per_frame = receiver.receives / len(frames)
    assert per_frame <= 2 + 2 * FRAME // RECV_MARK, receiver.receives


def test_a_sender_that_stalls_mid_read_still_times_out_and_the_mark_is_reset(pair):
    sender, receiver = pair
    chunk = os.urandom(FRAME)
    sender.sendall(data_prefix(0, memoryview(chunk), None))
    sender.sendall(chunk[: FRAME // 2 + 12345])  # then nothing more
    receiver.settimeout(0.5)
    channel = Channel(receiver)
    landed = memoryview(bytearray(FRAME))
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        channel.recv_data_into(channel.recv_header(), lambda o, n: landed[o : o + n])
    assert time.monotonic() - start < 5
    assert lowat(receiver) == 1


def test_a_peer_that_closes_mid_read_ends_it_at_once(pair):
    sender, receiver = pair
    chunk = os.urandom(FRAME)
    sender.sendall(data_prefix(0, memoryview(chunk), None))
    sender.sendall(chunk[: RECV_MARK + RECV_MARK // 2])  # less than a mark after the first
    sender.shutdown(socket.SHUT_WR)
    channel = Channel(receiver)
    landed = memoryview(bytearray(FRAME))
    start = time.monotonic()
    with pytest.raises(TruncatedFrame):
        channel.recv_data_into(channel.recv_header(), lambda o, n: landed[o : o + n])
    assert time.monotonic() - start < 5  # not the socket's 10 s timeout


def test_only_plain_tcp_sockets_with_room_for_a_mark_are_marked(pair):
    _, receiver = pair
    assert ReceiveMark(receiver).bulk(2 * RECV_MARK)
    assert not ReceiveMark(receiver).bulk(2 * RECV_MARK - 1)  # a small read: as it was
    left, right = socket.socketpair()
    tight = socket.socket()
    tight.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)  # granted 64 KiB
    try:
        assert not ReceiveMark(left).bulk(8 << 20)  # a Unix socket (a test double's kind)
        assert not ReceiveMark(tight).bulk(8 << 20)  # a buffer too small for a mark to help
        assert not ReceiveMark(object()).bulk(8 << 20)  # not a socket at all
    finally:
        for sock in (left, right, tight):
            sock.close()


def test_a_blocking_socket_is_not_marked(pair):
    """Why (the kernel's behaviour the rule rests on, shown below): a blocking receive that
    copied part of what it asked for sleeps until a whole mark of new bytes waits."""
    _, receiver = pair
    receiver.settimeout(None)
    assert not ReceiveMark(receiver).bulk(8 << 20)
    receiver.settimeout(5)
    assert ReceiveMark(receiver).bulk(8 << 20)


def queued(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue, not yet copied out."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


@pytest.mark.parametrize("blocking", [True, False])
def test_under_a_mark_only_a_blocking_receive_waits_on_bytes_that_will_not_come(pair, blocking):
    """Both receive as the channel does (the mark lowered to what is left before each
    receive): 700 KiB wait before the first receive, 800 KiB more come after it, then
    nothing."""
    sender, receiver = pair
    if blocking:  # bounded in the kernel (2 s), so that the wait the test expects ends
        receiver.settimeout(None)
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 2, 0))
    else:
        receiver.settimeout(5)
    first, second = RECV_MARK * 7 // 10, RECV_MARK * 8 // 10  # less than a mark each
    sender.sendall(b"a" * first)
    wait_until(lambda: queued(receiver) == first, "the first part queued")

    def rest() -> None:
        if blocking:  # once the receive has copied the first part out, and sleeps
            wait_until(lambda: queued(receiver) == 0, "the first part copied")
        # Polled, the first part stays queued (under the mark) whether or not the receive has
        # reached its poll yet: the outcome must be the same either way.
        sender.sendall(b"b" * second)

    thread = threading.Thread(target=rest)
    thread.start()
    buf = memoryview(bytearray(first + second))
    got, start = 0, time.monotonic()
    while got < len(buf):
        left = len(buf) - got
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(RECV_MARK, left))
        got += receiver.recv_into(buf[got:])
    took = time.monotonic() - start
    thread.join()
    assert bytes(buf) == b"a" * first + b"b" * second
    if blocking:  # it had 700 KiB in hand and slept until a mark of new bytes, or the bound
        assert took >= 1.8, took
    else:  # each poll weighs every byte waiting against the mark
        assert took < 1.5, took
