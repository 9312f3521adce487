"""Whole-call deadlines in the striped fetch, over real loopback sockets: a holder whose port
is black-holed mid-fetch (its connection stays open, nothing moves) costs about the deadline,
not the socket timeout; its piece goes to the other holders; and once the fault ends nothing
lands in the buffer and no fetch thread is left waiting."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from elasticd.clock import SystemClock
from elasticd.replication.api import DeadlineExceeded
from elasticd.replication.deadline import DeadlinePolicy, LinkRates
from elasticd.replication.lanes import Connections
from elasticd.testing.replication import MemorySink
from elasticd.replication.messages import Fetch
from elasticd.recovery.fetch import fetch_shard
from elasticd.replication.transport import ReplicaClient, ReplicaServer

from tests.unit.test_striped_fetch import JOB, SECRET, STRIPE, FailingSink, sealed_snapshot

SOCKET_TIMEOUT = 10.0  # what a frozen holder cost per receive before the deadline
POLICY = DeadlinePolicy(floor=1.0, slack=4.0, default_rate=50e6)


class BlackHole:
    """A TCP relay to ``target`` that stops forwarding both ways (keeping every connection
    open, like a black-holed port or a frozen process) once ``after`` bytes went from the
    server to the client (``upstream``: from the client to the server), until
    :meth:`release`."""

    def __init__(self, target: tuple[str, int], after: int, upstream: bool = False) -> None:
        self.target, self.after, self.forwarded, self.upstream = target, after, 0, upstream
        self.frozen, self.released, self.stopped = (threading.Event(), threading.Event(),
                                                    threading.Event())
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.address = self.listener.getsockname()
        self.socks: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                down, _ = self.listener.accept()
            except OSError:
                continue
            up = socket.create_connection(self.target)
            self.socks += [down, up]
            for a, b, count in ((down, up, self.upstream), (up, down, not self.upstream)):
                t = threading.Thread(target=self._pump, args=(a, b, count), daemon=True)
                self.threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        src.settimeout(0.1)
        while not self.stopped.is_set():
            if self.frozen.is_set() and not self.released.is_set():
                time.sleep(0.01)  # the hole: read nothing, send nothing
                continue
            try:
                data = src.recv(64 << 10)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            if count:
                room = self.after - self.forwarded
                if not self.frozen.is_set() and len(data) > room:
                    data = data[: max(room, 0)]
                    self.frozen.set()
                self.forwarded += len(data)
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.stopped.set()
        self.release()
        for t in self.threads:
            t.join(timeout=5)
        self.listener.close()
        for s in self.socks:
            s.close()


@pytest.fixture
def cluster():
    made: dict = {"servers": [], "pools": [], "holes": []}
    yield made
    for pool in made["pools"]:
        pool.close()
    for hole in made["holes"]:
        hole.close()
    for srv in made["servers"]:
        srv.stop()


def three_holders(cluster, hole_after: int):
    """Servers n0, n1, n2 holding one snapshot; n0 reached through a black hole."""
    d, buf = sealed_snapshot()
    book = {}
    for i in range(3):
        srv = ReplicaServer("127.0.0.1", 0, SECRET, f"n{i}", FailingSink(), idle_timeout=30.0,
                            chunk_size=32 << 10).start()
        cluster["servers"].append(srv)
        with ReplicaClient.connect(*srv.address, SECRET, "pusher", timeout=10.0) as c:
            c.push(d, buf[: d.header_bytes], buf[d.header_bytes :])
        book[f"n{i}"] = srv.address
    hole = BlackHole(book["n0"], after=hole_after)
    cluster["holes"].append(hole)
    book["n0"] = hole.address
    pool = Connections("me", SECRET, book.get, timeout=SOCKET_TIMEOUT)
    cluster["pools"].append(pool)
    return d, buf, hole, pool


def stripe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("elasticd-stripe-")]


def test_a_holder_black_holed_mid_fetch_costs_the_deadline_and_lands_nothing_after(cluster):
    # n0 describes the snapshot and sends its header, then goes silent in the middle of its
    # first piece: later than that, n1 and n2 could take every piece first on a loaded host
    # (seen: 2 runs in 10 beside two busy cores with 400 KiB), and nothing would freeze.
    d, buf, hole, pool = three_holders(cluster, hole_after=4096 + STRIPE // 2)
    assert d.header_bytes == 4096  # what hole_after counts on
    rates = LinkRates(POLICY)
    into = bytearray(8 << 20)
    started = time.monotonic()
    result = fetch_shard(JOB, 1, None, lambda _: into, me="me", holders=["me", "n0", "n1", "n2"],
                         connections=pool, own=(), clock=SystemClock(),
                         stripe_bytes=STRIPE, rates=rates)
    took = time.monotonic() - started
    assert hole.frozen.is_set()
    assert bytes(into[: d.total_bytes]) == bytes(buf)
    piece_deadline = rates.deadline("n0", STRIPE)
    assert took < piece_deadline + 1.5 < SOCKET_TIMEOUT, (took, piece_deadline)
    assert [h for h, _ in result.attempts] == ["n0"], result.attempts
    assert "deadline" in result.attempts[0][1] and result.attempts[0][1].startswith("unreachable")
    served = dict(result.served)
    assert served["n1"] and served["n2"] and sum(served.values()) == d.total_bytes
    assert not stripe_threads()
    # The fault ends: whatever n0 still sends must not land in the buffer the caller now owns.
    into[:] = b"\xee" * len(into)
    hole.release()
    time.sleep(0.5)
    assert into.count(b"\xee") == len(into)
    assert not stripe_threads()


def test_a_call_past_its_deadline_raises_and_closes_the_connection(cluster):
    d, _, hole, _ = three_holders(cluster, hole_after=200 << 10)
    client = ReplicaClient.connect(*hole.address, SECRET, "me", timeout=SOCKET_TIMEOUT)
    into = bytearray(d.total_bytes)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="deadline of 0.5 s"):
        client.fetch(JOB, 1, into, d.version, deadline=0.5)
    assert time.monotonic() - started < 2.0
    into[:] = b"\xee" * len(into)
    hole.release()
    time.sleep(0.3)
    assert into.count(b"\xee") == len(into)
    client.close()


def test_a_push_to_a_receiver_black_holed_mid_push_costs_the_deadline_and_commits_nothing():
    d, buf = sealed_snapshot()
    sink = MemorySink()
    srv = ReplicaServer("127.0.0.1", 0, SECRET, "n0", sink, idle_timeout=30.0).start()
    hole = BlackHole(srv.address, after=1 << 20, upstream=True)
    try:
        client = ReplicaClient.connect(*hole.address, SECRET, "me", timeout=SOCKET_TIMEOUT)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            client.push(d, buf[: d.header_bytes], buf[d.header_bytes :], deadline=1.0)
        assert time.monotonic() - started < 2.5
        client.close()
        hole.release()  # the fault ends: what the receiver got must not become a copy
        time.sleep(0.5)
        assert sink.read(JOB, 1) is None
    finally:
        hole.close()
        srv.stop()


def _wait(cond, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.02)
    return cond()


def test_the_server_lists_a_fetch_it_serves_until_the_peer_goes(cluster):
    # ~24 MiB: more than the two sockets' buffers hold, so a reader that reads nothing (a
    # frozen or black-holed peer) keeps the server's send blocked.
    d, buf = sealed_snapshot(n_floats=6_000_001)
    srv = ReplicaServer("127.0.0.1", 0, SECRET, "n0", MemorySink(), idle_timeout=30.0).start()
    cluster["servers"].append(srv)
    with ReplicaClient.connect(*srv.address, SECRET, "pusher", timeout=10.0) as c:
        c.push(d, buf[: d.header_bytes], buf[d.header_bytes :])
    assert srv.serving() == []
    reader = ReplicaClient.connect(*srv.address, SECRET, "n9", timeout=10.0)
    reader.channel.send(Fetch(JOB, 1, *d.version))  # and then reads nothing
    serving = _wait(srv.serving)
    assert [(s["peer"], s["job"], s["rank"], s["version"]) for s in serving] == [
        ("n9", JOB, 1, list(d.version))]
    time.sleep(0.3)
    assert srv.serving()[0]["seconds"] >= 0.3  # still there: its send is blocked
    reader.close()  # the peer goes (what a fetch past its deadline does): the send fails
    assert _wait(lambda: not srv.serving()), srv.serving()
