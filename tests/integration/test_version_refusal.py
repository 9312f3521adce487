"""A running daemon refuses what it cannot read, says so clearly, and keeps nothing of it.

* A peer speaking another replication wire version connects to a real daemon's
  ReplicaServer: the daemon answers with an ERROR frame naming both versions, logs the
  rejection with the peer's address, counts it in
  ``elasticd_replication_connections_rejected_total{reason="version"}``, and stores nothing
  (not even the push the peer pipelined behind its HELLO).
* A record written to etcd with a newer schema: the daemon ignores it with a message naming
  the key and both schema versions, does not count it as a node, and keeps working;
  elasticctl shows it as unreadable with the same reason.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys

import pytest

from elasticd.coordination import records
from elasticd.launcher import LocalCluster
from elasticd.replication.api import Descriptor
from elasticd.replication.messages import (
    Challenge,
    Error,
    Hello,
    PutBegin,
    encode_frame,
)
from elasticd.replication.shm_sink import replica_root
from elasticd.testing.replication import decode_frame
from elasticd.replication.wire import CHECKED, HEADER_SIZE, VERSION, checksum

pytestmark = pytest.mark.etcd


def with_version(frame: bytes, version: int) -> bytes:
    """The same frame as another protocol version would send it (checksum recomputed, so
    only the version differs from a valid frame)."""
    magic, _, ftype, flags, length = CHECKED.unpack(frame[: CHECKED.size])
    checked = CHECKED.pack(magic, version, ftype, flags, length)
    payload = frame[HEADER_SIZE:]
    return checked + checksum(checked, payload) + payload


def recv_frame(sock: socket.socket) -> bytes:
    head = b""
    while len(head) < HEADER_SIZE:
        chunk = sock.recv(HEADER_SIZE - len(head))
        if not chunk:
            raise ConnectionError(f"closed after {len(head)} header bytes")
        head += chunk
    length = struct.unpack("!I", head[8:12])[0]
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            raise ConnectionError("closed mid-frame")
        body += chunk
    return head + body


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in the scrape"
    return float(m.group(1))


def rejected(node, reason: str) -> float:
    return metric(node.http("/metrics"), "elasticd_replication_connections_rejected_total",
                  f'{{reason="{reason}"}}')


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(["v1"], workdir=str(tmp_path), lease_ttl=2, replication=True)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def replica_port(c: LocalCluster) -> tuple[str, int]:
    host, _, port = c.node_records()["v1"]["replication"].rpartition(":")
    assert host == "127.0.0.1"
    return host, int(port)


@pytest.mark.timeout(60)
def test_a_peer_speaking_another_wire_version_is_refused_counted_and_stores_nothing(cluster):
    c, node = cluster, cluster.nodes["v1"]
    addr = replica_port(c)
    hello = encode_frame(Hello("v-next", os.urandom(32), 8 << 20))

    # Control: the same HELLO in this elasticd's version is answered with a CHALLENGE, so the
    # refusal below is about the version alone.
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(hello)
        assert isinstance(decode_frame(recv_frame(s)), Challenge)
    # Hanging up on the challenge is what a client without the secret does: counted as auth.
    c.wait_for(lambda: rejected(node, "auth") == 1, 5, "the control counted as auth")
    assert rejected(node, "version") == 0

    future = VERSION + 1
    d = Descriptor("job", 0, 0, 7, 64, 16)
    pipelined = with_version(encode_frame(PutBegin(d)), future)
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(with_version(hello, future) + pipelined)
        reply = decode_frame(recv_frame(s))  # ours is a v1 frame: this end can read it
        assert isinstance(reply, Error) and reply.code == "version", reply
        assert f"v{future}" in reply.message and f"v{VERSION}" in reply.message, reply.message
        assert "upgrade elasticd on every node" in reply.message
        s.settimeout(5)
        assert s.recv(1) == b"", "the connection must be closed after the refusal"

    c.wait_for(lambda: rejected(node, "version") == 1, 5, "the version rejection counted")
    assert rejected(node, "auth") == 1  # not counted as an authentication failure
    scrape = node.http("/metrics")
    for outcome in ("committed", "refused", "aborted"):
        assert metric(scrape, "elasticd_replica_pushes_received_total",
                      f'{{outcome="{outcome}"}}') == 0
    assert metric(scrape, "elasticd_replica_bytes_held") == 0
    held = replica_root(node.shm_dir)
    assert not os.path.isdir(held) or not os.listdir(held), os.listdir(held)
    log = node.log_text()
    assert re.search(rf"rejected 127\.0\.0\.1:\d+: peer speaks replication protocol "
                     rf"v{future}, this elasticd speaks v{VERSION}", log), log[-2000:]
    assert node.running


@pytest.mark.timeout(60)
def test_a_record_with_a_newer_schema_is_ignored_with_a_message_naming_key_and_versions(
        cluster):
    c, node = cluster, cluster.nodes["v1"]
    newer = records.SCHEMA_VERSION + 1
    key = c.keys.node("v-next")
    c.coordinator().put(key, json.dumps({"schema": newer, "record": "node",
                                         "node": "v-next", "shape": "unknown"}).encode())
    expected = (f"{key.decode()}: written with record schema v{newer}, this elasticd reads up "
                f"to v{records.SCHEMA_VERSION}; upgrade elasticd on this node")
    c.wait_for(lambda: expected in node.log_text(), 10, "the daemon's message")
    assert "ignoring node record: " + expected in node.log_text()
    # Not counted as a node, and the daemon keeps cycling.
    cycles = metric(node.http("/metrics"), "elasticd_loop_cycles_total")
    c.wait_for(lambda: metric(node.http("/metrics"), "elasticd_loop_cycles_total") > cycles + 2,
               10, "more main loop cycles")
    assert metric(node.http("/metrics"), "elasticd_nodes_alive") == 1
    assert node.running

    env = {**os.environ, "ELASTICD_ETCD": c.etcd, "ELASTICD_PREFIX": c.prefix}
    res = subprocess.run([sys.executable, "-m", "elasticd.cli.main", "nodes", "--format",
                          "json"], env=env, capture_output=True, text=True, timeout=30)
    rows = {r["node"]: r for r in json.loads(res.stdout)}
    assert rows["v-next"]["state"] == "unreadable"
    assert rows["v-next"]["error"] == expected
    assert rows["v1"]["state"] == "up", rows["v1"]
