"""Ranged fetches over real loopback sockets: a client asks a holder for part of a snapshot
(the striped restore asks each holder for different ranges), receives it at its snapshot
offsets, and is refused a range outside the snapshot; a forged frame is still refused."""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import pytest

from elasticd.replication.api import BAD_RANGE, Descriptor, Refused
from elasticd.testing.replication import MemorySink
from elasticd.replication.messages import Fetch, encode_frame
from elasticd.testing.replication import decode_frame
from elasticd.replication.transport import ReplicaClient, ReplicaServer
from elasticd.replication.wire import MalformedFrame
from tests.unit.test_replication_attacks import RewritingRelay

SECRET = b"cluster-secret-0123456789abcdef"
JOB = "job-r"
MiB = 1 << 20


def snapshot(step: int = 5, size: int = 3 * MiB + 77):
    header = b'{"range": true}'.ljust(64, b" ")
    payload = bytes((i * 7 + 3) % 253 for i in range(253)) * (size // 253 + 1)
    payload = payload[:size]
    return Descriptor(JOB, 0, 0, step, len(header) + len(payload), len(header)), header + payload


@contextlib.contextmanager
def holder(chunk_size: int = MiB):
    srv = ReplicaServer("127.0.0.1", 0, SECRET, "node-b", MemorySink(), idle_timeout=10.0,
                        chunk_size=chunk_size).start()
    d, whole = snapshot()
    try:
        with ReplicaClient.connect(*srv.address, SECRET, "node-p", timeout=10.0) as pusher:
            pusher.push(d, whole[: d.header_bytes], whole[d.header_bytes:])
        yield srv, d, whole
    finally:
        srv.stop()


def test_fetch_frame_keeps_the_old_form_without_a_range_and_validates_one():
    whole = Fetch(JOB, 0, 1, 2)
    assert b"offset" not in whole.payload()  # what a v4 peer without ranges sends and reads
    assert decode_frame(encode_frame(whole)) == whole
    ranged = Fetch(JOB, 0, None, None, 10, 20)
    assert decode_frame(encode_frame(ranged)) == ranged
    for bad in ({"offset": 3}, {"offset": -1, "length": 2}, {"offset": 1, "length": True},
                {"offset": "0", "length": 4}):
        payload = json.dumps({"job": JOB, "owner_rank": 0, **bad}).encode()
        with pytest.raises(MalformedFrame, match="offset and length"):
            Fetch.parse(memoryview(payload))
    assert Fetch(JOB, 0, None, None, 5, 10).byte_range(100) == (5, 15)
    assert Fetch(JOB, 0).byte_range(100) == (0, 100)
    with pytest.raises(ValueError, match="outside the snapshot of 100 bytes"):
        Fetch(JOB, 0, None, None, 95, 10).byte_range(100)


def test_ranges_land_at_their_snapshot_offsets_and_nothing_else_is_written():
    with holder() as (srv, d, whole), \
            ReplicaClient.connect(*srv.address, SECRET, "node-a", timeout=10.0) as client:
        served, read = [], srv.sink.read
        srv.sink.read = lambda *a: served.append(a) or read(*a)
        into = bytearray(b"\xee" * d.total_bytes)
        # Across a chunk boundary, unaligned, from the header into the payload.
        start, length = MiB - 100, MiB + 333
        assert client.fetch(JOB, 0, into, (0, 5), byte_range=(start, length)) == d
        assert into[start : start + length] == whole[start : start + length]
        assert into[:start] == b"\xee" * start
        assert into[start + length :] == b"\xee" * (d.total_bytes - start - length)
        # The rest, in two more ranges (the last one up to the very end), makes the whole.
        client.fetch(JOB, 0, into, (0, 5), byte_range=(0, start))
        client.fetch(JOB, 0, into, (0, 5), byte_range=(start + length,
                                                       d.total_bytes - start - length))
        assert bytes(into) == whole
        # A zero length reads the descriptor alone; the whole-snapshot form still works.
        sized: list[Descriptor] = []
        assert client.fetch(JOB, 0, lambda x: sized.append(x) or bytearray(x.total_bytes),
                            byte_range=(0, 0)) == d
        assert sized == [d]
        again = bytearray(d.total_bytes)
        assert client.fetch(JOB, 0, again) == d and bytes(again) == whole
        assert len(served) == 5  # each range, the descriptor alone, the whole: one read each


def test_a_range_outside_the_snapshot_is_refused_clearly_and_the_connection_stays_usable():
    with holder() as (srv, d, whole), \
            ReplicaClient.connect(*srv.address, SECRET, "node-a", timeout=10.0) as client:
        into = bytearray(d.total_bytes)
        for bad in ((d.total_bytes - 10, 11), (d.total_bytes + 1, 0), (0, d.total_bytes + 1)):
            with pytest.raises(Refused) as refused:
                client.fetch(JOB, 0, into, byte_range=bad)
            assert refused.value.reason == BAD_RANGE
            assert f"outside the snapshot of {d.total_bytes} bytes" in str(refused.value)
        assert into == bytearray(d.total_bytes)  # nothing was written
        with pytest.raises(ValueError, match=">= 0"):
            client.fetch(JOB, 0, into, byte_range=(-1, 5))
        client.fetch(JOB, 0, into, byte_range=(10, 20))
        assert into[10:30] == whole[10:30]


class FetchRewritingRelay(RewritingRelay):
    """Rewrites the ``nth`` DATA frame flowing server → client (a fetch's), recomputing the
    checksum as an attacker who knows the wire format would."""

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)
        self.socks += [client, upstream]
        for fn, args in ((self._pipe, (client, upstream)),
                         (self._client_to_server, (upstream, client))):
            t = threading.Thread(target=fn, args=args, daemon=True)
            t.start()
            self.threads.append(t)


def test_a_forged_frame_in_a_ranged_fetch_is_refused():
    with holder(chunk_size=256 << 10) as (srv, d, whole):
        relay = FetchRewritingRelay(srv.address, nth=2)
        try:
            client = ReplicaClient.connect(*relay.address, SECRET, "node-a", timeout=10.0)
            into = bytearray(d.total_bytes)
            with pytest.raises(Exception, match="authentication tag"):
                client.fetch(JOB, 0, into, byte_range=(1000, MiB))
            client.close()
        finally:
            relay.close()
        assert relay.rewritten == 1
