"""etcd's LeaseKeepAlive and Watch streams written by hand over HTTP/2, for the scale
simulator's keep-alive processes (``scale_native.py --keepalive-client raw``) and its daemons'
node watches (``--node-watch-client raw``, :class:`RawWatch`).

grpc.aio cost the keep-alive processes ~0.36-0.40 ms of CPU per refresh (32-36 % of a core for
the ~900 a second of N = 300): at N = 1,000 (3,000 a second) more than a core of the two this
machine has, for what a real node does 3 times a second. Here a refresh is its 16-byte gRPC
message appended to the one DATA frame that carries every refresh due at once, and an answer
is decoded in place (the message's ID and TTL varints): ~15-20 us per refresh, measured. etcd
receives the same LeaseKeepAlive messages on one stream per keep-alive process, in fewer
frames and writes than from many machines (the stream count is written beside the figures).

Only what this stream needs of HTTP/2: the preface, SETTINGS (a large window, so answers never
wait for a WINDOW_UPDATE), the request headers as HPACK literals, SETTINGS and PING
acknowledgements, the send windows etcd grants, and the end of the stream (trailers,
RST_STREAM, GOAWAY, a closed socket), after which the owner opens another.

The daemons' ``nodes/`` watches: at a cold start each of N daemons receives every later
registration, N²/2 watch responses (500,000 at N = 1,000, more when leases lapse and records
are rewritten). Through grpc.aio each cost the simulator process tens of microseconds (its
message objects and its asyncio hand-offs), which starved the simulated nodes' threads and
keep-alives; here the frames are cut out of whole reads and each response's top level walked
in place, its events counted by their tags (:func:`watch_responses`).

    python bench/h2_keepalive.py 127.0.0.1:2379 1000 4   # grant 1000 leases, keep them 4 s
"""
import asyncio
import struct
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST, SETTINGS, PING, GOAWAY, WINDOW = 0, 1, 3, 4, 6, 7, 8
BIG = 2 ** 31 - 1


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, kind, flags, stream) + payload


def varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def literal(value: bytes) -> bytes:
    assert len(value) < 127
    return bytes([len(value)]) + value


def request(lease: int) -> bytes:
    msg = b"\x08" + varint(lease)
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def answers(buf: bytes) -> tuple[list[tuple[int, int]], bytes]:
    """(ID, TTL) of each whole gRPC message in ``buf``; the rest."""
    out, i, n = [], 0, len(buf)
    while n - i >= 5:
        size = int.from_bytes(buf[i + 1:i + 5], "big")
        if n - i - 5 < size:
            break
        j, end, lid, ttl = i + 5, i + 5 + size, 0, 0
        while j < end:
            tag = buf[j]
            j += 1
            if tag == 0x0A:  # the response header: skipped
                ln = s = 0
                while True:
                    b = buf[j]; j += 1; ln |= (b & 0x7F) << s; s += 7
                    if b < 0x80:
                        break
                j += ln
                continue
            v = s = 0
            while True:
                b = buf[j]; j += 1; v |= (b & 0x7F) << s; s += 7
                if b < 0x80:
                    break
            if tag == 0x10:
                lid = v
            elif tag == 0x18:
                ttl = v
        out.append((lid, ttl))
        i = end
    return out, buf[i:]


class RawStream:
    """One connection, one bidirectional gRPC stream to ``path``; ``parse(buf)`` takes the
    received bytes and returns what is left of an incomplete message (it calls its owner for
    each whole one), ``on_broken()`` when the stream ends (then call :meth:`open` again)."""

    def __init__(self, host: str, port: int, path: bytes, parse, on_broken,
                 protocol: bool = False) -> None:
        self.host, self.port, self.path, self.parse = host, port, path, parse
        self.on_broken = on_broken
        self.protocol = protocol  # read by callback (_Protocol), not by a reader task
        self._buf = self._grpc = b""
        self.writer = None
        self.pending = bytearray()
        self.window = self.stream_window = 65535
        self.initial = 65535
        self.max_frame = 16384
        self.received = 0

    async def open(self) -> None:
        self._buf = self._grpc = b""
        if self.protocol:
            writer, _ = await asyncio.get_running_loop().create_connection(
                lambda: _Protocol(self), self.host, self.port)
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        self.window = self.stream_window = self.initial = 65535
        self.pending.clear()
        hdr = (b"\x83\x86" + b"\x04" + literal(self.path)
               + b"\x01" + literal(f"{self.host}:{self.port}".encode())
               + b"\x00" + literal(b"content-type") + literal(b"application/grpc")
               + b"\x00" + literal(b"te") + literal(b"trailers"))
        writer.write(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, BIG))
                     + frame(WINDOW, 0, 0, struct.pack(">I", BIG - 65535))
                     + frame(HEADERS, 0x4, 1, hdr))
        self.writer = writer
        if not self.protocol:
            asyncio.ensure_future(self._read(reader, writer))

    def send(self, data: bytes) -> None:
        """Queues gRPC messages (5-byte prefix included) and writes what the windows allow."""
        self.pending += data
        self._flush()

    def _flush(self) -> None:
        w = self.writer
        if w is None:
            return
        out = []
        while self.pending:
            n = min(len(self.pending), self.window, self.stream_window, self.max_frame)
            if n <= 0:
                break
            out.append(frame(DATA, 0, 1, bytes(self.pending[:n])))
            del self.pending[:n]
            self.window -= n
            self.stream_window -= n
        if out:
            w.write(b"".join(out))

    async def _read(self, reader, writer) -> None:
        try:
            while True:
                chunk = await reader.read(1 << 18)
                if not chunk or self._consume(chunk, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        self.writer = None
        writer.close()
        self.on_broken()

    def _consume(self, chunk: bytes, writer) -> bool:
        """Takes bytes received (``writer`` writes the answers HTTP/2 asks for); whether the
        stream ended.

        Whole reads of what has arrived, frames cut out of the buffer: a watch stream brings
        hundreds of thousands of small frames at a cold start, one await each cost more than
        the parsing."""
        buf = self._buf + chunk if self._buf else chunk
        i, n_buf, data, ended = 0, len(buf), [], False
        while n_buf - i >= 9:
            n = (buf[i] << 16) | (buf[i + 1] << 8) | buf[i + 2]
            if n_buf - i - 9 < n:
                break
            kind, flags = buf[i + 3], buf[i + 4]
            stream = int.from_bytes(buf[i + 5:i + 9], "big") & 0x7FFFFFFF
            payload = buf[i + 9:i + 9 + n]
            i += 9 + n
            if kind == DATA:
                if flags & 0x8:
                    payload = payload[1:len(payload) - payload[0]]
                self.received += n
                data.append(payload)
                if flags & 0x1:
                    ended = True
                    break
            elif kind == SETTINGS and not flags & 0x1:
                for k in range(0, len(payload), 6):
                    ident, value = struct.unpack(">HI", payload[k:k + 6])
                    if ident == 4:
                        self.stream_window += value - self.initial
                        self.initial = value
                    elif ident == 5:
                        self.max_frame = value
                writer.write(frame(SETTINGS, 0x1, 0))
                self._flush()
            elif kind == PING and not flags & 0x1:
                writer.write(frame(PING, 0x1, 0, payload))
            elif kind == WINDOW:
                inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
                if stream == 0:
                    self.window += inc
                else:
                    self.stream_window += inc
                self._flush()
            elif kind == HEADERS and flags & 0x1:  # trailers: the stream ended
                ended = True
                break
            elif kind in (RST, GOAWAY):
                ended = True
                break
        self._buf = buf[i:]
        if data:
            self._grpc = self.parse(self._grpc + b"".join(data) if self._grpc
                                    else b"".join(data))
        if self.received > 1 << 24:  # give the connection's and stream's window back
            writer.write(frame(WINDOW, 0, 0, struct.pack(">I", self.received))
                         + frame(WINDOW, 0, 1, struct.pack(">I", self.received)))
            self.received = 0
        return ended


class _Protocol(asyncio.Protocol):
    """A :class:`RawStream`'s connection read by callback (``RawStream(..., protocol=True)``):
    each read is parsed where it arrives, in the loop's own callback, with no reader, future
    or task woken for it (~2 of the 3 hand-offs a read costs through ``asyncio`` streams; a
    keep-alive process reads ~375 times a second at N = 1,000, one read per answer on a stream
    per node)."""

    def __init__(self, owner: "RawStream") -> None:
        self.owner, self.transport, self.done = owner, None, False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.owner._consume(data, self.transport):
            self.transport.close()  # connection_lost follows

    def connection_lost(self, exc) -> None:
        if not self.done:
            self.done = True
            self.owner.writer = None
            self.owner.on_broken()


class RawKeepAlive(RawStream):
    """One connection, one LeaseKeepAlive stream; ``on_answer(id, ttl)`` for each answer,
    ``on_broken()`` when the stream ends (then call :meth:`open` again)."""

    def __init__(self, host: str, port: int, on_answer, on_broken,
                 protocol: bool = False) -> None:
        def parse(buf: bytes) -> bytes:
            got, rest = answers(buf)
            for lid, ttl in got:
                on_answer(lid, ttl)
            return rest

        super().__init__(host, port, b"/etcdserverpb.Lease/LeaseKeepAlive", parse, on_broken,
                         protocol)


def grpc_message(msg: bytes) -> bytes:
    """A protobuf message as one gRPC message on the wire (uncompressed)."""
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def watch_responses(buf: bytes) -> tuple[list[tuple[int, bool, bool, int]], bytes]:
    """(watch_id, created, canceled, events) of each whole WatchResponse in ``buf``; the rest.

    Only the top level of each message is walked: the events (field 11) are counted by their
    tags and skipped, never decoded (a watcher's cost to etcd does not depend on it)."""
    out, i, n = [], 0, len(buf)
    while n - i >= 5:
        size = int.from_bytes(buf[i + 1:i + 5], "big")
        if n - i - 5 < size:
            break
        j, end = i + 5, i + 5 + size
        wid, created, canceled, events = 0, False, False, 0
        while j < end:
            tag = buf[j]
            j += 1
            v = s = 0
            while True:
                b = buf[j]; j += 1; v |= (b & 0x7F) << s; s += 7
                if b < 0x80:
                    break
            if tag & 7 == 2:  # length-delimited: the header, a reason, an event
                j += v
                if tag == 0x5A:
                    events += 1
            elif tag == 0x10:
                wid = v
            elif tag == 0x18:
                created = bool(v)
            elif tag == 0x20:
                canceled = bool(v)
        out.append((wid, created, canceled, events))
        i = end
    return out, buf[i:]


class RawWatch(RawStream):
    """One connection, one Watch stream carrying many watches, each with its own watch ID
    (etcd pays per watcher, not per stream); ``on_response(watch_id, created, canceled,
    events)`` for each response, its events counted, not decoded (:func:`watch_responses`).
    Create and cancel requests are etcd's own protobuf messages, sent as they are."""

    def __init__(self, host: str, port: int, on_response, on_broken) -> None:
        def parse(buf: bytes) -> bytes:
            got, rest = watch_responses(buf)
            for r in got:
                on_response(*r)
            return rest

        super().__init__(host, port, b"/etcdserverpb.Watch/Watch", parse, on_broken)


if __name__ == "__main__":  # a check against a running etcd: grant, keep alive, count
    import grpc
    from pyetcd import etcdrpc
    endpoint, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    host, port = endpoint.rsplit(":", 1)
    stub = etcdrpc.LeaseStub(grpc.insecure_channel(endpoint))
    leases = [stub.LeaseGrant(etcdrpc.LeaseGrantRequest(TTL=2)).ID for _ in range(count)]
    reqs = {x: request(x) for x in leases}
    got: dict[int, int] = {}

    async def main() -> None:
        ka = RawKeepAlive(host, int(port), lambda i, t: got.__setitem__(i, got.get(i, 0) + 1),
                          lambda: print("broken"))
        await ka.open()
        t0, c0 = time.monotonic(), time.process_time()
        while time.monotonic() - t0 < seconds:
            ka.send(b"".join(reqs[x] for x in leases))
            await asyncio.sleep(2 / 3)
        await asyncio.sleep(0.3)
        cpu = time.process_time() - c0
        total = sum(got.values())
        print(f"answers {total}, leases answered {len(got)}, cpu {cpu:.3f}s, "
              f"{cpu / max(total, 1) * 1e6:.1f} us per refresh")

    asyncio.run(main())
    alive = sum(stub.LeaseTimeToLive(etcdrpc.LeaseTimeToLiveRequest(ID=x)).TTL >= 0
                for x in leases)
    print("alive after", seconds, "s:", alive, "of", count)
