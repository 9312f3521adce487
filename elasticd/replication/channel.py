"""Frames over one connected socket, with bounded reads and uncopied DATA.

A :class:`Channel` reads a frame header into a fixed buffer and validates it before reading a
byte of payload. Control payloads go into one buffer of ``Limits.max_control`` bytes allocated
with the channel; DATA payloads are read with ``recv_into`` straight into memory the caller
names (the sink's, later shared memory), checked there as each piece arrives, and never copied
on the way. Sends use ``sendmsg`` so a DATA frame's header and its chunk leave in one call
without being joined.

Once the handshake sets :attr:`Channel.send_key` and :attr:`Channel.recv_key`, every frame each
way is sealed and opened with them (:mod:`elasticd.replication.seal`), and an unsealed frame is
refused: from then on nothing a relay alters, replays or reorders is accepted.

:func:`send_stream` and :func:`receive_stream` move one snapshot's bytes as DATA frames closed
by PUT_END, for pushes and fetches alike. Socket failures surface as :class:`~elasticd.replication.api.ConnectionLost` (or
:class:`~elasticd.replication.api.TransferTimeout`), protocol violations as
:class:`~elasticd.replication.wire.ProtocolError`.
"""

from __future__ import annotations

import bisect
import contextlib
import socket
import ssl
from typing import Any, Callable, Sequence

import xxhash
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from elasticd.clock import SYSTEM_CLOCK
from elasticd.replication.api import (
    ConnectionLost,
    DeadlineExceeded,
    RemoteError,
    TransferTimeout,
)
from elasticd.replication.messages import (
    Error,
    Message,
    PutEnd,
    data_prefix,
    decode_payload,
    encode_frame,
    frame_opener,
    open_payload,
    run_prefix,
)
from elasticd.replication.runs import RunCheck, send_runs
from elasticd.replication.scatter import Spans
from elasticd.replication.seal import BlockTags, FrameKey
from elasticd.replication.wakeups import ReceiveMark
from elasticd.replication.wire import (
    HEADER_SIZE,
    MAX_RUN_BLOCKS,
    MAX_RUN_PREFIX,
    OFFSET,
    RUN,
    RUN_ENTRY,
    FrameHeader,
    FrameType,
    ChecksumMismatch,
    Limits,
    MalformedFrame,
    ProtocolError,
    TruncatedFrame,
    UnexpectedFrame,
    parse_header,
)

#: Given (offset, length) of an incoming DATA chunk, returns the writable view of exactly that
#: length where it must land (or the :class:`Spans` of several places, in order: a
#: :class:`~elasticd.replication.scatter.Scatter`'s), or raises ProtocolError when the range is
#: not acceptable.
Destination = Callable[[int, int], "memoryview | Spans"]


class Channel:
    """One end of a replication connection.

    Args:
        sock: a connected socket (plain or TLS); anything with ``recv_into`` and ``sendall``
            works, which tests use to feed the reader arbitrary bytes.
    """

    def __init__(self, sock: Any, limits: Limits = Limits()) -> None:
        self.sock = sock
        self.limits = limits
        self._head = memoryview(bytearray(HEADER_SIZE))
        self._offset = memoryview(bytearray(OFFSET.size))
        self._run = memoryview(bytearray(MAX_RUN_PREFIX))
        self._control = memoryview(bytearray(limits.max_control))
        # TLS sockets have no sendmsg; fall back to one sendall per part there.
        self._gather = isinstance(sock, socket.socket) and not isinstance(sock, ssl.SSLSocket)
        self.bytes_received = 0
        #: Seal outgoing / open incoming frames with these once authenticated (None before).
        self.send_key: FrameKey | None = None
        self.recv_key: FrameKey | None = None
        #: The block key of the snapshot being received, when its PUT_BEGIN (a push) or
        #: FETCH_REPLY (a fetch) announced pretagged DATA (set and cleared around one transfer).
        self.block_key: bytes | None = None
        #: When a dict: each pretagged block received is recorded there once its tag checked,
        #: ``{offset: (length, tag)}`` (a push's receiver keeps them to serve fetches).
        self.landed_tags: dict[int, tuple[int, bytes]] | None = None
        # The AEAD of block_key (made once per transfer, not per frame): (key, aead).
        self._block_aead: tuple[bytes, Any] | None = None
        #: Chunk bytes received pretagged and checked against their block tags (for a
        #: receiver that would otherwise check them again).
        self.tag_checked_bytes = 0
        #: While :meth:`within` is in force: the monotonic time (SYSTEM_CLOCK: the sockets
        #: wait in real time) by which the current call must end, and the socket's own
        #: timeout, which each send and receive is capped by as well.
        self.deadline: float | None = None
        self._idle: float | None = None
        self._budget = 0.0
        self._rearm = 0.0  # when _arm next lowers the socket's timeout to the deadline
        self._mark = ReceiveMark(sock)

    @contextlib.contextmanager
    def within(self, seconds: float | None) -> Any:
        """Bounds every send and receive inside the block by one deadline ``seconds`` from
        now (None: only the socket's own per-call timeout), so that a peer that stops
        answering mid-transfer costs at most ``seconds`` in all, not the socket timeout per
        receive. Past it, the next send or receive raises DeadlineExceeded."""
        if seconds is None:
            yield
            return
        self._idle, self._budget = self.sock.gettimeout(), seconds
        self.deadline = SYSTEM_CLOCK.monotonic() + seconds
        self._rearm = 0.0
        try:
            yield
        finally:
            self.deadline = None
            with contextlib.suppress(OSError):
                self.sock.settimeout(self._idle)

    def _arm(self) -> None:
        """Caps the socket's timeout by what is left of the deadline (when one is set): again
        every :data:`ARM_SLACK` seconds, not before every send and receive (each
        ``settimeout`` is a syscall, and a transfer makes a thousand receives per GiB), so a
        wait may end up to that long after the deadline."""
        if self.deadline is None:
            return
        now = SYSTEM_CLOCK.monotonic()
        left = self.deadline - now
        if left <= 0:
            raise DeadlineExceeded(f"the call's deadline of {self._budget:.1f} s passed")
        if now >= self._rearm:
            self.sock.settimeout(left if self._idle is None else min(self._idle, left))
            self._rearm = now + ARM_SLACK

    def _expired(self) -> bool:
        """A socket timeout that came from the deadline, not from the idle timeout."""
        return (self.deadline is not None
                and SYSTEM_CLOCK.monotonic() >= self.deadline - 1e-3)

    # -- sending ---------------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        self._send(encode_frame(msg, self.send_key))

    def send_data(self, offset: int, chunk: memoryview) -> None:
        """Sends one DATA frame; ``chunk`` is read (and tagged) where it lies."""
        self._send(data_prefix(offset, chunk, self.send_key), chunk)

    def send_run(self, offset: int, blocks: list[tuple[bytes, memoryview]]) -> None:
        """Sends consecutive blocks from ``offset`` on in one pretagged DATA frame, each with
        the tag made when it was sealed: ``blocks`` is ``(tag, chunk)`` in order. The chunks
        are not read here, only sent, all in one ``sendmsg`` with the frame's prefix."""
        if self.send_key is None:
            raise ValueError("pretagged DATA needs an authenticated session")
        prefix = run_prefix(offset, [(len(chunk), tag) for tag, chunk in blocks], self.send_key)
        self._send(prefix, *(chunk for _, chunk in blocks))

    def send_error(self, code: str, message: str) -> None:
        """Best effort: tells the peer why the connection is about to close."""
        with contextlib.suppress(ConnectionLost):
            self.send(Error(code, message))

    def _send(self, *parts: Any) -> None:
        try:
            self._arm()
            if not self._gather:
                for part in parts:
                    self.sock.sendall(part)
            else:
                views = [memoryview(p).cast("B") for p in parts]
                while views:
                    self._arm()
                    sent = self.sock.sendmsg(views)
                    while sent:
                        if sent >= len(views[0]):
                            sent -= len(views.pop(0))
                        else:
                            views[0] = views[0][sent:]
                            sent = 0
        except socket.timeout as exc:
            if self._expired():
                raise DeadlineExceeded(f"the call's deadline of {self._budget:.1f} s passed "
                                       "while sending") from exc
            raise TransferTimeout(f"send blocked for {self.sock.gettimeout()} s") from exc
        except OSError as exc:
            raise ConnectionLost(f"send failed: {exc}") from exc

    # -- receiving -------------------------------------------------------------------------

    def recv_header(self) -> FrameHeader:
        """Reads and validates the next frame header.

        Raises:
            ConnectionLost: the peer closed cleanly between frames, or the socket failed.
            ProtocolError: an invalid header, or a close in the middle of it.
        """
        self._recv_exactly(self._head, "a frame header", at_boundary=True)
        return parse_header(self._head, self.limits)

    def recv_message(self, header: FrameHeader) -> Message:
        """Reads, verifies and decodes the payload of a control (non-DATA) frame."""
        if header.type is FrameType.DATA:
            raise UnexpectedFrame("DATA frame outside a transfer")
        payload = self._control[: header.length]
        self._recv_exactly(payload, f"a {header.type.name} payload")
        open_payload(header, self.recv_key, payload)
        return decode_payload(header, payload)

    def recv(self, *expected: type) -> Message:
        """Reads the next control frame, which must be one of ``expected`` (any when empty).

        Raises:
            RemoteError: the peer sent ERROR (unless ``Error`` is expected).
            UnexpectedFrame: another frame type.
        """
        msg = self.recv_message(self.recv_header())
        if isinstance(msg, Error) and Error not in expected:
            raise RemoteError(msg.code, msg.message)
        if expected and not isinstance(msg, expected):
            names = "/".join(t.TYPE.name for t in expected)
            raise UnexpectedFrame(f"expected {names}, received {msg.TYPE.name}")
        return msg

    def recv_data_into(self, header: FrameHeader, destination: Destination) -> tuple[int, int]:
        """Reads a DATA payload into the memory ``destination`` names and verifies it there.

        Returns:
            (offset, length) of the chunk.
        """
        if header.type is not FrameType.DATA:
            raise UnexpectedFrame(f"expected DATA, received {header.type.name}")
        # Checked before a byte of it is stored: an unsealed DATA frame after the handshake is
        # refused here.
        opener = frame_opener(header, self.recv_key)
        if header.pretagged:
            return self._recv_pretagged(header, opener, destination)
        self._recv_exactly(self._offset, "a DATA offset")
        (offset,) = OFFSET.unpack(self._offset)
        length = header.length - OFFSET.size
        target = destination(offset, length)
        if len(target) != length:
            raise ProtocolError(f"destination for {length} bytes has {len(target)}")
        # Check each piece as it arrives. The bytes land in the destination before their tag
        # is checked; a failed check aborts the whole transfer, so nothing unverified is ever
        # committed.
        hasher: Any = opener if opener is not None else xxhash.xxh3_128(header.checked)
        hasher.update(self._offset)
        self._recv_exactly(target, "a DATA chunk", feed=hasher.update)
        if opener is not None:
            opener.check(header, f" at offset {offset}")
        elif hasher.digest() != header.check:
            raise ChecksumMismatch(f"DATA frame of {header.length} bytes at offset {offset} "
                                   "fails its xxh3 checksum")
        return offset, length

    def _recv_pretagged(self, header: FrameHeader, session: Any,
                        destination: Destination) -> tuple[int, int]:
        if self.block_key is None:
            raise UnexpectedFrame("pretagged DATA in a transfer whose PUT_BEGIN gave no tag salt")
        # The whole prefix (offset, count, lengths, block tags) is authenticated by the session
        # tag before a byte of block is read, and its lengths must fill the frame exactly.
        fixed = self._run[: RUN.size]
        self._recv_exactly(fixed, "a run's offset and block count")
        offset, n = RUN.unpack(fixed)
        prefix = RUN.size + n * RUN_ENTRY.size
        if not 0 < n <= MAX_RUN_BLOCKS or prefix >= header.length:
            raise MalformedFrame(f"pretagged DATA frame of {header.length} bytes announces a "
                                 f"run of {n} blocks (1 to {MAX_RUN_BLOCKS}, each at least "
                                 "one byte)")
        self._recv_exactly(self._run[RUN.size : prefix], "a run's block lengths and tags")
        session.update(self._run[:prefix])
        session.check(header)
        blocks = list(RUN_ENTRY.iter_unpack(self._run[RUN.size : prefix]))
        length = header.length - prefix
        if any(size == 0 for size, _ in blocks) or sum(size for size, _ in blocks) != length:
            raise MalformedFrame(f"a run of {n} blocks of {[b[0] for b in blocks][:8]} bytes "
                                 f"does not fill its frame's {length} block bytes")
        target = destination(offset, length)
        if len(target) != length:
            raise ProtocolError(f"destination for {length} bytes has {len(target)}")
        if self._block_aead is None or self._block_aead[0] is not self.block_key:
            self._block_aead = (self.block_key, ChaCha20Poly1305(self.block_key))
        run = RunCheck(self._block_aead[1], offset, blocks, target, key=self.block_key)
        self._recv_exactly(target, "a run of blocks", feed=run.update)
        self.tag_checked_bytes += length
        if self.landed_tags is not None:
            self.landed_tags.update(run.landed)
        return offset, length

    def _recv_exactly(self, view: "memoryview | Spans", what: str, at_boundary: bool = False,
                      feed: Callable[[memoryview], Any] | None = None) -> None:
        if isinstance(view, Spans):  # bytes landing in several places: each part in turn
            for part in view.parts:
                self._recv_exactly(part, what, feed=feed)
            return
        got, need, marked = 0, len(view), False
        try:
            while got < need:
                try:
                    self._arm()
                    if not got:  # a bulk read is woken per mark: decided once _arm has run
                        marked = self._mark.bulk(need)
                    if marked:
                        self._mark.left(need - got)
                    n = self.sock.recv_into(view[got:])
                    if feed is not None:
                        feed(view[got : got + n])
                except socket.timeout as exc:
                    if self._expired():
                        raise DeadlineExceeded(f"the call's deadline of {self._budget:.1f} s "
                                               f"passed while waiting for {what}") from exc
                    raise TransferTimeout(f"nothing received for {self.sock.gettimeout()} s "
                                          f"while waiting for {what}") from exc
                except OSError as exc:
                    raise ConnectionLost(f"receive failed: {exc}") from exc
                if not n:
                    if at_boundary and not got:
                        raise ConnectionLost("peer closed the connection")
                    raise TruncatedFrame(f"connection closed after {got} of {need} bytes of "
                                         f"{what}")
                got += n
        finally:
            if marked:
                self._mark.reset()
        self.bytes_received += need

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def shutdown(self) -> None:
        """Ends both directions at once: a recv or send blocked in another thread returns."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def linger_close(self, timeout: float = 1.0, limit: int = 16 << 20) -> None:
        """Closes so that the peer can still read what was sent last (an ERROR frame).

        Closing a TCP socket with unread input makes the kernel reset the connection, and a
        reset can destroy the ERROR frame before the peer reads it; a peer that pipelines
        DATA has plenty in flight. So: stop sending, read and drop what the peer still sends
        (at most ``timeout`` seconds and ``limit`` bytes), then close.
        """
        if isinstance(self.sock, ssl.SSLSocket):  # TLS has its own close_notify
            self.close()
            return
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.settimeout(timeout)
            scratch = memoryview(bytearray(64 << 10))
            deadline, drained = SYSTEM_CLOCK.monotonic() + timeout, 0
            while drained < limit and SYSTEM_CLOCK.monotonic() < deadline:
                n = self.sock.recv_into(scratch)
                if not n:
                    break
                drained += n
        self.close()


def receive_stream(channel: Channel, total: int, target: memoryview, base: int = 0) -> int:
    """Reads DATA frames into ``target[0:total]`` up to PUT_END; returns the frame count.

    Chunks must arrive in order and cover ``total`` bytes exactly, the first at offset
    ``base`` (a ranged fetch: ``target`` then holds the snapshot's bytes ``[base, base +
    total)``).

    Raises:
        ProtocolError: out-of-order or out-of-range chunk, a count mismatch, a bad checksum.
        ConnectionLost: the connection dropped or went idle mid-stream.
    """
    return receive_spans(channel, target, [(base, base + total)], base)


def receive_spans(channel: Channel, target: memoryview, ranges: Sequence[tuple[int, int]],
                  base: int = 0) -> int:
    """:func:`receive_stream` of the snapshot bytes ``ranges`` (``[start, end)`` each,
    ascending, apart: a fetch of several ranges) into ``target``, which holds the snapshot
    from offset ``base`` on: the chunks must fill each range in turn, none across two."""
    spans = list(ranges)
    total = sum(end - start for start, end in spans)
    received = frames = 0
    index, at = 0, spans[0][0] if spans else base  # the range being filled, its next offset

    def destination(offset: int, length: int) -> memoryview:
        nonlocal index, at
        while index < len(spans) and at == spans[index][1]:  # this range is full: the next
            index += 1
            at = spans[index][0] if index < len(spans) else at
        if index == len(spans) or offset != at or offset + length > spans[index][1]:
            asked = ", ".join(f"[{s}, {e})" for s, e in spans[:4]) + (
                ", ..." if len(spans) > 4 else "")
            raise MalformedFrame(f"DATA for bytes [{offset}, {offset + length}) does not "
                                 f"continue at {at} within the bytes asked for ({asked})")
        at += length
        return target[offset - base : offset - base + length]

    while True:
        header = channel.recv_header()
        if header.type is not FrameType.DATA:
            break
        received += channel.recv_data_into(header, destination)[1]
        frames += 1
    end = channel.recv_message(header)
    if not isinstance(end, PutEnd):
        raise UnexpectedFrame(f"expected DATA or PUT_END, received {end.TYPE.name}")
    if (end.total_bytes, end.frames) != (received, frames) or received != total:
        raise MalformedFrame(f"PUT_END says {end.total_bytes} bytes in {end.frames} frames; "
                             f"received {received} in {frames}, expected {total}")
    return frames


def send_stream(channel: Channel, parts: tuple[memoryview, ...], chunk: int,
                tags: BlockTags | None = None, base: int = 0,
                max_frame: int | None = None) -> int:
    """Sends ``parts`` back to back as DATA frames of at most ``chunk`` bytes, then PUT_END.

    Args:
        chunk: the most snapshot bytes one frame carries; at most the peer's largest DATA
            payload less a one-block run's prefix (:func:`frame_chunk`).
        tags: block tags made at seal time (the receiver was given their salt): pieces that
            are exactly one tagged block each go pretagged, consecutive ones in runs of up to
            ``chunk`` bytes; any other piece is tagged here.
        base: the snapshot offset of the first byte (a ranged fetch); PUT_END counts the
            bytes sent.
        max_frame: the peer's largest DATA payload (a run's prefix counts; default: room for
            the longest run's prefix beside ``chunk``).

    Returns:
        The frame count.
    """
    spans, offset = [], base
    for part in parts:
        spans.append((offset, part))
        offset += len(part)
    return send_spans(channel, spans, chunk, tags, max_frame)


def send_spans(channel: Channel, spans: Sequence[tuple[int, memoryview]], chunk: int,
               tags: BlockTags | None = None, max_frame: int | None = None) -> int:
    """:func:`send_stream` of ``spans``, ``(snapshot offset, bytes)`` each, in order: apart
    (a fetch of several ranges) or back to back (a push's header and payload). No frame spans
    two; a run of blocks continues into the next span only where it starts where the last
    ended (send_runs' consecutiveness check)."""
    pieces, sent = [], 0
    starts = sorted(tags.tags) if tags is not None else []
    for offset, part in spans:
        i = 0
        while i < len(part):
            # A tagged block that fits a frame goes as one piece (pretagged); other bytes are
            # cut at the next block's start, so that it lines up.
            n = min(chunk, len(part) - i)
            tagged = tags.tags.get(offset) if tags is not None else None
            if tagged is not None and tagged[0] <= n:
                n = tagged[0]
            elif starts:
                after = bisect.bisect_right(starts, offset)
                if after < len(starts):
                    n = min(n, starts[after] - offset)
            pieces.append((offset, part[i : i + n]))
            i += n
            offset += n
            sent += n
    frames = len(pieces)
    if tags is not None and channel.send_key is not None:
        limit = chunk + MAX_RUN_PREFIX if max_frame is None else max_frame
        frames = send_runs(channel, pieces, tags, chunk, limit)
    else:
        for at, piece in pieces:
            channel.send_data(at, piece)
    channel.send(PutEnd(sent, frames))
    return frames


def frame_chunk(chunk_size: int, peer_max_frame: int) -> int:
    """The most snapshot bytes a DATA frame to a peer accepting ``peer_max_frame`` payload
    bytes carries: ``chunk_size``, less what a one-block run's prefix needs beside it."""
    return min(chunk_size, peer_max_frame - RUN.size - RUN_ENTRY.size)


#: Bytes asked for each replication socket's send and receive buffers (the kernel doubles the
#: figure and caps it at ``net.core.wmem_max`` / ``rmem_max``): with a frame's worth of room
#: fixed from the start the sender keeps writing while the receiver checks the tags (why, and
#: the figures: docs/replication.md, "Authenticated throughput"). Setting the size turns
#: off receive autotuning for the socket; 4 MiB (8 MiB granted) covers the bandwidth-delay
#: product of a 100 Gbit/s link at 0.6 ms round trip, and the kernel commits buffer memory only
#: as data waits in it.
SOCKET_BUFFER_BYTES = 4 << 20


def tune(sock: socket.socket) -> None:
    """Sets a replication socket's options: no Nagle delay, and :data:`SOCKET_BUFFER_BYTES`."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


#: Seconds between two re-armings of a socket's timeout under a deadline (Channel._arm):
#: what a wait may overrun the deadline by.
ARM_SLACK = 0.05
