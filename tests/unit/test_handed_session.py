"""A replication session handed from the daemon to a job's process
(elasticd/replication/handed.py).

Against a real holder over loopback: a session scoped to a job, handed over with its
descriptor passed over a Unix socket (``SCM_RIGHTS``) to another process, fetches the job's
copy there, every block checked against its owner's tag, after the daemon closed its own
descriptor; it fetches no other job; a copy whose block key was not handed over is refused
before a byte of it lands; the daemon cuts a handed session off at once; an unscoped session
is not handed over; a malformed ticket is refused with the reason.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket

import pytest

from elasticd.replication.api import ConnectionLost, Refused
from elasticd.replication.handed import (
    HandedConnections,
    Ticket,
    UnknownCopy,
    adopt,
    cut_off,
    hand_over,
    release,
)
from elasticd.replication.lanes import NoAddress
from elasticd.replication.seal import SALT_BYTES, BlockTagger
from elasticd.replication.transport import ReplicaClient
from elasticd.replication.wire import Limits
from elasticd.testing.replication import MemorySink
from tests.unit.test_replication_attacks import SECRET, sealed_push, server

RUN_BYTES = 1 << 20
TOTAL = 64 + (1 << 20)  # sealed_push's header and payload


def scoped(address, job: str = "job") -> tuple[ReplicaClient, dict[bytes, bytes]]:
    """The daemon's side: a session scoped to ``job`` that described rank 0's copy (so the
    daemon knows its block-tag salt), and the block keys to hand over with it."""
    client = ReplicaClient.connect(*address, SECRET, "node-c", timeout=10.0, scope=job)
    client.fetch(job, 0, bytearray(TOTAL), version=(0, 1), byte_range=(0, 0))
    salt = client.tag_salt
    assert salt is not None
    return client, {salt: BlockTagger(SECRET).key(salt)}


def _new_owner(conn: socket.socket, out) -> None:
    """Another process: takes the session passed over ``conn`` and fetches with it."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
    client = adopt(fds[0], Ticket.from_json(json.loads(msg)), timeout=10.0)
    into = bytearray(TOTAL)
    client.fetch("job", 0, into, version=(0, 1))
    result = {"bytes": bytes(into), "tag_checked": client.channel.tag_checked_bytes}
    other = bytearray(TOTAL)
    try:
        client.fetch("other-job", 0, other, version=(0, 1))
        result["other"] = "served"
    except Exception as exc:  # noqa: BLE001 - the parent inspects it
        result["other"] = type(exc).__name__
    result["other_landed"] = any(other)
    out.put(result)
    client.close()


def test_a_session_handed_to_another_process_fetches_its_jobs_copy_there_and_no_other():
    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        header, payload = sealed_push(srv.address)
        daemon, keys = scoped(srv.address)
        fd, ticket = hand_over(daemon, keys)
        with pytest.raises(ConnectionLost, match="handed over"):
            daemon.fetch("job", 0, bytearray(TOTAL), version=(0, 1))  # the daemon's side is done
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_new_owner, args=(theirs, out), daemon=True)
        child.start()
        try:
            socket.send_fds(ours, [json.dumps(ticket.to_json()).encode()], [fd])
            os.close(fd)
            release(daemon)  # the daemon's own descriptor: the session lives on in the child
            got = out.get(timeout=30)
        finally:
            child.join(10)
            if child.is_alive():
                child.kill()
            ours.close()
            theirs.close()
    assert got["bytes"] == header + payload
    assert got["tag_checked"] == len(payload)  # every block against its owner's tag
    # The holder ends a scoped session asked for another job (counted there); nothing lands.
    assert got["other"] in ("ConnectionLost", "RemoteError", "ProtocolError", "ScopeViolation")
    assert not got["other_landed"]


def test_a_copy_whose_block_key_was_not_handed_over_is_refused_before_a_byte_lands():
    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        sealed_push(srv.address)
        daemon, _ = scoped(srv.address)
        fd, ticket = hand_over(daemon, {})  # no block key
        release(daemon)
        client = adopt(fd, ticket, timeout=10.0)
        into = bytearray(TOTAL)
        with pytest.raises(UnknownCopy):
            client.fetch("job", 0, into, version=(0, 1))
        client.close()
    assert not any(into)


def test_the_daemon_cuts_a_handed_session_off():
    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        sealed_push(srv.address)
        daemon, keys = scoped(srv.address)
        fd, ticket = hand_over(daemon, keys)
        client = adopt(fd, ticket, timeout=10.0)
        client.fetch("job", 0, bytearray(TOTAL), version=(0, 1))  # works until cut off
        cut_off(daemon)
        with pytest.raises(ConnectionLost):
            client.fetch("job", 0, bytearray(TOTAL), version=(0, 1))
        client.close()


def test_only_a_usable_scoped_session_is_handed_over():
    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        sealed_push(srv.address)
        unscoped = ReplicaClient.connect(*srv.address, SECRET, "node-c", timeout=10.0)
        with pytest.raises(ValueError, match="not scoped"):
            hand_over(unscoped, {})
        unscoped.close()
        daemon, keys = scoped(srv.address)
        fd, _ = hand_over(daemon, keys)
        os.close(fd)
        with pytest.raises(ValueError, match="not usable"):
            hand_over(daemon, keys)  # handed over once already
        cut_off(daemon)


def test_a_pool_of_handed_sessions_never_opens_one_and_forgets_a_dropped_one():
    with server(MemorySink(), chunk_size=RUN_BYTES) as srv:
        sealed_push(srv.address)
        daemon, keys = scoped(srv.address)
        fd, ticket = hand_over(daemon, keys)
        release(daemon)
        pool = HandedConnections({"node-b": adopt(fd, ticket, timeout=10.0)})
        client, reused = pool.get("node-b")
        assert not reused and client.peer_id == "node-b"
        with pytest.raises(Refused):
            client.fetch("job", 3, bytearray(TOTAL), version=(0, 1))  # not held: usable still
        pool.discard("node-b")
        with pytest.raises(NoAddress):
            pool.get("node-b")
        with pytest.raises(NoAddress):
            pool.get("node-x")


@pytest.mark.parametrize("mangle, why", [
    (lambda t: t.pop("send"), "send"),
    (lambda t: t.__setitem__("recv", ["zz", 0]), "non-hexadecimal"),
    (lambda t: t.__setitem__("block_keys", {"00": "11"}), "wrong length"),
    (lambda t: t.__setitem__("limits", "big"), "malformed"),
])
def test_a_malformed_ticket_is_refused_with_the_reason(mangle, why):
    ticket = Ticket("node-b", "job", (bytes(32), 5), (bytes(32), 7), Limits(), 1 << 20,
                    {bytes(SALT_BYTES): bytes(32)})
    assert Ticket.from_json(json.loads(json.dumps(ticket.to_json()))) == ticket
    value = ticket.to_json()
    mangle(value)
    with pytest.raises(ValueError, match=why):
        Ticket.from_json(value)
