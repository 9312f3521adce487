"""``ckpt_sessions``: the daemon hands its job's worker replication sessions to the holders of
an old rank's snapshot (elasticd/store/service_restores.py, elasticd/store/handed_sessions.py).

A real holder over loopback and the daemon's real service and replicator: the sessions handed
over fetch the copy, every block checked against its owner's tag, in the caller's hands (the
descriptor is what the local socket would pass); one live set per (job, rank, old rank), so
asking again cuts the last set off; a set is cut off at its deadline and when the job leaves
the node, and when the worker says its fetch is done (``ckpt_sessions_done``, its own rank's
sets only); a bad deadline is refused with the reason.
"""

from __future__ import annotations

import time

import pytest

from elasticd.coordination.keys import Keyspace
from elasticd.local.wire import RequestError
from elasticd.recovery.replicator import Replicator
from elasticd.replication.api import ConnectionLost
from elasticd.replication.commit import Committed, record_commit
from elasticd.replication.handed import Ticket, adopt
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.testing.coordination import MemoryCoordinator
from elasticd.testing.replication import MemorySink
from tests.unit.test_replication_attacks import SECRET, sealed_push, server

TOTAL = 64 + (1 << 20)  # sealed_push's header and payload
ASK = {"job": "job", "rank": 1, "old_rank": 0, "generation": 0, "step": 1}


@pytest.fixture
def daemon(tmp_path):
    """(the ``ckpt_sessions`` handler, the service, the holder's pushed bytes): a daemon
    "node-c" whose job's committed step 1 names holder "node-b" for old rank 0."""
    with server(MemorySink(), chunk_size=1 << 20) as srv:
        header, payload = sealed_push(srv.address)
        coord, keys = MemoryCoordinator(), Keyspace("/t")
        record_commit(coord, keys, "job", Committed(0, 1, (0,), {0: ("node-b",)}))
        store = SlotStore(str(tmp_path / "store"))
        replicator = Replicator("node-c", coord, keys, store, SECRET, m=1, timeout=10.0,
                                peers_address=lambda n: srv.address if n == "node-b" else None)
        service = CheckpointService(store, "node-c", replicator=replicator)
        try:
            yield service.handlers()["ckpt_sessions"], service, header + payload
        finally:
            service.restores.handed.cut_off_job("job")
            replicator.close()
            store.close()


def take(reply: dict) -> list:
    """The worker's side: each session of a reply, adopted."""
    assert len(reply["sessions"]) == len(reply["_fds"])
    return [adopt(fd, Ticket.from_json(s["ticket"]), timeout=10.0)
            for fd, s in zip(reply["_fds"], reply["sessions"])]


def test_the_sessions_handed_over_fetch_the_copy_every_block_checked(daemon):
    handler, service, whole = daemon
    reply = handler(dict(ASK, seconds=30))
    assert [s["holder"] for s in reply["sessions"]] == ["node-b"]
    assert service.restores.handed.live() == 1
    (client,) = take(reply)
    into = bytearray(TOTAL)
    client.fetch("job", 0, into, version=(0, 1))
    assert bytes(into) == whole
    assert client.channel.tag_checked_bytes == len(whole) - 64
    client.close()


def test_asking_again_cuts_the_last_set_off(daemon):
    handler, service, _ = daemon
    (first,) = take(handler(dict(ASK)))
    (second,) = take(handler(dict(ASK)))
    with pytest.raises(ConnectionLost):
        first.fetch("job", 0, bytearray(TOTAL), version=(0, 1))
    second.fetch("job", 0, bytearray(TOTAL), version=(0, 1))
    assert service.restores.handed.live() == 1
    first.close()
    second.close()


def test_a_set_is_cut_off_at_its_deadline_and_when_the_job_leaves(daemon):
    handler, service, _ = daemon
    (short,) = take(handler(dict(ASK, seconds=0.3)))
    (other,) = take(handler(dict(ASK, rank=0, seconds=30)))  # another rank's set
    deadline = time.monotonic() + 10
    while service.restores.handed.live() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(ConnectionLost):
        short.fetch("job", 0, bytearray(TOTAL), version=(0, 1))
    other.fetch("job", 0, bytearray(TOTAL), version=(0, 1))
    service.remove_job("job")
    assert service.restores.handed.live() == 0
    with pytest.raises(ConnectionLost):
        other.fetch("job", 0, bytearray(TOTAL), version=(0, 1))
    short.close()
    other.close()


def test_a_set_ends_when_the_worker_says_its_fetch_is_done(daemon):
    handler, service, _ = daemon
    done = service.handlers()["ckpt_sessions_done"]
    (mine,) = take(handler(dict(ASK, seconds=600)))
    (other,) = take(handler(dict(ASK, rank=0, seconds=600)))  # another rank's set
    assert service.restores.handed.live() == 2
    # Old ranks it was never handed sessions for, and another job's, end nothing.
    assert done({"job": "job", "rank": 1, "old_ranks": [5, 6]}) == {"ended": 0}
    assert done({"job": "x", "rank": 1, "old_ranks": [0]}) == {"ended": 0}
    assert done({"job": "job", "rank": 1, "old_ranks": [0, 0]}) == {"ended": 1}
    assert service.restores.handed.live() == 1
    with pytest.raises(ConnectionLost):
        mine.fetch("job", 0, bytearray(TOTAL), version=(0, 1))
    other.fetch("job", 0, bytearray(TOTAL), version=(0, 1))  # rank 0's set lives on
    for bad in (None, 0, "0", [0.5], [True], [[0]], list(range(5000))):
        with pytest.raises(RequestError, match="old_ranks must be a list"):
            done({"job": "job", "rank": 0, "old_ranks": bad})
    assert service.restores.handed.live() == 1
    mine.close()
    other.close()


@pytest.mark.parametrize("seconds", [0, -1, 1e9, "soon"])
def test_a_bad_deadline_is_refused_with_the_reason(daemon, seconds):
    handler, service, _ = daemon
    with pytest.raises(RequestError, match="seconds must be a number"):
        handler(dict(ASK, seconds=seconds))
    assert service.restores.handed.live() == 0


def test_old_ranks_without_a_holder_keep_nothing_and_sets_share_one_deadline_thread(daemon):
    """A job's process naming old ranks that have no holder piles up no state (once a timer
    thread per set, for up to 1,800 s each); the live sets share one deadline thread."""
    import threading

    handler, service, _ = daemon

    def deadline_threads() -> int:
        return sum(t.name == "elasticd-handed-sessions" for t in threading.enumerate())

    before, others = threading.active_count(), deadline_threads()  # other services' threads
    for old in range(1, 200):  # the committed record names holders for old rank 0 only
        assert handler(dict(ASK, old_rank=old, seconds=1800))["sessions"] == []
    assert service.restores.handed.live() == service.restores.handed.sets() == 0
    clients = [c for rank in (1, 2, 3) for c in take(handler(dict(ASK, rank=rank)))]
    assert service.restores.handed.live() == 3
    assert service.restores.handed.live("job") == 3 and service.restores.handed.live("x") == 0
    assert deadline_threads() <= others + 1
    assert threading.active_count() <= before + 1 + 3  # the deadline thread, 3 serving
    service.remove_job("job")
    deadline = time.monotonic() + 10
    while deadline_threads() > others and time.monotonic() < deadline:
        time.sleep(0.02)
    assert deadline_threads() <= others  # no set left: no thread waits for one
    for client in clients:
        client.close()


def test_a_silent_holder_costs_the_deadline_floor_not_the_pool_timeout(tmp_path):
    """A holder whose port takes the connection and then says nothing (a frozen node's kernel
    still accepts) is left out after its deadline floor, not the pool's 30 s: the worker is
    waiting for this answer. The other holder's session is handed over."""
    import socket

    from elasticd.replication.deadline import DEFAULT_FLOOR

    silent = socket.create_server(("127.0.0.1", 0))  # accepts (in the kernel), never answers
    with server(MemorySink(), chunk_size=1 << 20) as srv:
        sealed_push(srv.address)
        coord, keys = MemoryCoordinator(), Keyspace("/t")
        record_commit(coord, keys, "job", Committed(0, 1, (0,), {0: ("node-s", "node-b")}))
        store = SlotStore(str(tmp_path / "store"))
        book = {"node-s": silent.getsockname()[:2], "node-b": srv.address}
        replicator = Replicator("node-c", coord, keys, store, SECRET, m=2, timeout=30.0,
                                peers_address=book.get)
        service = CheckpointService(store, "node-c", replicator=replicator)
        try:
            started = time.monotonic()
            reply = service.handlers()["ckpt_sessions"](dict(ASK))
            took = time.monotonic() - started
            clients = take(reply)
            assert [s["holder"] for s in reply["sessions"]] == ["node-b"]
            assert took < 3 * DEFAULT_FLOOR, took
            for client in clients:
                client.close()
        finally:
            service.restores.handed.cut_off_job("job")
            replicator.close()
            store.close()
            silent.close()
