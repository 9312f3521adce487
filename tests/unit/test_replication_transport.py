"""Replica transport over real loopback sockets: push, fetch, authentication, failures."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest

from tests.waiting import wait_for
from elasticd.replication import auth
from elasticd.replication.api import (
    EXISTS,
    NO_SPACE,
    NOT_FOUND,
    STALE,
    ConnectionLost,
    Descriptor,
    Refused,
    RemoteError,
)
from elasticd.replication.auth import AuthenticationFailed, client_handshake
from elasticd.replication.channel import Channel
from elasticd.testing.replication import MemorySink
from elasticd.replication.messages import (
    Ack,
    Auth,
    Challenge,
    Error,
    Hello,
    PutBegin,
    PutEnd,
    data_prefix,
)
from elasticd.replication.seal import FrameKey
from elasticd.replication.wire import ProtocolError
from elasticd.replication.transport import ReplicaClient, ReplicaServer

SECRET = b"cluster-secret-0123456789abcdef"
JOB = "job-1"
MiB = 1 << 20


def snapshot(step: int, size: int = 3 * MiB + 123, generation: int = 0, rank: int = 0):
    header = f'{{"step": {step}, "rank": {rank}}}'.encode().ljust(64, b" ")
    payload = bytes((i * 31 + step) % 251 for i in range(251)) * (size // 251 + 1)
    payload = payload[:size]
    return Descriptor(JOB, rank, generation, step, len(header) + len(payload), len(header)), \
        header, payload



@pytest.fixture
def make_server():
    servers: list[ReplicaServer] = []

    def make(sink=None, secret=SECRET, node_id="node-b", **kw) -> ReplicaServer:
        kw.setdefault("idle_timeout", 10.0)
        server = ReplicaServer("127.0.0.1", 0, secret, node_id, sink or MemorySink(), **kw)
        servers.append(server.start())
        return server

    yield make
    for server in servers:
        server.stop()
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("replica-")]
    assert not leftover, leftover


@pytest.fixture
def clients():
    opened: list[ReplicaClient] = []

    def connect(server: ReplicaServer, secret=SECRET, node_id="node-a", **kw) -> ReplicaClient:
        client = ReplicaClient.connect(*server.address, secret, node_id, timeout=10.0, **kw)
        opened.append(client)
        return client

    yield connect
    for client in opened:
        client.close()


def test_push_arrives_intact_and_is_committed(make_server, clients):
    sink = MemorySink()
    server = make_server(sink)
    client = clients(server, expected_peer="node-b")
    d, header, payload = snapshot(step=7)
    client.push(d, header, memoryview(payload), chunk_size=MiB)
    assert sink.get(JOB, 0) == header + payload
    assert [e[0] for e in sink.events] == ["begin", "landed"]
    assert server.stats.pushes_committed == 1 and client.peer_id == "node-b"


def test_the_server_remembers_when_it_last_heard_each_peer():
    """A failed peer's last sign of life, for its recovery's timeline: the last message or
    whole push an authenticated peer sent, never a push that broke off."""
    from elasticd.testing.clock import FakeClock

    clock = FakeClock(wall_offset=5_000.0)
    server = ReplicaServer("127.0.0.1", 0, SECRET, "node-b", MemorySink(), idle_timeout=10.0,
                           clock=clock).start()
    try:
        assert server.last_heard("node-a") is None
        client = ReplicaClient.connect(*server.address, SECRET, "node-a", timeout=10.0)
        d, header, payload = snapshot(step=7)
        client.push(d, header, memoryview(payload), chunk_size=MiB)
        heard = server.last_heard("node-a")
        assert heard == clock.wall()
        clock.advance(3.0)
        d, header, payload = snapshot(step=8, size=2 * MiB)
        client.channel.send(PutBegin(d))  # a message: heard now
        client.channel.recv(Ack)
        wait_for(lambda: server.last_heard("node-a") == heard + 3.0)
        clock.advance(3.0)
        client.channel.sock.close()  # ... but a push that broke off is no later sign
        wait_for(lambda: server.stats.pushes_aborted == 1)
        assert server.last_heard("node-a") == heard + 3.0 and server.last_heard("x") is None
        client.close()
    finally:
        server.stop()


def test_fetch_returns_the_committed_bytes(make_server, clients):
    server = make_server()
    client = clients(server)
    d, header, payload = snapshot(step=3, size=2 * MiB)
    client.push(d, header, payload)
    into = bytearray(d.total_bytes + 10)
    assert client.fetch(JOB, 0, into) == d
    assert bytes(into[: d.total_bytes]) == header + payload
    got = client.fetch(JOB, 0, lambda desc: bytearray(desc.total_bytes), version=(0, 3))
    assert got == d
    with pytest.raises(Refused) as missing:
        client.fetch(JOB, 0, bytearray(10), version=(0, 2))
    assert missing.value.reason == NOT_FOUND
    with pytest.raises(Refused):
        client.fetch("other-job", 0, bytearray(10))
    assert client.fetch(JOB, 0, into) == d  # a NACK leaves the connection usable


def test_fetch_into_a_small_buffer_fails_cleanly(make_server, clients):
    server = make_server()
    client = clients(server)
    d, header, payload = snapshot(step=1, size=1000)
    client.push(d, header, payload)
    with pytest.raises(Exception, match="cannot take"):
        client.fetch(JOB, 0, bytearray(100))
    with pytest.raises(ConnectionLost, match="unusable"):
        client.push(*snapshot(step=2, size=10))


def test_stale_and_duplicate_versions_are_refused(make_server, clients):
    sink = MemorySink()
    server = make_server(sink)
    client = clients(server)
    client.push(*snapshot(step=5))
    for step, generation, reason in ((3, 0, STALE), (5, 0, EXISTS)):
        with pytest.raises(Refused) as refused:
            client.push(*snapshot(step=step, generation=generation))
        assert refused.value.reason == reason
    client.push(*snapshot(step=0, generation=1))  # a new timeline wins over a higher step
    with pytest.raises(Refused, match="stale"):
        client.push(*snapshot(step=9, generation=0))
    assert sink.held(JOB, 0).version == (1, 0)
    assert server.stats.pushes_refused == 3 and server.stats.pushes_committed == 2


def test_late_older_transfer_cannot_replace_a_newer_commit():
    sink = MemorySink()
    older, newer = snapshot(step=4)[0], snapshot(step=5)[0]
    sink.begin(older)
    sink.begin(newer)
    sink.landed(newer)
    with pytest.raises(Refused) as refused:
        sink.landed(older)
    assert refused.value.reason == STALE
    assert sink.held(JOB, 0) == newer and not sink._in_flight
    assert ("abort", older, STALE) in sink.events


def test_memory_budget_refuses_with_no_space(make_server, clients):
    server = make_server(MemorySink(capacity_bytes=MiB))
    client = clients(server)
    with pytest.raises(Refused) as refused:
        client.push(*snapshot(step=1, size=2 * MiB))
    assert refused.value.reason == NO_SPACE
    client.push(*snapshot(step=1, size=MiB // 2))


def test_wrong_secret_is_rejected_counted_and_stores_nothing(make_server, clients):
    seen = []
    sink = MemorySink()
    server = make_server(sink, auth_failures=lambda peer, why: seen.append(peer))
    with pytest.raises(AuthenticationFailed):
        clients(server, secret=b"not-the-cluster-secret!!")
    wait_for(lambda: len(seen) == 1)
    assert seen[0].startswith("127.0.0.1:")
    assert sink.events == []
    # The other direction: a server without the secret cannot pass itself off as a peer,
    # even one that accepts any proof (it cannot seal its ACK under the session key).
    with impostor_server() as address:
        with pytest.raises(AuthenticationFailed, match="did not prove"):
            ReplicaClient.connect(*address, SECRET, "node-a", timeout=10.0)


@contextlib.contextmanager
def impostor_server():
    """A server that answers HELLO, takes any AUTH and seals its ACK under a key of its own."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        sock, _ = listener.accept()
        with sock:
            channel = Channel(sock)
            channel.recv(Hello)
            channel.send(Challenge("node-b", os.urandom(32), 8 << 20))
            channel.recv(Auth)
            channel.send_key = FrameKey(os.urandom(32))
            channel.send(Ack({"node_id": "node-b"}))
            sock.settimeout(5)
            sock.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[:2]
    finally:
        thread.join(10)
        listener.close()


def test_expected_peer_is_checked(make_server, clients):
    server = make_server(node_id="node-c")
    with pytest.raises(AuthenticationFailed, match="expected 'node-b'"):
        clients(server, expected_peer="node-b")


class Recorder:
    """A socket wrapper that keeps a copy of every byte sent."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent = bytearray()

    def sendall(self, data) -> None:
        self.sent += data
        self.sock.sendall(data)

    def recv_into(self, view, nbytes: int = 0) -> int:
        return self.sock.recv_into(view)

    def gettimeout(self):
        return self.sock.gettimeout()

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()


def record_a_push(server: ReplicaServer) -> bytes:
    sock = socket.create_connection(server.address, timeout=10)
    recorder = Recorder(sock)
    channel = Channel(recorder)
    challenge = client_handshake(channel, SECRET, "node-a")
    client = ReplicaClient(channel, challenge.node_id, challenge.max_frame, clock=None)
    client.push(*snapshot(step=1, size=1000))
    client.close()
    return bytes(recorder.sent)


def replay(server: ReplicaServer, recorded: bytes) -> bytes:
    with socket.create_connection(server.address, timeout=10) as sock:
        sock.sendall(recorded)
        sock.shutdown(socket.SHUT_WR)  # like the recorded client: done after its push
        replies = bytearray()
        while chunk := sock.recv(65536):
            replies += chunk
    return bytes(replies)


def test_replayed_handshake_is_rejected(make_server):
    recorded = record_a_push(make_server())
    sink, seen = MemorySink(), []
    target = make_server(sink, auth_failures=lambda *failure: seen.append(failure))
    replies = replay(target, recorded)  # same node id and secret, fresh memory
    assert b'"code":"auth"' in replies
    wait_for(lambda: len(seen) == 1)
    assert sink.events == [] and target.stats.pushes_committed == 0


def test_replay_test_detects_reused_nonces(make_server, monkeypatch):
    # Proof that the test above can fail: were the server's nonce not fresh, the replay would
    # be accepted and stored.
    def server_nonce_reused() -> bytes:
        if threading.current_thread().name.startswith("replica-conn"):
            return b"\1" * 32
        return os.urandom(32)

    monkeypatch.setattr(auth, "new_nonce", server_nonce_reused)
    recorded = record_a_push(make_server())
    sink = MemorySink()
    replay(make_server(sink), recorded)
    assert [e[0] for e in sink.events] == ["begin", "landed"]


def open_push(server: ReplicaServer, d: Descriptor) -> ReplicaClient:
    client = ReplicaClient.connect(*server.address, SECRET, "node-a", timeout=10)
    client.channel.send(PutBegin(d))
    assert isinstance(client.channel.recv(Ack), Ack)
    return client


@pytest.mark.parametrize("cut", ["between_frames", "mid_frame"])
def test_truncated_stream_aborts_and_never_commits(make_server, cut):
    sink = MemorySink()
    server = make_server(sink)
    d, header, payload = snapshot(step=2, size=2 * MiB)
    client = open_push(server, d)
    client.channel.send_data(0, memoryview(header))
    chunk = memoryview(payload)[:MiB]
    if cut == "between_frames":
        client.channel.send_data(len(header), chunk)
    else:
        client.channel.sock.sendall(data_prefix(len(header), chunk) + bytes(chunk[: MiB // 2]))
    client.channel.sock.close()  # the connection drops mid-transfer
    wait_for(lambda: any(e[0] == "abort" for e in sink.events))
    assert [e[0] for e in sink.events] == ["begin", "abort"]
    assert sink.get(JOB, 0) is None and not sink._in_flight
    assert server.stats.pushes_aborted == 1


def test_corrupt_chunk_aborts_with_an_error(make_server):
    sink = MemorySink()
    server = make_server(sink)
    d, header, payload = snapshot(step=2, size=1000)
    client = open_push(server, d)
    channel = client.channel
    corrupt = bytearray(header)
    prefix = data_prefix(0, corrupt, channel.send_key)
    corrupt[0] ^= 1  # flipped after the tag was computed: corrupted in transit
    channel.sock.sendall(prefix + corrupt)
    channel.send_data(len(header), memoryview(payload))
    channel.send(PutEnd(d.total_bytes, 2))
    reply = channel.recv(Error)
    assert isinstance(reply, Error) and reply.code == "protocol" and "tag" in reply.message
    wait_for(lambda: [e[0] for e in sink.events] == ["begin", "abort"])
    wait_for(lambda: server.snapshot_stats().protocol_errors == 1)
    client.close()


def test_short_stream_is_not_committed(make_server):
    sink = MemorySink()
    server = make_server(sink)
    d, header, payload = snapshot(step=2, size=1000)
    client = open_push(server, d)
    client.channel.send_data(0, memoryview(header))
    client.channel.send(PutEnd(len(header), 1))  # claims to be done, 1000 bytes short
    with pytest.raises(RemoteError, match="PUT_END says"):
        client.channel.recv(Ack)
    assert [e[0] for e in sink.events] == ["begin", "abort"]
    client.close()


def test_idle_connection_is_closed(make_server, clients):
    server = make_server(idle_timeout=0.3)
    client = clients(server)
    client.channel.sock.settimeout(5)
    started = time.monotonic()
    assert client.channel.sock.recv(1) == b""  # the server hung up
    assert 0.25 < time.monotonic() - started < 4


def test_connections_over_the_limit_are_refused(make_server, clients):
    server = make_server(max_connections=1)
    first = clients(server)
    with pytest.raises(RemoteError, match="busy"):
        clients(server)
    first.push(*snapshot(step=1, size=100))


def test_stop_aborts_a_transfer_in_progress(make_server):
    sink = MemorySink()
    server = make_server(sink)
    d, header, _ = snapshot(step=1, size=MiB)
    client = open_push(server, d)
    client.channel.send_data(0, memoryview(header))
    server.stop()
    assert [e[0] for e in sink.events] == ["begin", "abort"]
    client.close()


@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    d = tmp_path_factory.mktemp("tls")
    cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.load_verify_locations(cert)
    return server_ctx, client_ctx


def test_push_and_fetch_over_tls(make_server, clients, tls_contexts):
    server_ctx, client_ctx = tls_contexts
    sink, seen = MemorySink(), []
    server = make_server(sink, ssl_context=server_ctx,
                         auth_failures=lambda *failure: seen.append(failure))
    client = clients(server, ssl_context=client_ctx)
    d, header, payload = snapshot(step=4, size=MiB + 5)
    client.push(d, header, payload, chunk_size=256 << 10)
    into = bytearray(d.total_bytes)
    client.fetch(JOB, 0, into)
    assert sink.get(JOB, 0) == bytes(into) == header + payload
    with pytest.raises((ConnectionLost, ProtocolError)):
        clients(server)  # plain TCP to a TLS server
    wait_for(lambda: len(seen) == 1)


def test_replication_does_not_import_torch():
    code = ("import sys, elasticd.replication.transport, elasticd.replication.placement, "
            "elasticd.testing.replication; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_close_does_not_wait_for_a_call_stuck_on_a_silent_peer():
    # A frozen peer keeps its socket open and never answers: a push waiting for its ack held
    # the client's lock, and dropping the connection (the peer was declared dead) waited for
    # the whole timeout. close() shuts the socket down first, which ends that wait.
    from elasticd.replication.channel import Channel
    from elasticd.replication.transport import ConnectionLost, ReplicaClient

    mine, silent = socket.socketpair()
    client = ReplicaClient(Channel(mine), "n3", 1 << 20)
    errors: list[BaseException] = []

    def waiting_for_an_ack():
        try:
            client._call(lambda: client._reply(Ack))
        except BaseException as exc:  # noqa: BLE001 — recorded for the assertion
            errors.append(exc)

    t = threading.Thread(target=waiting_for_an_ack)
    t.start()
    time.sleep(0.2)  # the call is now blocked in recv
    started = time.monotonic()
    client.close()
    t.join(5)
    silent.close()
    assert not t.is_alive()
    assert time.monotonic() - started < 2.0
    assert errors and isinstance(errors[0], ConnectionLost), errors


def _granted(size: int, limit_file: str) -> int:
    """What the kernel grants a socket asking for ``size`` buffer bytes: doubled, within the cap."""
    with open(limit_file) as f:
        return 2 * min(size, int(f.read()))


def test_both_ends_get_the_replication_socket_options(make_server, clients):
    # The buffers let the sender run a frame ahead while the receiver checks tags (channel.py,
    # SOCKET_BUFFER_BYTES); the kernel's defaults (16 KiB to send) stall the pair.
    from elasticd.replication.channel import SOCKET_BUFFER_BYTES

    server = make_server()
    client = clients(server)
    wait_for(lambda: any(s is not None for s in server._connections.sockets().values()))
    ends = [client.channel.sock] + [s for s in server._connections.sockets().values() if s is not None]
    send = _granted(SOCKET_BUFFER_BYTES, "/proc/sys/net/core/wmem_max")
    receive = _granted(SOCKET_BUFFER_BYTES, "/proc/sys/net/core/rmem_max")
    for sock in ends:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == send
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == receive
