"""The shared-memory slot store: double buffering, growth, the cap, pins, restart scan, cleanup.

Runs on real tmpfs (a unique /dev/shm subdirectory per test, removed afterwards) because
fallocate and page pre-touching behave differently there than on a disk filesystem.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from elasticd.testing.clock import FakeClock

from elasticd.snapshot import segment as segment_module
from elasticd.snapshot.format import CorruptSnapshot, SnapshotHeader, TensorSpec, layout
from tests.snapshot_entries import entry, named
from tests.store_retained import retained
from elasticd.store.shm import (
    PAGE,
    CommitPending,
    OverBudget,
    SlotBusy,
    SlotStore,
    StaleSlot,
)


@pytest.fixture
def store(root):
    s = SlotStore(root)
    try:
        yield s
    finally:
        s.close()
    assert not os.path.exists(root), "close() must leave nothing behind"


def arrays_for(step: int, n: int = 3000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(n).astype(np.float32), "step": np.array(step, np.int64)}


def plan(job, rank, arrays, step, generation=0):
    specs = [TensorSpec(k, str(v.dtype), v.shape) for k, v in arrays.items()]
    lay = layout(specs, job=job, meta={"step": step}, block_size=4096)
    return SnapshotHeader(job, step, generation, rank, 4, lay, {"step": step})


def fill(buf, header, arrays) -> None:
    for e in header.layout.entries:
        buf[e.offset : e.offset + e.nbytes] = arrays[e.name].tobytes()


def snapshot(store, job, rank, step, n=3000, generation=0):
    arrays = arrays_for(step, n)
    header = plan(job, rank, arrays, step, generation)
    slot = store.reserve(job, rank, header.layout.total_size)
    fill(slot.buffer, header, arrays)
    return store.complete(slot, header), slot


def assert_holds(store, job, rank, step, n=3000):
    view = store.latest(job, rank, verify=True)
    assert view is not None and view.header.step == step
    for name, arr in arrays_for(step, n).items():
        assert entry(view.buffer, name, arr.dtype).tobytes() == arr.tobytes()


def files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, fs in os.walk(root) for f in fs)


def test_reserve_complete_latest(store, root):
    assert store.latest("job", 0) is None
    header, slot = snapshot(store, "job", 0, step=1)
    assert slot.capacity % PAGE == 0 and slot.capacity >= header.layout.total_size
    assert_holds(store, "job", 0, 1)
    # Both slots exist from the first use, pre-allocated.
    assert files(root) == ["job/0/0.slot", "job/0/1.slot"]
    assert store.bytes_held() == 2 * slot.capacity
    assert store.holdings() == [("job", 0, 0, 1)]


def test_a_one_off_copy_allocates_one_slot_and_the_next_snapshot_the_other(store, root):
    arrays = arrays_for(1)
    header = plan("job", 0, arrays, 1)
    slot = store.reserve("job", 0, header.layout.total_size, both=False)  # a fetched shard
    fill(slot.buffer, header, arrays)
    store.complete(slot, header)
    assert files(root) == ["job/0/0.slot"] and store.bytes_held() == slot.capacity
    assert_holds(store, "job", 0, 1)
    # This node goes on snapshotting that rank: the other slot comes with its first snapshot,
    # and the fetched copy stays the latest until that one completes.
    _, second = snapshot(store, "job", 0, step=2)
    assert second.path != slot.path
    assert files(root) == ["job/0/0.slot", "job/0/1.slot"]
    assert_holds(store, "job", 0, 2)


def test_double_buffering_never_overwrites_the_last_complete_snapshot(store):
    _, first = snapshot(store, "job", 0, step=1)
    slot = store.reserve("job", 0, first.capacity)
    assert slot.path != first.path
    slot.buffer[:] = b"\xab" * slot.capacity  # a worker dies halfway through step 2
    assert_holds(store, "job", 0, 1)
    # The crashed reservation is simply reused by the next one; the old ticket is stale.
    again = store.reserve("job", 0, first.capacity)
    assert again.path == slot.path
    with pytest.raises(StaleSlot):
        store.complete(slot, plan("job", 0, arrays_for(2), 2))
    arrays = arrays_for(2)
    header = plan("job", 0, arrays, 2)
    fill(again.buffer, header, arrays)
    store.complete(again, header)
    assert_holds(store, "job", 0, 2)
    third = store.reserve("job", 0, first.capacity)
    assert third.path == first.path  # alternates, never the latest
    third.buffer[:100] = bytes(100)
    assert_holds(store, "job", 0, 2)


def test_a_copy_retained_for_every_rank_outlives_newer_ones(store):
    # Step 1 is committed (retained job-wide); the commit then stalls (a peer paused or
    # draining) while this rank keeps snapshotting: steps 2, 3, 4 take turns in the other slot.
    snapshot(store, "job", 0, step=1)
    assert store.retain("job", None, (0, 1))
    for step in (2, 3, 4):
        snapshot(store, "job", 0, step=step)
        assert store.versions("job", 0) == [(0, step), (0, 1)]
        assert_holds(store, "job", 0, step)
    # While the newer copy is being overwritten the retained one is the latest complete one.
    slot = store.reserve("job", 0, 100)
    slot.buffer[:100] = bytes(100)
    assert_holds(store, "job", 0, 1)
    assert store.latest("job", 0, version=(0, 1)) is not None
    # A reader pinning the newer copy (a push to a peer that stopped answering): the snapshot
    # is refused rather than evict the retained copy, the only one this node has.
    snapshot(store, "job", 0, step=5)
    pinned = store.latest("job", 0, pin=True)
    with pytest.raises(SlotBusy, match="must stay"):
        store.reserve("job", 0, 100)
    assert store.versions("job", 0) == [(0, 5), (0, 1)]
    pinned.release()
    snapshot(store, "job", 0, step=6)  # released: the newer copy's slot is reused
    assert store.versions("job", 0) == [(0, 6), (0, 1)]
    # Another version retained, the first let go: plain alternation around the new one.
    store.retain("job", None, (0, 6))
    store.release_retained("job", None, (0, 1))
    snapshot(store, "job", 0, step=7)
    snapshot(store, "job", 0, step=8)
    assert store.versions("job", 0) == [(0, 8), (0, 6)]
    store.release_retained("job", None, (0, 6))
    snapshot(store, "job", 0, step=9)
    assert store.versions("job", 0) == [(0, 9), (0, 8)]
    assert not retained(store, "job") and not retained(store, "job", 0)


def test_two_retained_copies_refuse_the_next_snapshot_until_one_is_released(store):
    # Step 1 retained for every rank (committed), step 2 of rank 0 too (acknowledged, may be
    # committed): neither slot may be reused, the snapshot is skipped.
    snapshot(store, "job", 0, step=1)
    store.retain("job", None, (0, 1))
    snapshot(store, "job", 0, step=2)
    assert store.retain("job", 0, (0, 2))
    assert retained(store, "job", 0) == {(0, 2)} and retained(store, "job") == {(0, 1)}
    with pytest.raises(CommitPending) as info:
        store.reserve("job", 0, 100)
    assert info.value.version == (0, 2)
    assert store.versions("job", 0) == [(0, 2), (0, 1)]
    assert_holds(store, "job", 0, 2)
    store.release_retained("job", 0, (0, 2))
    snapshot(store, "job", 0, step=3)
    assert store.versions("job", 0) == [(0, 3), (0, 1)]
    # A copy no longer held cannot be retained (its acknowledgement must not count).
    assert not store.retain("job", 0, (0, 2))
    # Two copies of one rank retained: the older one is reported.
    snapshot(store, "new", 0, step=1)
    snapshot(store, "new", 0, step=2)
    assert store.retain("new", 0, (0, 1)) and store.retain("new", 0, (0, 2))
    with pytest.raises(CommitPending) as info:
        store.reserve("new", 0, 100)
    assert info.value.version == (0, 1)
    assert isinstance(info.value, SlotBusy)  # callers that only know SlotBusy skip it too


def test_growth_replaces_the_free_slot_with_a_bigger_file(store, root):
    _, small = snapshot(store, "job", 1, step=1, n=100)
    held = store.bytes_held()
    _, big = snapshot(store, "job", 1, step=2, n=50_000)
    assert big.capacity > small.capacity and big.path not in (small.path,)
    assert_holds(store, "job", 1, 2, n=50_000)
    assert store.bytes_held() == held - small.capacity + big.capacity
    _, big2 = snapshot(store, "job", 1, step=3, n=50_000)  # the other slot grows too
    assert_holds(store, "job", 1, 3, n=50_000)
    assert store.bytes_held() == big.capacity + big2.capacity
    assert len(files(root)) == 2


def test_cap_is_enforced_and_leaves_the_store_unchanged(root):
    store = SlotStore(root, cap_bytes=5 * PAGE)
    try:
        snapshot(store, "job", 0, step=1, n=100)  # 2 slots of 2 pages (header page + data)
        held = store.bytes_held()
        assert held == 4 * PAGE
        with pytest.raises(OverBudget, match=f"{held} of the {5 * PAGE}-byte cap are held"):
            store.reserve("job", 1, 100)
        with pytest.raises(OverBudget):
            store.reserve("job", 0, 10 * PAGE)  # growing the free slot would also exceed it
        assert store.bytes_held() == held
        assert_holds(store, "job", 0, 1, n=100)
        snapshot(store, "job", 0, step=2, n=100)  # same size still fits
    finally:
        store.close()


def test_a_scratch_copy_counts_against_the_cap_and_never_survives_a_restart(root):
    """A partial copy for one restore read: outside every (job, rank), within the cap, gone
    at scratch.drop, and removed by the next daemon's scan when the last one died with it."""
    store = SlotStore(root, cap_bytes=5 * PAGE, scratch_keep=0)
    snapshot(store, "job", 0, step=1, n=100)  # 4 pages of slots
    with pytest.raises(OverBudget, match="partial copy"):
        store.scratch.new(PAGE + 1, job="job")  # 2 pages more exceed the 5-page cap: refused
    assert not [f for f in files(root) if ".scratch" in f]
    one = store.scratch.new(PAGE, job="job")
    assert store.bytes_held() == 5 * PAGE and os.path.basename(one.path).startswith(".scratch-")
    assert store.versions("job", 0) == [(0, 1)] and store.holdings() == [("job", 0, 0, 1)]
    store.scratch.drop(one)
    assert store.bytes_held() == 4 * PAGE and not os.path.exists(one.path)
    left = store.scratch.new(PAGE, job="job")
    store.close(unlink=False)  # a daemon that stops: its slots stay, its scratch does not
    assert not os.path.exists(left.path)
    # One that died (kill -9) left a scratch file: the next daemon's scan removes it, emptied
    # first, so a worker that keeps it open (a kept mapping, worker/scratch_maps.py) holds none
    # of its pages.
    with open(os.path.join(root, ".scratch-7"), "wb") as f:
        f.write(b"x" * PAGE)
    worker_fd = os.open(os.path.join(root, ".scratch-7"), os.O_RDONLY)
    again = SlotStore(root)
    try:
        result = again.scan()
        assert any(path.endswith(".scratch-7") for path, _ in result.removed)
        assert not os.path.exists(os.path.join(root, ".scratch-7"))
        assert os.fstat(worker_fd).st_size == 0
        assert_holds(again, "job", 0, 1, n=100)
    finally:
        os.close(worker_fd)
        again.close()
    # A scratch name that is a second link to a file living elsewhere is removed, not emptied.
    elsewhere = f"{root}-elsewhere"  # same filesystem (a link), removed below
    with open(elsewhere, "wb") as f:
        f.write(b"y" * PAGE)
    again = None
    try:
        again = SlotStore(root)
        os.link(elsewhere, os.path.join(root, ".scratch-8"))
        again.scan()
        assert not os.path.exists(os.path.join(root, ".scratch-8"))
        assert os.path.getsize(elsewhere) == PAGE
    finally:
        os.unlink(elsewhere)
        if again is not None:
            again.close()


def test_released_scratch_is_kept_touched_for_its_jobs_next_restore(root):
    """A partial copy let go of stays, its pages touched, for the same job's next one (the
    first touch of fresh memory costs as much as the transfer), within the cap, and no other
    job is handed it (it holds the bytes of the copy it held). It goes when it expires, when
    the job leaves the node, and first when a reservation needs the room."""
    clock = FakeClock()
    store = SlotStore(root, scratch_keep=30.0, clock=clock)
    try:
        one = store.scratch.new(4 * PAGE, job="a")
        one.reserve_range(0, 4 * PAGE)
        one.view[PAGE : PAGE + 5] = b"rows!"
        store.scratch.drop(one)
        assert store.bytes_held() == 4 * PAGE and os.path.exists(one.path)  # kept, counted
        other = store.scratch.new(4 * PAGE, job="b")  # another job: never that segment
        assert other is not one and other.path != one.path
        store.scratch.drop(other)
        small = store.scratch.new(PAGE, job="a")
        assert small is not one  # far bigger than asked: not that one
        store.scratch.drop(small)
        again = store.scratch.new(3 * PAGE + 1, job="a")
        assert again is one and bytes(again.view[PAGE : PAGE + 5]) == b"rows!"  # still touched
        store.scratch.drop(again)
        clock.advance(31.0)
        store.scratch.sweep()
        assert not os.path.exists(one.path) and not os.path.exists(other.path)
        # It goes when its job leaves the node...
        last = store.scratch.new(PAGE, job="a")
        store.scratch.drop(last)
        store.remove_job("a")
        assert not os.path.exists(last.path) and store.bytes_held() == 0
    finally:
        store.close()
    # ... and first when a reservation needs the room.
    capped = SlotStore(root + "-capped", cap_bytes=6 * PAGE, scratch_keep=30.0, clock=clock)
    try:
        kept = capped.scratch.new(4 * PAGE, job="a")
        capped.scratch.drop(kept)
        snapshot(capped, "job", 0, step=1, n=100)  # 4 pages of slots: 4 kept + 4 > 6
        assert not os.path.exists(kept.path) and capped.bytes_held() == 4 * PAGE
    finally:
        capped.close()


def test_scratch_ranges_are_reserved_in_small_pages(root):
    """Scratch pages are faulted in one small page at a time through the daemon's mapping
    (tests/unit/test_huge_pages.py checks the same on a huge-page mount)."""
    store = SlotStore(root, scratch_keep=0)
    try:
        seg = store.scratch.new(8 << 20, job="job")
        assert seg.small_pages
        seg.reserve_range(PAGE + 1, 3 * PAGE)  # whole small pages: [PAGE, 3 PAGE)
        assert os.stat(seg.path).st_blocks * 512 == 2 * PAGE
        seg.view[PAGE : 3 * PAGE] = b"\1" * (2 * PAGE)
    finally:
        store.close()


def test_reserved_scratch_ranges_are_not_populated_again(root, monkeypatch):
    """A range of a segment already reserved (scratch kept from the last restore, or pieces
    reserved before) is not faulted in again, while any page outside what was reserved is:
    populating a reused 727 MB segment again walked every page for nothing."""
    store = SlotStore(root, scratch_keep=0)
    try:
        seg = store.scratch.new(16 * PAGE, job="job")
        real, calls = segment_module.populate, []

        def counting(mm, start, length):
            calls.append((start, length))
            return real(mm, start, length)

        monkeypatch.setattr(segment_module, "populate", counting)
        seg.reserve_range(0, 4 * PAGE)
        seg.reserve_range(4 * PAGE, 8 * PAGE)  # adjacent: one reserved range [0, 8 PAGE)
        seg.reserve_range(10 * PAGE, 12 * PAGE)
        assert calls == [(0, 4 * PAGE), (4 * PAGE, 4 * PAGE), (10 * PAGE, 2 * PAGE)]
        seg.reserve_range(PAGE + 1, 7 * PAGE)  # within the first: nothing to do
        seg.reserve_range(10 * PAGE, 12 * PAGE)
        assert len(calls) == 3
        seg.reserve_range(7 * PAGE, 11 * PAGE)  # pages 8 and 9 were never reserved
        assert calls[3:] == [(7 * PAGE, 4 * PAGE)]
        seg.reserve_range(0, 12 * PAGE)  # now all one range
        assert len(calls) == 4
        assert os.stat(seg.path).st_blocks * 512 == 12 * PAGE
    finally:
        store.close()


def test_pinned_view_blocks_reuse_until_released(store):
    snapshot(store, "job", 0, step=1)
    view = store.latest("job", 0, pin=True)
    snapshot(store, "job", 0, step=2)  # goes to the other slot
    with pytest.raises(SlotBusy):
        store.reserve("job", 0, 100)
    assert entry(view.buffer, "step", np.int64) == 1
    view.release()
    current = store.latest("job", 0, pin=True)
    assert current.header.step == 2
    current.release()
    store.reserve("job", 0, 100)


def test_replica_path_verifies_the_given_checksums(store):
    source, _ = snapshot(store, "job", 0, step=4)
    payload = bytes(store.latest("job", 0).buffer)
    slot = store.reserve("job", 2, source.layout.total_size)
    replica = dataclasses.replace(source, rank=2)
    slot.buffer[: len(payload)] = payload
    slot.buffer[source.layout.entries[0].offset] ^= 1
    with pytest.raises(CorruptSnapshot, match="checksum"):
        store.complete(slot, replica)
    slot.buffer[source.layout.entries[0].offset] ^= 1
    assert store.complete(slot, replica).blocks == source.blocks
    assert store.latest("job", 2, verify=True).header.step == 4


def test_the_tagger_runs_at_each_local_seal_and_its_result_rides_with_the_view(store):
    calls = []

    def tagger(view, ranges):
        calls.append((len(view), ranges))
        return ("tags", len(calls))

    store.tagger = tagger
    header, _ = snapshot(store, "job", 0, step=1, n=3000)
    lay = header.layout
    assert calls[0][1] == [lay.block_range(i) for i in range(lay.num_blocks)]
    assert lay.num_blocks == 3  # 12 KB of payload in 4 KiB blocks
    assert store.latest("job", 0).tags == ("tags", 1)
    snapshot(store, "job", 0, step=2)
    assert store.latest("job", 0).tags == ("tags", 2)
    # A replica arrives with its checksums and is only verified: nothing to tag.
    payload = bytes(store.latest("job", 0).buffer)
    slot = store.reserve("job", 3, header.layout.total_size)
    slot.buffer[: len(payload)] = payload
    source = store.latest("job", 0).header
    store.complete(slot, dataclasses.replace(source, rank=3))
    assert len(calls) == 2 and store.latest("job", 3).tags is None
    # The slot of step 1 is reserved again for step 3: its old tags go with its old bytes.
    slot = store.reserve("job", 0, header.layout.total_size)
    assert all(s is None or s.tags in (None, ("tags", 2))
               for s in store._pairs[("job", 0)].segments)


def test_bad_arguments_are_refused(store):
    with pytest.raises(ValueError, match="job name"):
        store.reserve("../etc", 0, 100)
    with pytest.raises(ValueError, match="positive"):
        store.reserve("job", 0, 0)
    slot = store.reserve("job", 0, 8 * PAGE)
    with pytest.raises(ValueError, match="slot of job rank 0"):
        store.complete(slot, plan("job", 1, arrays_for(1), 1))
    with pytest.raises(ValueError, match="exceeds"):
        store.complete(slot, plan("job", 0, arrays_for(1, n=100_000), 1))


def test_a_worker_process_writes_through_its_own_mapping(store):
    arrays = arrays_for(9)
    header = plan("job", 3, arrays, 9)
    slot = store.reserve("job", 3, header.layout.total_size)
    code = (
        "import os, sys, numpy as np; from elasticd.store.shm import map_fd\n"
        "mm = map_fd(os.open(sys.argv[1], os.O_RDWR), int(sys.argv[2]))\n"
        "w = np.random.default_rng(9).standard_normal(3000).astype(np.float32)\n"
        "off = [int(x) for x in sys.argv[3:]]\n"
        "mm[off[0]:off[0] + w.nbytes] = w.tobytes()\n"
        "mm[off[1]:off[1] + 8] = np.array(9, np.int64).tobytes()\n"
        "mm.close()\n"
    )
    offsets = [str(named(header.layout, n).offset) for n in ("w", "step")]
    subprocess.run([sys.executable, "-c", code, slot.path, str(slot.capacity), *offsets],
                   check=True, timeout=60)
    store.complete(slot, header)
    assert_holds(store, "job", 3, 9)


def test_restart_scan_keeps_verified_segments_and_removes_the_rest(root):
    first = SlotStore(root)
    snapshot(first, "job", 0, step=1)
    snapshot(first, "job", 0, step=2)
    rotten, corrupt = snapshot(first, "job", 1, step=5)
    snapshot(first, "job", 2, step=3)
    half = first.reserve("job", 2, 100)  # crashed mid-snapshot: invalidated, never sealed
    first.close(unlink=False)
    with open(corrupt.path, "r+b") as f:  # bit rot in rank 1's payload
        f.seek(named(rotten.layout, "w").offset + 10)
        f.write(b"\xff")
    good = os.path.join(root, "job", "0", "1.slot")
    with open(good, "rb") as f, open(os.path.join(root, "job", "0", "7.slot"), "wb") as g:
        g.write(f.read()[:5000])  # truncated copy
    with open(os.path.join(root, "junk.txt"), "w") as f:
        f.write("x")
    os.makedirs(os.path.join(root, "bad name!"))
    os.makedirs(os.path.join(root, "job", "not-a-rank"))

    second = SlotStore(root)
    try:
        result = second.scan()
        assert sorted(result.kept) == [("job", 0, 0, 1), ("job", 0, 0, 2), ("job", 2, 0, 3)]
        removed = {os.path.relpath(p, root): why for p, why in result.removed}
        assert "checksum" in removed[os.path.relpath(corrupt.path, root)]
        assert "magic" in removed[os.path.relpath(half.path, root)]
        assert "short" in removed["job/0/7.slot"]
        assert {"junk.txt", "bad name!", "job/not-a-rank"} <= set(removed)
        assert files(root) == ["job/0/0.slot", "job/0/1.slot", "job/2/0.slot"]
        assert_holds(second, "job", 0, 2)
        assert_holds(second, "job", 2, 3)
        assert second.latest("job", 1) is None
        # The adopted pair keeps alternating: the next slot is the older snapshot's, not step 2's.
        assert second.reserve("job", 0, 100).path.endswith("/0.slot")
        assert_holds(second, "job", 0, 2)
        snapshot(second, "job", 1, step=6)  # new files never collide with adopted ones
        assert_holds(second, "job", 1, 6)
    finally:
        second.close()
    assert not os.path.exists(root)


def test_remove_and_remove_job_unlink_everything(store, root):
    snapshot(store, "a", 0, step=1)
    snapshot(store, "a", 1, step=1)
    snapshot(store, "b", 0, step=1)
    view = store.latest("a", 0)  # a live reader does not keep the files alive
    store.remove("a", 1)
    assert store.latest("a", 1) is None and not os.path.exists(os.path.join(root, "a", "1"))
    store.remove_job("a")
    assert not os.path.exists(os.path.join(root, "a"))
    # The mapping lingers until the reader lets go.
    assert entry(view.buffer, "step", np.int64) == 1
    assert files(root) == ["b/0/0.slot", "b/0/1.slot"]
    assert store.holdings() == [("b", 0, 0, 1)]
    store.remove_job("b")
    assert store.bytes_held() == 0 and files(root) == []


def test_daemon_side_modules_do_not_import_torch():
    code = ("import sys, elasticd.store.shm, elasticd.snapshot.reader, "
            "elasticd.store.api; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
