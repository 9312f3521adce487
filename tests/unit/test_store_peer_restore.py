"""Restore from a peer's RAM: the checkpoint service's replication hooks (``ckpt_committed``,
``ckpt_fetch``, ``on_local_snapshot``, ``start_generation``) and the worker choosing the
committed step, also after the world shrank.

The replicator is an in-process fake whose ``fetch_to_local`` runs the real
:func:`~elasticd.recovery.fetch.fetch_into_store` over another node's slot store (the
"peer's RAM"), so a fetched shard is a real, verified snapshot in the local store. Ranks are
threads of this process (the collective of ``test_worker_checkpointer``); slots live in unique
/dev/shm directories removed afterwards.
"""

from __future__ import annotations

import logging

import os
import shutil
import uuid

import numpy as np
import pytest
import torch

from elasticd.worker.checkpointer import Checkpointer
from tests.snapshot_entries import entry
from elasticd.store.api import Replication
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.testing.transport import InProcessTransport, TransportError
from elasticd.replication.commit import Committed
from elasticd.recovery.fetch import (
    FetchResult,
    ShardLost,
    copy_own,
    fetch_into_scratch,
    fetch_into_store,
)
from tests.unit.test_worker_checkpointer import (
    ThreadRanks,
    assert_same,
    capture,
    make_state,
    run_ranks,
    train_step,
)
from tests.unit.test_store_service import write_snapshot

torch.set_num_threads(1)


class FakeReplicator(Replication):
    """Records what the service tells it; fetches from ``peer`` (another node's store)."""

    def __init__(self, local: SlotStore, peer: SlotStore) -> None:
        self.local, self.peer = local, peer
        self.snapshots: list[tuple[str, int, tuple[int, int]]] = []
        self.generations: list[tuple[str, int]] = []
        self.fetches: list[tuple[str, int, tuple[int, int]]] = []
        self.needs: list[tuple[str, int, dict]] = []
        self.record: Committed | None = None
        self.fail_snapshots = False

    def on_local_snapshot(self, job, rank, version):
        self.snapshots.append((job, rank, version))
        if self.fail_snapshots:
            raise RuntimeError("replication is broken")

    def committed(self, job):
        return self.record

    def start_generation(self, job, generation):
        self.generations.append((job, generation))

    def fetch(self, job, rank, version, into, select=None, reserve=None):
        def whole(d):  # a copy from memory writes every byte: reserved whole first
            buf = into(d)
            if reserve is not None:
                reserve(0, d.total_bytes)
            return buf

        d = copy_own([self.peer], job, rank, version, whole)  # whole: select only saves wire
        if d is None:
            raise ShardLost(job, rank, version, [("n2", "not held")])
        return FetchResult("n2", d, d.total_bytes, 0.001)

    def fetch_to_local(self, job, rank, version, need=None):
        self.fetches.append((job, rank, version))
        if need is not None:
            self.needs.append((job, rank, need))
            return fetch_into_scratch(self, self.local, job, rank, version, need)
        return fetch_into_store(self, self.local, job, rank, version)


def commit(generation, step, world):
    return Committed(generation, step, tuple(range(world)),
                     {r: ("n1", "n2") for r in range(world)})


@pytest.fixture
def nodes():
    """(service of n1 with a fake replicator, n1's transport, n2's service and transport)."""
    roots = [f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    local, peer = SlotStore(roots[0]), SlotStore(roots[1])
    rep = FakeReplicator(local, peer)
    svc = CheckpointService(local, "n1", replicator=rep)
    other = CheckpointService(peer, "n2")
    try:
        yield svc, InProcessTransport(svc.handlers()), other, InProcessTransport(
            other.handlers())
    finally:
        local.close()
        peer.close()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def read_w(reply, job, rank):
    with open(reply["path"], "rb") as f:
        f.seek(reply["offset"])
        return entry(f.read(reply["size"]), "w", np.float32, job=job, rank=rank)


# -- service ------------------------------------------------------------------------------


def test_every_completed_snapshot_is_handed_to_the_replicator(nodes):
    svc, t, _, _ = nodes
    write_snapshot(t, "job", 0, step=1)
    write_snapshot(t, "job", 1, step=1)
    assert svc.replicator.snapshots == [("job", 0, (0, 1)), ("job", 1, (0, 1))]
    svc.replicator.fail_snapshots = True  # replication trouble never fails the worker's call
    done, _ = write_snapshot(t, "job", 0, step=2)
    assert done["step"] == 2 and svc.counters["replicate_failed"] == 1


def test_committed_reports_the_record_or_null(nodes):
    svc, t, _, _ = nodes
    assert t.call("ckpt_committed", job="job") == {"committed": None}
    svc.replicator.record = commit(1, 7, 3)
    assert t.call("ckpt_committed", job="job") == {"generation": 1, "step": 7,
                                                   "ranks": [0, 1, 2]}
    svc.replicator.committed = lambda job: (_ for _ in ()).throw(OSError("etcd down"))
    assert t.call("ckpt_committed", job="job") == {"committed": None}
    alone = CheckpointService(svc.store, "n1")  # no replicator: nothing is ever committed
    assert InProcessTransport(alone.handlers()).call("ckpt_committed", job="job") == \
        {"committed": None}


def test_fetch_of_a_shard_held_here_is_local(nodes):
    svc, t, _, _ = nodes
    _, data = write_snapshot(t, "job", 0, step=3)
    reply = t.call("ckpt_fetch", job="job", rank=0, generation=0, step=3)
    assert reply["source"] == "local" and reply["wire_bytes"] == 0
    assert np.array_equal(read_w(reply, "job", 0), data)
    t.call("ckpt_release", pin=reply["pin"])
    assert svc.replicator.fetches == []


def test_fetch_of_a_dead_nodes_shard_comes_from_the_peer(nodes):
    svc, t, _, t2 = nodes
    _, data = write_snapshot(t2, "job", 2, step=4, world=3)  # in n2's RAM only
    reply = t.call("ckpt_fetch", job="job", rank=2, generation=0, step=4)
    assert reply["source"] == "peer" and reply["wire_bytes"] > 0 and reply["holder"] == "n2"
    assert np.array_equal(read_w(reply, "job", 2), data)
    t.call("ckpt_release", pin=reply["pin"])
    assert svc.replicator.fetches == [("job", 2, (0, 4))]
    assert (0, 4) in svc.store.versions("job", 2)  # now a snapshot of this node's store
    again = t.call("ckpt_fetch", job="job", rank=2, generation=0, step=4)
    assert again["source"] == "peer"  # the bytes still came from a peer
    t.call("ckpt_release", pin=again["pin"])
    # A later restore round opens it as a local snapshot (ckpt_open): still from the peer
    # (CI once saw such a recovery reported "local").
    opened = t.call("ckpt_open", job="job", rank=2, generation=0, step=4)
    assert opened["source"] == "peer"
    t.call("ckpt_release", pin=opened["pin"])
    assert len(svc.replicator.fetches) == 1


def test_a_fetched_shard_is_not_checked_again_on_its_way_to_the_worker(nodes, monkeypatch):
    """The fetch checks every block as it lands (fetch_shard's contract); complete and the
    open that follow in the same ckpt_fetch used to check it twice more (~0.1 s per 385 MB
    on a restore's path). A later ckpt_open still checks, for rot in RAM."""
    import elasticd.snapshot.reader as reader

    svc, t, _, t2 = nodes
    write_snapshot(t2, "job", 2, step=4, world=3)
    checked = []
    real = reader.verify_block
    monkeypatch.setattr(reader, "verify_block",
                        lambda header, i, data: (checked.append(i), real(header, i, data)))
    reply = t.call("ckpt_fetch", job="job", rank=2, generation=0, step=4)
    assert reply["source"] == "peer"
    t.call("ckpt_release", pin=reply["pin"])
    assert checked == []
    opened = t.call("ckpt_open", job="job", rank=2, generation=0, step=4)
    t.call("ckpt_release", pin=opened["pin"])
    blocks = svc.store.latest("job", 2).header.layout.num_blocks
    assert checked == list(range(blocks)) and blocks >= 1


def test_a_fetch_with_the_new_boxes_is_a_partial_copy_dropped_at_its_release(nodes):
    """``need`` (a new rank's local boxes): the copy lands in a scratch segment, never a
    snapshot of this node's store, counted against the cap until ckpt_release deletes it;
    a malformed ``need`` is a clear refusal."""
    svc, t, _, t2 = nodes
    _, data = write_snapshot(t2, "job", 2, step=4, world=3)
    before = svc.store.bytes_held()
    reply = t.call("ckpt_fetch", job="job", rank=2, generation=0, step=4,
                   need=[[[3000], ["S0"], [0], [1500]]])
    assert reply["partial"] is True and reply["source"] == "peer" and ".scratch-" in reply["path"]
    assert np.array_equal(read_w(reply, "job", 2), data)  # the fake copies whole
    assert svc.store.bytes_held() > before
    assert svc.store.versions("job", 2) == []  # not a snapshot here
    assert svc.replicator.needs == [("job", 2, [[[3000], ["S0"], [0], [1500]]])]
    t.call("ckpt_release", pin=reply["pin"])
    # Kept, pages touched, for the job's next restore (store/scratch_pool.py), until the job
    # leaves the node (or it expires: test_store_shm.py).
    assert svc.store.bytes_held() > before and os.path.exists(reply["path"])
    svc.remove_job("job")
    assert svc.store.bytes_held() == before
    assert not os.path.exists(reply["path"])
    with pytest.raises(TransportError, match="need"):
        t.call("ckpt_fetch", job="job", rank=2, generation=0, step=4, need={"w": 1})


def test_a_partial_copy_without_room_is_refused_in_one_readable_line(nodes, monkeypatch):
    """A scratch segment that cannot reserve its pages (a full /dev/shm) ends the fetch with
    the store's own error, its message as the worker reads it (not the repr of its args)."""
    import errno

    from elasticd.snapshot.segment import Segment

    svc, t, _, t2 = nodes
    write_snapshot(t2, "job", 2, step=4, world=3)

    def full(self, start, end):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Segment, "reserve_range", full)
    with pytest.raises(TransportError) as refused:
        t.call("ckpt_fetch", job="job", rank=2, generation=0, step=4,
               need=[[[3000], ["S0"], [0], [1500]]])
    message = str(refused.value)
    assert "no room for a partial copy of job rank 2: [Errno 28] No space left" in message
    assert "None)" not in message and "', " not in message, message


def test_the_next_partial_copy_of_a_rank_lands_in_the_scratch_its_last_one_did(nodes):
    """Two old ranks of the same size fetched for a reshard and released in the worker's
    order (the other rank's first): at the next restore each copy lands in the segment the
    same rank's last one did, whose pages are touched where its blocks land (by size alone
    rank 0's took rank 1's)."""
    svc, t, _, t2 = nodes
    for rank in (0, 1):
        write_snapshot(t2, "job", rank, step=4, world=3)
    need = [[[3000], ["S0"], [0], [1500]]]

    def fetch_both():
        return [t.call("ckpt_fetch", job="job", rank=r, generation=0, step=4, need=need)
                for r in (0, 1)]

    first = fetch_both()
    assert first[0]["size"] == first[1]["size"] and first[0]["path"] != first[1]["path"]
    for reply in reversed(first):
        t.call("ckpt_release", pin=reply["pin"])
    again = fetch_both()
    assert [r["path"] for r in again] == [r["path"] for r in first]
    for reply in again:
        t.call("ckpt_release", pin=reply["pin"])


def test_a_shard_held_here_as_a_replica_is_handed_over_in_place(nodes):
    """A dead node's rank now hosted here, of which this node holds a replica: the worker
    maps the replica's slot (checked, pinned), uncopied; nothing is fetched or reserved."""
    import types

    svc, t, _, _ = nodes
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    replicas = SlotStore(root)
    try:
        _, data = write_snapshot(InProcessTransport(CheckpointService(replicas, "n1").handlers()),
                                 "job", 4, step=5, world=6)
        svc.replicator.sink = types.SimpleNamespace(store=replicas)
        before = svc.store.bytes_held()
        for need in (None, [[[3000], ["S0"], [0], [1500]]]):  # same world, and a reshard
            extra = {} if need is None else {"need": need}
            reply = t.call("ckpt_fetch", job="job", rank=4, generation=0, step=5, **extra)
            assert reply["path"] == replicas.latest("job", 4).path
            assert (reply["source"], reply["wire_bytes"], reply["holder"]) == ("peer", 0, "n1")
            assert np.array_equal(read_w(reply, "job", 4), data)
            t.call("ckpt_release", pin=reply["pin"])
        assert svc.replicator.fetches == [] and svc.store.bytes_held() == before
    finally:
        replicas.close()
        shutil.rmtree(root, ignore_errors=True)


def test_fetch_of_a_shard_no_one_holds_is_lost(nodes):
    svc, t, _, _ = nodes
    reply = t.call("ckpt_fetch", job="job", rank=5, generation=0, step=1)
    assert reply["lost"] is True and "not held" in reply["reason"]
    alone = InProcessTransport(CheckpointService(svc.store, "n1").handlers())
    assert alone.call("ckpt_fetch", job="job", rank=5, generation=0, step=1)["lost"] is True


def test_list_reports_replicas_held(nodes):
    svc, t, _, _ = nodes

    class Sink:
        def holdings(self):
            return [type("D", (), {"job": "job", "owner_rank": 4})()]

        def versions(self, job, rank):
            return [(0, 5), (0, 4)]

    assert t.call("ckpt_list", job="job")["replicas"] == {}
    svc.replicator.sink = Sink()
    assert t.call("ckpt_list", job="job")["replicas"] == {"4": [[0, 5], [0, 4]]}


def test_report_with_a_new_generation_starts_it_once(nodes):
    svc, t, _, _ = nodes
    for rank in (0, 1):
        t.call("ckpt_report", job="job", rank=rank, source="peer", seconds=0.1, steps_lost=1,
               bytes=10, generation=0, step=2, next_generation=1)
    assert svc.replicator.generations == [("job", 1)]
    assert svc.counters["restores_peer"] == 2


# -- worker -------------------------------------------------------------------------------


def save_old_world(t1, t2, world, steps):
    """Old world of ``world`` ranks: rank 0 on n1 (t1), the others on n3, whose replicas are
    in n2's RAM (t2). Returns each rank's captured state per step."""
    refs = {}
    for r in range(world):
        state = make_state(seed=10 + r, world=world, rank=r)
        with Checkpointer(transport=t1 if r == 0 else t2, job="j", rank=r,
                          world_size=world) as ckpt:
            for step in range(1, steps[r] + 1):
                train_step(state)
                state["sampler"].consumed = 4 * world * step  # the global position
                ckpt.save(step, state)
                ckpt.wait()
                refs[(r, step)] = capture(state)
    return refs


def restore_new_world(t, world):
    """Fresh states of a new world of ``world`` ranks, each restored through ``t``; returns
    them and each rank's (step, last_restore)."""
    ranks = ThreadRanks(world)
    fresh = [make_state(seed=99, world=world, rank=r) for r in range(world)]

    def restore(r):
        with Checkpointer(transport=t, job="j", rank=r, world_size=world,
                          collective=ranks.rank(r)) as ckpt:
            return ckpt.restore(fresh[r]), ckpt.last_restore

    return fresh, run_ranks(world, restore)


def test_after_a_shrink_ranks_restore_the_committed_step_from_a_peer(nodes):
    svc, t, _, t2 = nodes
    # Rank 0 reached step 3; the dead node's ranks reached step 2, which was committed.
    refs = save_old_world(t, t2, 3, steps=[3, 2, 2])
    svc.replicator.record = commit(0, 2, 3)
    reports = []
    svc.on_restore.append(reports.append)
    fresh, results = restore_new_world(t, 2)
    assert [step for step, _ in results] == [2, 2]
    (_, r0), (_, r1) = results
    assert r0.source == "local" and r1.source == "peer"  # rank 1's shard was only in n2
    assert all(r.saved_world_size == 3 and r.steps_lost == 1 and r.next_generation == 1
               for r in (r0, r1))
    for r in range(2):  # new rank r holds old rank r's state (identical under DDP)
        assert_same(fresh[r], refs[(r, 2)], rng=False)
    assert svc.replicator.fetches == [("j", 1, (0, 2))]
    assert svc.replicator.generations == [("j", 1)]
    assert {e["source"] for e in reports} == {"local", "peer"}


def test_after_a_shrink_a_rank_whose_old_rank_is_lost_everywhere_loads_another_old_rank(
        nodes, caplog):
    """Old rank 1's copies are gone from every node's RAM (its node killed, its replica's
    holder frozen), the committed step's other ranks are held: the new rank 1 restores the
    committed step from another old rank's snapshot (the same model and optimizer under
    DDP), where it used to find the step not loadable, and the job went back to step 0."""
    svc, t, other, t2 = nodes
    refs = save_old_world(t, t2, 3, steps=[2, 2, 2])
    other.store.remove("j", 1)
    svc.replicator.record = commit(0, 2, 3)
    with caplog.at_level(logging.WARNING, logger="elasticd.checkpoint"):
        fresh, results = restore_new_world(t, 2)
    assert [step for step, _ in results] == [2, 2]
    assert results[1][1].source == "peer" and results[1][1].saved_world_size == 3
    assert_same(fresh[0], refs[(0, 2)], rng=False)
    assert_same(fresh[1], refs[(2, 2)], rng=False)  # old rank 2's: rank 1's own is lost
    assert ("j", 1, (0, 2)) in svc.replicator.fetches  # asked first, lost
    assert "from old rank 2's snapshot: no copy of old rank 1's" in caplog.text


def test_a_newer_step_every_rank_holds_beats_the_committed_one(nodes):
    svc, t, _, _ = nodes
    refs = save_old_world(t, t, 2, steps=[3, 3])
    svc.replicator.record = commit(0, 2, 2)
    ranks = ThreadRanks(2)
    fresh = [make_state(seed=99, world=2, rank=r) for r in range(2)]

    def restore(r):
        with Checkpointer(transport=t, job="j", rank=r, world_size=2,
                          collective=ranks.rank(r)) as ckpt:
            return ckpt.restore(fresh[r]), ckpt.last_restore

    results = run_ranks(2, restore)
    assert [(s, res.source, res.steps_lost) for s, res in results] == [(3, "local", 0)] * 2
    assert svc.replicator.fetches == []
    assert_same(fresh[1], refs[(1, 3)], rng=False)


def test_same_world_restores_a_lost_nodes_rank_from_the_peer(nodes):
    svc, t, _, t2 = nodes
    refs = save_old_world(t, t2, 2, steps=[3, 2])  # rank 1's node died; a standby replaced it
    svc.replicator.record = commit(0, 2, 2)
    ranks = ThreadRanks(2)
    fresh = [make_state(seed=99, world=2, rank=r) for r in range(2)]

    def restore(r):
        with Checkpointer(transport=t, job="j", rank=r, world_size=2,
                          collective=ranks.rank(r)) as ckpt:
            return ckpt.restore(fresh[r]), ckpt.last_restore

    results = run_ranks(2, restore)
    assert [(s, res.source) for s, res in results] == [(2, "local"), (2, "peer")]
    assert results[1][1].saved_world_size == 2
    assert_same(fresh[1], refs[(1, 2)], rng=False)


def test_after_a_grow_the_new_rank_restores_a_copy_of_an_old_ranks_shard(nodes):
    # A node rejoined: the step committed by 2 ranks is restored by 3 (before, the new rank
    # "would have no state" and the whole job started over from step 0).
    svc, t, _, t2 = nodes
    refs = save_old_world(t, t2, 2, steps=[2, 2])  # rank 1's shard only in n2's RAM
    svc.replicator.record = commit(0, 2, 2)
    ranks = ThreadRanks(3)
    fresh = [make_state(seed=99, world=3, rank=r) for r in range(3)]

    def restore(r):
        with Checkpointer(transport=t, job="j", rank=r, world_size=3,
                          collective=ranks.rank(r)) as ckpt:
            return ckpt.restore(fresh[r]), ckpt.last_restore

    results = run_ranks(3, restore)
    assert [step for step, _ in results] == [2, 2, 2]
    assert all(res.saved_world_size == 2 and res.next_generation == 1 for _, res in results)
    for r in range(3):  # new rank 2 holds old rank 0's state (identical under DDP)
        assert_same(fresh[r], refs[(r % 2, 2)], rng=False)
    assert fresh[2]["sampler"].consumed == 4 * 2 * 2  # the global position carried over
    assert ("j", 1, (0, 2)) in svc.replicator.fetches
