"""Hostile networks against the replica transport, over real loopback sockets.

Threat model (docs/security.md): anyone who reaches the replication port, and any relay on the
path, is hostile; peers holding the cluster secret are trusted. Each test plays one attacker:
a relay that rewrites a DATA frame and recomputes its checksum, a flood of connections that
never finish their handshake, and a caller without the secret fishing for a value to test
guesses against offline.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time

import pytest

from tests.waiting import wait_for
from elasticd.replication import auth
from elasticd.replication.api import Descriptor
from elasticd.replication.channel import Channel
from elasticd.testing.replication import MemorySink, decode_frame
from elasticd.replication.messages import Auth, Challenge, Error, Hello
from elasticd.replication.transport import ReplicaClient, ReplicaServer
from elasticd.replication.seal import BlockTagger
from elasticd.replication.wire import (
    CHECKED,
    FLAG_PRETAGGED,
    HEADER,
    HEADER_SIZE,
    RUN,
    RUN_ENTRY,
    BlockTagMismatch,
    FrameType,
    checksum,
)

SECRET = b"cluster-secret-0123456789abcdef"
MiB = 1 << 20



@contextlib.contextmanager
def server(sink=None, secret=SECRET, **kw):
    srv = ReplicaServer("127.0.0.1", 0, secret, "node-b", sink or MemorySink(),
                        idle_timeout=10.0, **kw).start()
    try:
        yield srv
    finally:
        srv.stop()


def read_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def blocks_start(payload: bytes | bytearray) -> int:
    """Where the blocks of a pretagged DATA payload (a run) start: after its prefix."""
    return RUN.size + RUN.unpack_from(payload)[1] * RUN_ENTRY.size


class RewritingRelay:
    """A TCP relay between client and server that parses frames client→server (server→client
    with ``downstream``: a fetch's DATA) and rewrites the first byte of the ``nth`` DATA
    payload, recomputing the frame's checksum the way an attacker who knows the wire format
    would; the other direction passes untouched. ``rewrite(seen, payload)``, when given,
    does the rewriting instead (returns whether it changed anything)."""

    def __init__(self, target: tuple[str, int], nth: int = 1, downstream: bool = False,
                 rewrite=None, repeat: int = 0) -> None:
        self.target, self.nth, self.downstream, self.rewrite = target, nth, downstream, rewrite
        self.repeat = repeat  # this DATA frame (1-based) is sent twice, as it came
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.rewritten = 0
        self.data_flags: list[int] = []  # of every DATA frame seen
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self.threads.append(accept)

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)
        self.socks += [client, upstream]
        parse, pipe = (upstream, client), (client, upstream)
        if not self.downstream:
            parse, pipe = pipe, parse
        for fn, args in ((self._client_to_server, parse), (self._pipe, pipe)):
            t = threading.Thread(target=fn, args=args, daemon=True)
            t.start()
            self.threads.append(t)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _client_to_server(self, src: socket.socket, dst: socket.socket) -> None:
        seen = 0
        with contextlib.suppress(OSError, EOFError):
            while True:
                head = read_exactly(src, HEADER_SIZE)
                magic, version, ftype, flags, length, check = HEADER.unpack(head)
                payload = bytearray(read_exactly(src, length))
                if ftype == FrameType.DATA:
                    seen += 1
                    self.data_flags.append(flags)
                    if self.rewrite is not None:
                        self.rewritten += bool(self.rewrite(seen, payload))
                    elif seen == self.nth:
                        # The first byte of the data: after the offset, and after the run's
                        # prefix in a pretagged frame (whose session tag covers only the
                        # prefix, so the relay need not even touch the check).
                        if flags & FLAG_PRETAGGED:
                            payload[blocks_start(payload)] ^= 0xFF
                        else:
                            payload[8] ^= 0xFF
                            check = checksum(head[: CHECKED.size], payload)
                        self.rewritten += 1
                frame = HEADER.pack(magic, version, ftype, flags, length, check) + payload
                if ftype == FrameType.DATA and seen == self.repeat:
                    dst.sendall(frame)
                    self.rewritten += 1
                dst.sendall(frame)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for t in self.threads:
            t.join(10)
        for sock in self.socks:
            sock.close()


def test_relay_rewriting_a_data_frame_is_refused_and_counted():
    sink = MemorySink()
    with server(sink) as srv:
        relay = RewritingRelay(srv.address, nth=2)
        try:
            client = ReplicaClient.connect(*relay.address, SECRET, "node-a", timeout=10.0)
            header = b"{}".ljust(64)
            payload = bytes(range(256)) * 4096  # 1 MiB
            d = Descriptor("job", 0, 0, 1, len(header) + len(payload), len(header))
            with pytest.raises(Exception) as refused:
                client.push(d, header, payload, chunk_size=256 << 10)
            client.close()
        finally:
            relay.close()
        assert relay.rewritten == 1
        assert "tag" in str(refused.value)  # the server said why before closing
        wait_for(lambda: srv.snapshot_stats().protocol_errors == 1)
        assert sink.get("job", 0) is None
        assert [e[0] for e in sink.events] == ["begin", "abort"]
        assert srv.snapshot_stats().pushes_committed == 0


def tagged_push(address, nth: int, tagger: BlockTagger = BlockTagger(SECRET)):
    """Pushes 1 MiB in 256 KiB blocks tagged as a seal would, through a relay rewriting the
    ``nth`` DATA frame (0: none). Returns (relay, the exception raised or None, payload)."""
    relay = RewritingRelay(address, nth=nth)
    header = b"{}".ljust(64)
    payload = bytes(range(256)) * 4096
    whole = header + payload
    blocks = [(a, min(a + (256 << 10), len(whole))) for a in range(64, len(whole), 256 << 10)]
    tags = tagger.tag(whole, blocks)
    d = Descriptor("job", 0, 0, 1, len(header) + len(payload), len(header))
    error = None
    try:
        client = ReplicaClient.connect(*relay.address, SECRET, "node-a", timeout=10.0)
        try:
            client.push(d, header, payload, chunk_size=256 << 10, tags=tags)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            error = exc
        client.close()
    finally:
        relay.close()
    return relay, error, payload


def test_pretagged_push_sends_blocks_with_their_seal_time_tags():
    sink = MemorySink()
    with server(sink) as srv:
        relay, error, payload = tagged_push(srv.address, nth=0)
    assert error is None
    # The header frame is tagged on the way, the four payload blocks go pretagged.
    assert [bool(f & FLAG_PRETAGGED) for f in relay.data_flags] == [False] + [True] * 4
    held = sink.get("job", 0)
    assert held is not None and held[64:] == payload


def test_relay_rewriting_a_pretagged_data_frame_is_refused_and_counted():
    sink = MemorySink()
    with server(sink) as srv:
        relay, error, _ = tagged_push(srv.address, nth=3)
        assert relay.rewritten == 1
        assert error is not None and "block tag" in str(error)
        wait_for(lambda: srv.snapshot_stats().protocol_errors == 1)
        assert sink.get("job", 0) is None
        assert srv.snapshot_stats().pushes_committed == 0


def test_block_tags_made_without_the_cluster_secret_are_refused():
    sink = MemorySink()
    with server(sink) as srv:
        _, error, _ = tagged_push(srv.address, nth=0,
                                  tagger=BlockTagger(b"another-secret-0123456789abcdef"))
        assert error is not None and "block tag" in str(error)
        wait_for(lambda: srv.snapshot_stats().protocol_errors == 1)
        assert sink.get("job", 0) is None


BLOCK = 256 << 10


def sealed_push(address, step: int = 1, fill: int = 0) -> tuple[bytes, bytes]:
    """Pushes 1 MiB of payload in 256 KiB blocks tagged as a seal would (directly, no relay);
    returns (header, payload)."""
    header = b"{}".ljust(64)
    payload = random.Random(fill).randbytes(1 << 20)  # no two blocks alike
    whole = header + payload
    blocks = [(a, min(a + BLOCK, len(whole))) for a in range(64, len(whole), BLOCK)]
    d = Descriptor("job", 0, 0, step, len(header) + len(payload), len(header))
    with ReplicaClient.connect(*address, SECRET, "node-a", timeout=10.0) as client:
        client.push(d, header, payload, chunk_size=BLOCK, tags=BlockTagger(SECRET).tag(
            whole, blocks))
    return header, payload


def relayed_fetch(address, step: int = 1, into=None, **relay_kw):
    """Fetches rank 0 of "job" at ``step`` through a relay rewriting what the holder sends,
    into ``into`` (default: a fresh 2 MiB buffer).
    Returns (relay, the buffer, the exception raised or None, the client's channel)."""
    relay = RewritingRelay(address, downstream=True, **relay_kw)
    into, error = (bytearray(2 << 20) if into is None else into), None
    try:
        client = ReplicaClient.connect(*relay.address, SECRET, "node-c", timeout=10.0)
        try:
            client.fetch("job", 0, into, version=(0, step))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            error = exc
        client.close()
    finally:
        relay.close()
    return relay, into, error, client.channel


def test_a_fetch_of_a_pretagged_copy_is_served_with_its_owners_block_tags():
    """A push's block tags stay with the copy: the holder serves every block of it pretagged,
    without reading it, and the fetcher checks the blocks against those tags alone."""
    with server(MemorySink(), chunk_size=BLOCK) as srv:
        header, payload = sealed_push(srv.address)
        relay, into, error, channel = relayed_fetch(srv.address, nth=0)
    assert error is None
    assert [bool(f & FLAG_PRETAGGED) for f in relay.data_flags] == [False] + [True] * 4
    assert bytes(into[: 64 + len(payload)]) == header + payload
    assert channel.tag_checked_bytes == len(payload)


def test_a_relay_rewriting_a_fetched_block_fails_its_block_tag():
    with server(MemorySink(), chunk_size=BLOCK) as srv:
        sealed_push(srv.address)
        relay, _, error, _ = relayed_fetch(srv.address, nth=3)
    assert relay.rewritten == 1
    assert isinstance(error, BlockTagMismatch), error


def test_a_relay_moving_a_fetched_block_to_another_offset_fails_its_block_tag():
    """The relay sends block 2's bytes in block 3's frame (same length; the frame's header,
    offset and block tag, which its session tag covers, left as they are)."""
    kept: dict[int, bytes] = {}

    def move(seen: int, payload: bytearray) -> bool:
        kept[seen] = bytes(payload[blocks_start(payload) :])
        if seen != 4:
            return False
        payload[blocks_start(payload) :] = kept[3]
        return True

    with server(MemorySink(), chunk_size=BLOCK) as srv:
        sealed_push(srv.address)
        relay, _, error, _ = relayed_fetch(srv.address, rewrite=move)
    assert relay.rewritten == 1
    assert isinstance(error, BlockTagMismatch), error


def test_a_relay_replaying_a_block_of_an_older_version_fails_its_block_tag():
    """Version 1 of the shard is fetched once through the relay, which keeps its blocks;
    when version 2 (another seal: another salt, another block key) is fetched, the relay
    sends version 1's block at the same offset in its place."""
    old: dict[int, bytes] = {}

    def keep(seen: int, payload: bytearray) -> bool:
        old[seen] = bytes(payload[blocks_start(payload) :])
        return False

    def replay(seen: int, payload: bytearray) -> bool:
        if seen != 3:
            return False
        payload[blocks_start(payload) :] = old[3]
        return True

    with server(MemorySink(), chunk_size=BLOCK) as srv:
        sealed_push(srv.address, step=1)
        _, _, error, _ = relayed_fetch(srv.address, step=1, rewrite=keep)
        assert error is None and len(old) == 5
        sealed_push(srv.address, step=2, fill=7)
        relay, _, error, _ = relayed_fetch(srv.address, step=2, rewrite=replay)
    assert relay.rewritten == 1
    assert isinstance(error, BlockTagMismatch), error


def attack(srv: ReplicaServer) -> socket.socket:
    return socket.create_connection(srv.address, timeout=5, source_address=("127.0.0.2", 0))


def test_slowloris_of_unauthenticated_connections_does_not_keep_a_peer_out():
    failures: list[tuple[str, str]] = []
    # The defaults (64 peers, 32 pending handshakes), a short handshake deadline.
    with server(handshake_timeout=1.5,
                auth_failures=lambda *failure: failures.append(failure)) as srv:
        stop = threading.Event()
        attackers: list[socket.socket] = []

        def trickle() -> None:
            # 70 connections from another address than the peer's, each sending one byte of
            # a HELLO header every 0.2 s (far within any per-receive timeout), reopened at once
            # whenever the server drops one.
            while not stop.is_set():
                for i, sock in enumerate(attackers):
                    try:
                        sock.send(b"E")
                    except OSError:
                        sock.close()
                        with contextlib.suppress(OSError):
                            attackers[i] = attack(srv)
                stop.wait(0.2)

        for _ in range(70):
            attackers.append(attack(srv))
        flood = threading.Thread(target=trickle, daemon=True)
        flood.start()
        try:
            # The peer connects in the middle of the flood, more than once, and gets in.
            for step in range(3):
                client = ReplicaClient.connect(*srv.address, SECRET, "node-a", timeout=10.0)
                d = Descriptor("job", 0, 0, step + 1, 12, 2)
                client.push(d, b"{}", b"0123456789")
                client.close()
        finally:
            stop.set()
            flood.join(10)
            for sock in attackers:
                sock.close()
        assert srv.snapshot_stats().pushes_committed == 3 and failures
    # One connection trickling a byte every 0.2 s (never idle for a whole receive timeout) is
    # cut at the deadline of the whole handshake: alone on its server, nothing displaces it.
    with server(handshake_timeout=1.5) as srv, attack(srv) as slow:
        cut = False
        deadline = time.monotonic() + 10
        while not cut and time.monotonic() < deadline:
            try:
                slow.send(b"E")
                time.sleep(0.2)  # the attacker's pace, not a wait for a condition
            except OSError:
                cut = True
        assert cut


def test_a_client_that_never_proves_learns_nothing_derived_from_the_secret(monkeypatch):
    # Same nonces, different secrets: were anything the server sends before the client's
    # proof derived from the secret, the two conversations would differ.
    monkeypatch.setattr(auth, "new_nonce", lambda: b"\x07" * 32)
    conversations = []
    for secret in (SECRET, b"another-secret-0123456789abcdef"):
        with server(secret=secret) as srv, socket.create_connection(srv.address, 5) as sock:
            sock.settimeout(5)
            channel = Channel(sock)
            channel.send(Hello("guesser", b"\x01" * 32, 8 << 20))
            head = read_exactly(sock, HEADER_SIZE)
            first = head + read_exactly(sock, HEADER.unpack(head)[4])
            assert isinstance(decode_frame(first), Challenge)
            channel.send(Auth(b"\0" * 32))  # a guess
            rest = bytearray()
            while chunk := sock.recv(4096):
                rest += chunk
            assert isinstance(decode_frame(rest), Error)
            conversations.append((first, bytes(rest)))
    assert conversations[0] == conversations[1]
