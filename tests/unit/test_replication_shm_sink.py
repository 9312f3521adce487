"""The shared-memory sink behind a real replica server: zero-copy landing in slots, the version
rule (stale, duplicate, abandoned generation), verification before publishing, the node-wide
memory cap over local snapshots plus replicas, pinned reads, and adoption after a restart."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from elasticd.store.shm import OverBudget, SlotStore
from elasticd.replication.api import EXISTS, IN_PROGRESS, NO_SPACE, STALE, Descriptor, Refused
from elasticd.replication.shm_sink import CORRUPT, ShmSink, descriptor_of, replica_root
from elasticd.replication.transport import ReplicaClient, ReplicaServer
from tests.replication_nodes import JOB, SECRET, write_snapshot


@pytest.fixture
def root():
    path = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(replica_root(path), ignore_errors=True)


@pytest.fixture
def node(root):
    """A sender's local store, and a receiver: replica store, sink, server, client."""
    sender = SlotStore(os.path.join(root, "sender"))
    local = SlotStore(os.path.join(root, "receiver"))
    replicas = SlotStore(replica_root(os.path.join(root, "receiver")))
    sink = ShmSink(replicas, local=local)
    server = ReplicaServer("127.0.0.1", 0, SECRET, "receiver", sink, idle_timeout=10.0).start()
    client = ReplicaClient.connect(*server.address, SECRET, "sender", timeout=10.0)
    yield sender, local, replicas, sink, server, client
    client.close()
    server.stop()
    for store in (sender, local, replicas):
        store.close()


def push(client, store, rank, step, generation=0, corrupt_at=None):
    view = store.latest(JOB, rank, pin=True, version=(generation, step))
    try:
        d = descriptor_of(view)
        buf = bytearray(view.buffer) if corrupt_at is not None else view.buffer
        if corrupt_at is not None:
            buf[corrupt_at] ^= 0x01
        mv = memoryview(buf)
        return client.push(d, mv[: d.header_bytes], mv[d.header_bytes : d.total_bytes])
    finally:
        view.release()


def test_a_pushed_snapshot_lands_in_a_slot_verified_and_byte_identical(node):
    sender, _, replicas, sink, server, client = node
    data = write_snapshot(sender, 3, 7)
    push(client, sender, 3, 7)
    held = replicas.latest(JOB, 3, verify=True)
    assert bytes(held.buffer) == data
    assert held.path.startswith(replicas.root)  # in the replica store, not the local one
    assert sink.held(JOB, 3).version == (0, 7)


def test_stale_duplicate_and_abandoned_copies_are_refused(node):
    sender, _, _, sink, _, client = node
    write_snapshot(sender, 0, 4)
    write_snapshot(sender, 0, 5)
    push(client, sender, 0, 5)
    with pytest.raises(Refused) as info:
        push(client, sender, 0, 5)  # a retried push of the same version
    assert info.value.reason == EXISTS
    with pytest.raises(Refused) as info:
        push(client, sender, 0, 4)  # a late one
    assert info.value.reason == STALE
    write_snapshot(sender, 0, 6)
    sink.set_floor(JOB, 1)
    with pytest.raises(Refused) as info:
        push(client, sender, 0, 6)  # newer step, but of an abandoned generation
    assert info.value.reason == STALE
    assert sink.held(JOB, 0).version == (0, 5)
    write_snapshot(sender, 0, 1, generation=1)
    push(client, sender, 0, 1, generation=1)
    assert sink.held(JOB, 0).version == (1, 1)


def test_a_copy_failing_its_snapshot_checksums_is_refused_and_the_old_one_kept(node):
    sender, _, replicas, sink, _, client = node
    good = write_snapshot(sender, 1, 1)
    push(client, sender, 1, 1)
    write_snapshot(sender, 1, 2)
    view = sender.latest(JOB, 1)
    offset = view.header.layout.data_offset + 12345
    with pytest.raises(Refused) as info:
        # Intact on the wire (frame checksums pass), corrupt as a snapshot.
        push(client, sender, 1, 2, corrupt_at=offset)
    assert info.value.reason == CORRUPT
    assert sink.held(JOB, 1).version == (0, 1)
    assert bytes(replicas.latest(JOB, 1, verify=True).buffer) == good
    push(client, sender, 1, 2)  # the connection is still usable and the real copy lands
    assert sink.held(JOB, 1).version == (0, 2)


def test_one_transfer_per_shard_at_a_time(node):
    _, _, _, sink, _, _ = node
    d1 = Descriptor(JOB, 0, 0, 1, 8192, 4096)
    d2 = Descriptor(JOB, 0, 0, 2, 8192, 4096)
    sink.begin(d1)
    with pytest.raises(Refused) as info:
        sink.begin(d2)  # would be handed the same free slot
    assert info.value.reason == IN_PROGRESS
    sink.abort(d1, "test")
    view = sink.begin(d2)
    assert len(view) == d2.total_bytes
    sink.abort(d2, "test")


def test_one_cap_counts_local_snapshots_and_replicas(root):
    local = SlotStore(os.path.join(root, "n"), cap_bytes=10 << 20)
    replicas = SlotStore(replica_root(os.path.join(root, "n")))
    sender = SlotStore(os.path.join(root, "sender"))
    try:
        sink = ShmSink(replicas, local=local, cap_bytes=1 << 20)
        assert local.cap_bytes == 1 << 20  # the node cap now governs the local store too
        write_snapshot(local, 0, 1, n=60_000)  # 2 slots of ~0.4 MiB
        write_snapshot(sender, 1, 1, n=60_000)
        view = sender.latest(JOB, 1)
        d = descriptor_of(view)
        with pytest.raises(Refused) as info:
            sink.begin(d)  # another 2 slots would pass the cap
        assert info.value.reason == NO_SPACE
        local.remove_job(JOB)
        target = sink.begin(d)
        target[:] = view.buffer
        del target
        sink.landed(d)
        # Now the replicas hold the room: the local store may only use what is left.
        assert local.cap_bytes == (1 << 20) - replicas.bytes_held()
        with pytest.raises(OverBudget):
            write_snapshot(local, 0, 2, n=60_000)
        sink.drop(JOB, 1)
        assert local.cap_bytes == 1 << 20 and replicas.bytes_held() == 0
        write_snapshot(local, 0, 2, n=60_000)
    finally:
        for store in (local, replicas, sender):
            store.close()


def test_fetches_read_pinned_slots_and_the_owners_own_copy(node):
    sender, local, _, sink, server, client = node
    data = write_snapshot(sender, 2, 9)
    push(client, sender, 2, 9)
    own = write_snapshot(local, 5, 9)  # a rank the receiving node owns itself
    found = sink.read(JOB, 2)
    assert found is not None and found[0].version == (0, 9)
    # While pinned, the slot holding it is never handed to a new transfer.
    write_snapshot(sender, 2, 10)
    push(client, sender, 2, 10)
    write_snapshot(sender, 2, 11)
    with pytest.raises(Refused) as info:
        push(client, sender, 2, 11)
    assert info.value.reason == IN_PROGRESS
    assert bytes(found[1]) == data
    sink.release(found[0])
    push(client, sender, 2, 11)
    buf = bytearray(len(own))
    d = client.fetch(JOB, 5, buf)
    assert bytes(buf[: d.total_bytes]) == own


def test_a_restarted_daemon_adopts_verified_replicas(root):
    sender = SlotStore(os.path.join(root, "sender"))
    replicas = SlotStore(replica_root(os.path.join(root, "r")))
    try:
        sink = ShmSink(replicas)
        write_snapshot(sender, 4, 3)
        view = sender.latest(JOB, 4)
        d = descriptor_of(view)
        target = sink.begin(d)
        target[:] = view.buffer
        del target
        sink.landed(d)
        replicas.close(unlink=False)
        again = SlotStore(replica_root(os.path.join(root, "r")))
        assert again.scan().kept == [(JOB, 4, 0, 3)]
        adopted = ShmSink(again)
        assert adopted.held(JOB, 4).version == (0, 3)
        with pytest.raises(Refused) as info:
            adopted.begin(d)
        assert info.value.reason == EXISTS
        again.close()
    finally:
        sender.close()
        replicas.close()


@pytest.mark.parametrize("withdrawn", [{(0, 2)}, set()])
def test_with_two_undecided_copies_only_one_the_records_call_withdrawn_is_let_go(node, withdrawn):
    # Both replica slots of rank 0 hold copies that may be committed, (0,1) and (0,2); the
    # owner withdrew (0,2) and pushes (0,3). Letting go of the older, as the sink once did,
    # loses (0,1), which the records can still commit: the sink asks the records, and without
    # an answer it refuses the push rather than guess.
    sender, _, replicas, sink, _, client = node
    superseded, asked = [], []
    sink.on_superseded = lambda job, rank, v: (superseded.append(v),
                                               replicas.release_retained(job, rank, v))
    sink.never_committed = lambda job, rank, versions: (asked.append((rank, list(versions))),
                                                        withdrawn & set(versions))[1]
    for step in (1, 2):
        write_snapshot(sender, 0, step)
        push(client, sender, 0, step)
        assert replicas.retain(JOB, 0, (0, step))
    write_snapshot(sender, 0, 3)
    if withdrawn:
        push(client, sender, 0, 3)
        assert superseded == [(0, 2)]
        assert sink.held(JOB, 0).version == (0, 3)
    else:
        with pytest.raises(Refused) as info:
            push(client, sender, 0, 3)
        assert info.value.reason == IN_PROGRESS
        assert superseded == []
    assert asked == [(0, [(0, 1), (0, 2)])]
    view = replicas.latest(JOB, 0, version=(0, 1))
    assert view is not None, "the copy that may still be committed was let go"
    view.release()
