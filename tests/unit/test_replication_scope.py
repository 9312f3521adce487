"""Sessions scoped to one job, over real loopback sockets: the first layer of issue 30's design
(bench/results/restore40/README.md), in which a daemon opens a session to a holder for its job's
restore and may hand it to the job's worker. Whoever holds such a session (its keys and its
socket) is treated as that job's worker: it may fetch that job's copies and nothing else."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import pytest

from tests.unit.test_replication_attacks import RewritingRelay, read_exactly
from tests.waiting import wait_for
from elasticd.replication import auth
from elasticd.replication.api import ConnectionLost, Descriptor, RemoteError
from elasticd.replication.auth import AuthenticationFailed
from elasticd.replication.channel import Channel
from elasticd.replication.messages import Ack, Auth, Challenge, Hello
from elasticd.replication.report import Report
from elasticd.replication.seal import FrameKey, SessionKeys
from elasticd.replication.transport import ReplicaClient, ReplicaServer
from elasticd.replication.wire import (
    CHECKED,
    HEADER,
    HEADER_SIZE,
    FrameType,
    MalformedFrame,
    checksum,
)
from elasticd.testing.replication import MemorySink

SECRET = b"cluster-secret-0123456789abcdef"
MiB = 1 << 20


def snapshot(job: str, step: int = 1, size: int = MiB + 7) -> tuple[Descriptor, bytes, bytes]:
    header = f'{{"job": "{job}", "step": {step}}}'.encode().ljust(64, b" ")
    payload = bytes((i * 7 + step) % 251 for i in range(size))
    return Descriptor(job, 0, 0, step, len(header) + len(payload), len(header)), header, payload



@pytest.fixture
def holder():
    """A real ReplicaServer holding a copy of job-a's and of job-b's rank 0."""
    sink = MemorySink()
    server = ReplicaServer("127.0.0.1", 0, SECRET, "holder", sink, idle_timeout=10.0).start()
    with ReplicaClient.connect(*server.address, SECRET, "owner", timeout=10.0) as owner:
        for job in ("job-a", "job-b"):
            d, header, payload = snapshot(job)
            owner.push(d, header, memoryview(payload))
    try:
        yield server
    finally:
        server.stop()


def scoped(server: ReplicaServer, job: str = "job-a") -> ReplicaClient:
    return ReplicaClient.connect(*server.address, SECRET, "node-a", timeout=10.0, scope=job)


def test_a_scoped_session_fetches_its_jobs_copies(holder):
    d, header, payload = snapshot("job-a")
    with scoped(holder) as client:
        into = bytearray(d.total_bytes)
        assert client.fetch("job-a", 0, into) == d
        assert bytes(into) == header + payload
        part = bytearray(d.total_bytes)
        client.fetch("job-a", 0, part, version=(0, 1), byte_range=(d.header_bytes, 4096))
        assert part[d.header_bytes : d.header_bytes + 4096] == payload[:4096]
    assert holder.snapshot_stats().protocol_errors == 0
    # Whoever holds it may not be its node's daemon: it is no sign of that node's life.
    assert holder.last_heard("node-a") is None and holder.last_heard("owner") is not None


@pytest.mark.parametrize("attempt", ["fetch another job", "push", "report"])
def test_a_scoped_session_can_do_nothing_else_and_is_cut_off(holder, attempt):
    """Another job's copy is not sent (not even a NACK saying whether it exists), a push
    stores nothing, a report reaches no coordinator: each ends the connection with an ERROR,
    counted as a protocol error."""
    sink = holder.sink
    events = list(sink.events)
    with scoped(holder) as client:
        into = bytearray(4 * MiB)
        with pytest.raises(RemoteError, match="scoped to job 'job-a'") as refused:
            if attempt == "fetch another job":
                client.fetch("job-b", 0, into)
            elif attempt == "push":
                d, header, payload = snapshot("job-a", step=2)
                client.push(d, header, memoryview(payload))
            else:
                client.report(Report("job-a", "node-a", 1, "p", 1, 1, 0, 0, {}))
        assert refused.value.code == "protocol"
        assert not any(into)
        with pytest.raises(ConnectionLost, match="unusable"):  # the connection is gone
            client.fetch("job-a", 0, into)
    wait_for(lambda: holder.snapshot_stats().protocol_errors == 1)
    assert sink.events == events  # nothing began, landed or was dropped


def test_a_scope_changed_or_dropped_on_the_way_fails_the_handshake(holder):
    """The HELLO is in the transcript both proofs bind: a relay that rewrites its scope (to
    another job, or away) and fixes the frame's checksum makes the client's proof fail."""
    for to in ("job-b", None):
        failures = []
        holder.auth_failures = lambda peer, why: failures.append(why)
        relay = HelloRewriter(holder.address, to)
        try:
            with pytest.raises(AuthenticationFailed):
                ReplicaClient.connect(*relay.address, SECRET, "node-a", timeout=10.0,
                                      scope="job-a")
            assert relay.rewritten == 1
        finally:
            relay.close()
        wait_for(lambda: len(failures) == 1)
        assert "did not prove" in failures[0], failures


def test_a_server_that_does_not_confirm_the_scope_is_refused():
    """A server that proves the secret but does not say it keeps the scope (one that would
    parse the HELLO and drop it) gets no scoped session: nothing is fetched from it."""
    with unscoping_server() as address:
        with pytest.raises(AuthenticationFailed, match="did not confirm the session's scope"):
            ReplicaClient.connect(*address, SECRET, "node-a", timeout=10.0, scope="job-a")


def test_a_scope_is_a_job_name():
    with pytest.raises(ValueError, match="job name"):
        Hello("node-a", os.urandom(32), MiB, "../job").payload()
    raw = Hello("node-a", os.urandom(32), MiB, "job-a").payload()
    with pytest.raises(MalformedFrame, match="not a job name"):
        Hello.parse(memoryview(raw[:-5] + b"a/b/c"))
    with pytest.raises(MalformedFrame, match="scope length"):
        Hello.parse(memoryview(raw + b"x"))
    assert Hello.parse(memoryview(raw)).scope == "job-a"
    unscoped = Hello("node-a", os.urandom(32), MiB)
    assert Hello.parse(memoryview(unscoped.payload())) == unscoped  # as every version sends


# -- the attackers ------------------------------------------------------------------------------


class HelloRewriter(RewritingRelay):
    """A relay that replaces the client's HELLO by one with scope ``to`` (None: none), with a
    correct checksum, and passes everything else."""

    def __init__(self, target: tuple[str, int], to: str | None) -> None:
        self.to = to  # before the relay starts accepting
        super().__init__(target)

    def _client_to_server(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError, EOFError):
            head = read_exactly(src, HEADER_SIZE)
            magic, version, ftype, flags, length, _ = HEADER.unpack(head)
            assert ftype == FrameType.HELLO
            hello = Hello.parse(memoryview(read_exactly(src, length)))
            forged = Hello(hello.node_id, hello.nonce, hello.max_frame, self.to).payload()
            checked = CHECKED.pack(magic, version, ftype, flags, len(forged))
            dst.sendall(HEADER.pack(magic, version, ftype, flags, len(forged),
                                    checksum(checked, forged)) + forged)
            self.rewritten += 1
        self._pipe(src, dst)


@contextlib.contextmanager
def unscoping_server():
    """A server holding the secret that proves itself but acknowledges without the scope."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        sock, _ = listener.accept()
        with sock:
            channel = Channel(sock)
            hello = channel.recv(Hello)
            challenge = Challenge("node-b", auth.new_nonce(), 8 << 20)
            channel.send(challenge)
            channel.recv(Auth)
            seen = auth.transcript(hello, challenge)
            keys = SessionKeys(SECRET, hello.nonce, challenge.nonce, seen)
            channel.send_key = FrameKey(keys.server_to_client)
            channel.send(Ack({"node_id": "node-b"}))
            sock.settimeout(5)
            with contextlib.suppress(OSError):
                sock.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[:2]
    finally:
        thread.join(10)
        listener.close()
