"""The newest pair (store/shm.py's module doc): an in-process job's local ranks hold the last
step they completed even while the commit protocol holds both commit slots.

On the code before it, a snapshot that found the committed copy and an acknowledged one in the
two slots was skipped (``CommitPending``): nodes skipped different steps, so survivors of a
failure held different newest steps and resumed from an older common one
(bench/results/recovery_inprocess_snapshots.json). Real tmpfs, a unique /dev/shm directory per
test, removed afterwards.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from tests.snapshot_entries import entry
from tests.store_retained import retained
from elasticd.snapshot.format import PREAMBLE_SIZE, SnapshotHeader, TensorSpec, _header_json, layout
from elasticd.store.service import CheckpointService
from elasticd.store.shm import CommitPending, OverBudget, SlotStore
from elasticd.testing.transport import InProcessTransport


def _store(root, **kw) -> SlotStore:
    s = SlotStore(root, **kw)
    s.keeps_newest = lambda job: job == "inproc"
    return s


@pytest.fixture
def store(root):
    s = _store(root)
    try:
        yield s
    finally:
        s.close()
    assert not os.path.exists(root)


def header_for(job, rank, step, n=3000):
    lay = layout([TensorSpec("w", "float32", (n,))], job=job, meta={"step": step},
                 block_size=4096)
    return SnapshotHeader(job, step, 0, rank, 4, lay, {"step": step})


def data(step, n=3000):
    return (np.arange(n, dtype=np.float32) + step).tobytes()


def write(store, slot, job, rank, step, n=3000):
    header = header_for(job, rank, step, n)
    e = header.layout.entries[0]
    slot.buffer[e.offset:e.offset + e.nbytes] = data(step, n)
    return store.complete(slot, header)


def snapshot(store, job, rank, step, n=3000):
    """A snapshot as the service takes it: the commit slots, else the newest pair."""
    nbytes = header_for(job, rank, step, n).layout.total_size
    try:
        slot = store.reserve(job, rank, nbytes)
    except CommitPending:
        if not store.keeps_newest(job):
            raise
        slot = store.reserve(job, rank, nbytes, newest=True)
    write(store, slot, job, rank, step, n)
    return slot


def holds(store, job, rank, step, n=3000) -> bool:
    view = store.latest(job, rank, version=(0, step), verify=True, newest=True)
    if view is None:
        return False
    try:
        return entry(view.buffer, "w", np.float32).tobytes() == data(step, n)
    finally:
        view.release()


def test_a_pending_commit_no_longer_makes_a_rank_miss_its_newest_step(store):
    # Step 1 committed (retained job-wide), step 2 acknowledged (retained for rank 0): both
    # commit slots must stay, and on the old code every later snapshot was skipped.
    for job in ("inproc", "other"):
        snapshot(store, job, 0, 1)
        assert store.retain(job, None, (0, 1))
        snapshot(store, job, 0, 2)
        assert store.retain(job, 0, (0, 2))
    for step in (3, 4, 5):
        snapshot(store, "inproc", 0, step)
        assert holds(store, "inproc", 0, step) and holds(store, "inproc", 0, step - 1)
    # The commit slots are as they were: the commit, the acknowledged copy, nothing else
    # listed to replication or persistence; a restore on this node sees the newest pair too.
    assert store.versions("inproc", 0) == [(0, 2), (0, 1)]
    assert store.versions("inproc", 0, newest=True) == [(0, 5), (0, 4), (0, 2), (0, 1)]
    assert store.latest("inproc", 0).header.step == 2
    assert retained(store, "inproc", 0) == {(0, 2)}  # retained for rank 0 ...
    assert retained(store, "inproc") == {(0, 1)}  # ... and for every rank of the job
    # A job that does not keep the newest pair is unchanged: the snapshot is refused.
    with pytest.raises(CommitPending):
        snapshot(store, "other", 0, 3)
    assert store.versions("other", 0, newest=True) == [(0, 2), (0, 1)]


def test_the_copy_a_commit_slot_would_overwrite_is_set_aside(store, root):
    # Step 1 committed; step 2 not acknowledged yet: the next snapshot reuses step 2's commit
    # slot (as before), but step 2 itself stays, in the newest pair, until step 3 completes.
    snapshot(store, "inproc", 0, 1)
    assert store.retain("inproc", None, (0, 1))
    snapshot(store, "inproc", 0, 2)
    slot = store.reserve("inproc", 0, header_for("inproc", 0, 3).layout.total_size)
    assert not slot.newest and holds(store, "inproc", 0, 2) and holds(store, "inproc", 0, 1)
    # The commit slots saw an overwrite: step 2 is gone from them, so an acknowledgement of it
    # arriving now retains nothing (it must not count towards a commit), as before.
    assert store.versions("inproc", 0) == [(0, 1)]
    assert not store.retain("inproc", 0, (0, 2))
    write(store, slot, "inproc", 0, 3)
    assert store.versions("inproc", 0) == [(0, 3), (0, 1)]
    assert store.versions("inproc", 0, newest=True) == [(0, 3), (0, 2), (0, 1)]
    # Files carry their role: the commit's are N.slot, the newest pair's N.newest.
    names = sorted(os.listdir(os.path.join(root, "inproc", "0")))
    assert sum(n.endswith(".slot") for n in names) == 2
    assert sum(n.endswith(".newest") for n in names) >= 1


def test_random_histories_keep_the_commit_safe_and_the_two_newest_steps(store):
    # Every order of snapshots, acknowledgements, commits and withdrawals: a retained copy is
    # never lost; the rank's last two complete steps are held (the newest while the next is
    # written); the commit slots never list a copy of the newest pair.
    rng = random.Random(31)
    for trial in range(30):
        job = "inproc"
        store.remove_job(job)
        committed, acked, done = None, set(), []
        for step in range(1, 40):
            if done and rng.random() < 0.5:  # a peer acknowledged the newest commit-slot copy
                top = store.versions(job, 0)[0]
                if top != committed and store.retain(job, 0, top):
                    acked.add(top)
            if acked and rng.random() < 0.4:  # a commit (of the newest acked) or a withdrawal
                v = max(acked)
                if rng.random() < 0.7:
                    store.retain(job, None, v)
                    if committed is not None:
                        store.release_retained(job, None, committed)
                    committed = v
                for a in [a for a in acked if a <= v]:
                    store.release_retained(job, 0, a)
                    acked.discard(a)
            nbytes = header_for(job, 0, step).layout.total_size
            try:
                slot = store.reserve(job, 0, nbytes)
            except CommitPending:
                slot = store.reserve(job, 0, nbytes, newest=True)
            # Mid-write: the newest complete step stays, and so does every retained copy.
            if done:
                assert holds(store, job, 0, done[-1]), (trial, step)
            for v in acked | ({committed} if committed else set()):
                assert v in store.versions(job, 0), (trial, step, v)
            write(store, slot, job, 0, step)
            done.append(step)
            assert holds(store, job, 0, step) and (step == 1 or holds(store, job, 0, step - 1))
            assert len(store.versions(job, 0)) <= 2


def test_the_newest_pair_counts_against_the_cap_and_gives_way_to_it(root):
    size = header_for("inproc", 0, 1).layout.total_size
    slot_bytes = -(-size // 4096) * 4096
    # Room for the two commit slots only: the newest pair is not taken, and the commit slots
    # behave exactly as without it (the overwrite goes ahead; a refused snapshot is skipped).
    s = _store(root, cap_bytes=2 * slot_bytes)
    try:
        snapshot(s, "inproc", 0, 1)
        s.retain("inproc", None, (0, 1))
        snapshot(s, "inproc", 0, 2)
        snapshot(s, "inproc", 0, 3)  # step 2 overwritten: no room to set it aside
        assert s.versions("inproc", 0, newest=True) == [(0, 3), (0, 1)]
        s.retain("inproc", 0, (0, 3))
        with pytest.raises(OverBudget):
            snapshot(s, "inproc", 0, 4)
        assert s.bytes_held() == 2 * slot_bytes
    finally:
        s.close()
    # With room for four: the cost is two more slots of the rank's size, held and counted.
    s = _store(root, cap_bytes=4 * slot_bytes)
    try:
        snapshot(s, "inproc", 0, 1)
        s.retain("inproc", None, (0, 1))
        for step in range(2, 7):
            snapshot(s, "inproc", 0, step)
        assert s.bytes_held() == 4 * slot_bytes
        assert s.versions("inproc", 0, newest=True)[:2] == [(0, 6), (0, 5)]
    finally:
        s.close()


def test_a_restarted_daemon_adopts_the_commit_slots_and_drops_the_newest_pair(root):
    s = _store(root)
    snapshot(s, "inproc", 0, 1)
    s.retain("inproc", None, (0, 1))
    for step in (2, 3, 4, 5):
        snapshot(s, "inproc", 0, step)
    assert s.versions("inproc", 0, newest=True) == [(0, 5), (0, 4), (0, 3), (0, 1)]
    s.close(unlink=False)
    again = SlotStore(root)
    try:
        result = again.scan()
        # The committed copy is adopted (the newest pair's newer copies do not push it out).
        assert again.versions("inproc", 0) == [(0, 5), (0, 1)]
        assert sorted(p for p, why in result.removed if "not a slot file" in why)
        assert not [n for n in os.listdir(os.path.join(root, "inproc", "0"))
                    if n.endswith(".newest")]
    finally:
        again.close()


class _Replicator:
    """What the snapshot service tells replication, recorded."""

    def __init__(self, grid=1):
        self.pending, self.local, self.grid = [], [], grid

    def on_commit_pending(self, job, version, skipped=None):
        self.pending.append((job, version, skipped))

    def on_local_snapshot(self, job, rank, version):
        self.local.append((job, rank, version))

    def snapshot_grid(self, job):
        return self.grid

    def status(self):
        return {"jobs": {}}


def _write(t, job, step, world=2):
    """Reserves, fills and completes one snapshot like a worker (test_store_service.py)."""
    lay = layout([TensorSpec("w", "float32", (1000,))], job=job, meta={"step": step})
    reply = t.call("ckpt_reserve", job=job, rank=0, world_size=world, nbytes=lay.total_size,
                   local_world_size=world, step=step, generation=0)
    if reply.get("skip"):
        return reply
    header = SnapshotHeader(job, step, 0, 0, world, lay, {"step": step},
                            (0,) * lay.num_blocks)
    body = json.dumps(_header_json(header)).encode()
    with open(reply["path"], "r+b") as f:
        f.seek(PREAMBLE_SIZE)
        f.write(body)
    t.call("ckpt_complete", job=job, rank=0, ticket=reply["ticket"], header_size=len(body))
    return reply


def test_the_service_takes_refused_and_off_grid_snapshots_into_the_newest_pair(root):
    store = _store(root)
    rep = _Replicator()
    from types import SimpleNamespace

    events = []
    sink = SimpleNamespace(**{kind: (lambda *a, kind=kind: events.append((kind, *a)))
                              for kind in ("snapshot_newest_only", "snapshot_skipped")})
    service = CheckpointService(store, "n1", None, metrics_sink=sink)
    service.replicator = service.snapshots.replicator = rep
    t = InProcessTransport(service.handlers())
    try:
        for job in ("inproc", "other"):
            _write(t, job, 1)
            store.retain(job, None, (0, 1))
            _write(t, job, 2)
            store.retain(job, 0, (0, 2))
        rep.local.clear()
        # Refused by the commit slots: replication is told (its withdrawal clock runs as
        # before), the in-process job's snapshot is taken all the same, and not replicated.
        assert not _write(t, "inproc", 3).get("skip")
        assert _write(t, "other", 3)["skip"]
        assert [(j, v) for j, v, _ in rep.pending] == [("inproc", (0, 2)), ("other", (0, 2))]
        assert rep.local == [] and service.counters["newest_only"] == 1
        # Off the snapshot grid too (commits lag): a snapshot for this node's own restore.
        rep.grid = 4
        assert not _write(t, "inproc", 5).get("skip")
        assert _write(t, "other", 5)["skip"]
        # The metrics tell the two apart, by why the commit slots refused the snapshot: the
        # newest pair's copies cost the training loop a snapshot each, which the restart path
        # skips (elasticd_snapshots_newest_only_total, elasticd_snapshots_skipped_total).
        assert events == [("snapshot_newest_only", "inproc", "commit_pending"),
                         ("snapshot_skipped", "other", "commit_pending"),
                         ("snapshot_newest_only", "inproc", "grid"),
                         ("snapshot_skipped", "other", "grid")]
        # Listed and opened for a restore on this node, checked like any other.
        ram = t.call("ckpt_list", job="inproc", rank=0, world_size=2)["ram"]["0"]
        assert ram == [[0, 5], [0, 3], [0, 2], [0, 1]]
        opened = t.call("ckpt_open", job="inproc", rank=0, generation=0, step=5)
        t.call("ckpt_release", pin=opened["pin"])
        assert not service.book.unprotected("inproc")
    finally:
        store.close()


def test_the_daemon_keeps_the_newest_pair_for_in_process_jobs_only():
    # The job spec opts in (submit --in-process): the daemon wires the store to it.
    from types import SimpleNamespace

    from elasticd.daemon.daemon import _in_process

    records = SimpleNamespace(specs={"a": (1, SimpleNamespace(in_process=True)),
                                     "b": (2, SimpleNamespace(in_process=False))})
    assert _in_process(records, "a")
    assert not _in_process(records, "b") and not _in_process(records, "gone")
