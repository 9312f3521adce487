"""Restore scratch is bounded per job (issue 26, finding 6): each ``ckpt_fetch`` with ``need``
made a segment pinned until ``pin_ttl``, and the node's cap is off by default and shared with
other jobs' replicas, so a job's worker grew the node's memory without bound.

Real slot stores in /dev/shm (removed afterwards) and the real checkpoint service, its
replicator an in-process fake running the real ``fetch_into_scratch``; against real daemons
and a real job: ``tests/integration/test_hostile_worker.py``.
"""

from __future__ import annotations

import mmap
import os
import shutil
import uuid

import pytest

from elasticd.testing.clock import FakeClock
from elasticd.testing.transport import InProcessTransport, TransportError
from elasticd.snapshot.segment import PAGE
from elasticd.store.api import OverBudget, ScratchOverCap
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from tests.unit.test_store_peer_restore import FakeReplicator
from tests.unit.test_store_service import write_snapshot

NEED = [[[3000], ["S0"], [0], [1500]]]


@pytest.fixture
def roots():
    paths = [f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    yield paths
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def test_a_jobs_scratch_and_bookings_stay_under_its_cap_and_other_jobs_keep_theirs(roots):
    store = SlotStore(roots[0], job_scratch_cap=4 * PAGE, scratch_keep=0)  # drop: gone
    try:
        one = store.scratch.new(3 * PAGE, job="a")
        with pytest.raises(ScratchOverCap) as exc:
            store.scratch.new(2 * PAGE, job="a")
        assert str(exc.value) == (f"job a: {2 * PAGE} more bytes of restore scratch would hold "
                                  f"{5 * PAGE}, over its cap of {4 * PAGE} on this node "
                                  "(scratch_cap_mib)")
        assert isinstance(exc.value, OverBudget)  # callers that handle the node cap handle it
        other = store.scratch.new(4 * PAGE, job="b")  # per job: b has its own
        with pytest.raises(ScratchOverCap):
            store.scratch.reserve("a", 2 * PAGE)  # a booking counts like a segment
        store.scratch.drop(one)
        booking = store.scratch.reserve("a", 3 * PAGE)
        assert store.scratch.held("a") == 3 * PAGE and store.scratch.held() == 7 * PAGE
        with pytest.raises(ScratchOverCap):
            store.scratch.new(2 * PAGE, job="a")  # the booking holds 3 of the 4 pages
        made = store.scratch.new(4 * PAGE, job="a", reservation=booking)  # takes the booking over
        assert store.scratch.held("a") == 4 * PAGE
        booking.release()  # used: nothing more to give back
        assert store.scratch.held("a") == 4 * PAGE
        store.scratch.drop(made)
        store.scratch.drop(other)
        later = store.scratch.reserve("a", PAGE)
        later.release()
        later.release()
        assert store.scratch.held() == 0 and store.bytes_held() == 0
    finally:
        store.close()


def test_a_booking_counts_against_the_nodes_cap_too(roots):
    store = SlotStore(roots[0], cap_bytes=4 * PAGE, job_scratch_cap=8 * PAGE, scratch_keep=0)
    try:
        store.scratch.reserve("a", 3 * PAGE)
        with pytest.raises(OverBudget, match="of the node's"):
            store.scratch.new(2 * PAGE, job="b")
        assert store.bytes_held() == 3 * PAGE
    finally:
        store.close()


@pytest.mark.parametrize("keep", [0.0, 30.0])
def test_a_dropped_scratch_gives_its_memory_back_though_a_worker_still_maps_it(roots, keep):
    """Deleted at once (keep 0), or kept for the job's next restore (issue 30) and counted
    against its cap all the while, then deleted: either way emptied, mapped or not."""
    clock = FakeClock()
    store = SlotStore(roots[0], job_scratch_cap=64 * PAGE, scratch_keep=keep, clock=clock)
    try:
        segment = store.scratch.new(64 * PAGE, job="a")
        segment.reserve_range(0, 64 * PAGE)
        segment.view[:] = b"x" * (64 * PAGE)
        fd = segment.descriptor(writable=False)  # what the worker was handed
        kept = mmap.mmap(fd, 64 * PAGE, prot=mmap.PROT_READ)  # and mapped, and never unmaps
        assert os.fstat(fd).st_blocks * 512 >= 64 * PAGE
        store.scratch.drop(segment)
        if keep:
            assert store.scratch.held("a") == 64 * PAGE  # kept: still the job's, still counted
            with pytest.raises(ScratchOverCap):
                store.scratch.reserve("b", 65 * PAGE)  # (b's own cap)
            assert os.fstat(fd).st_blocks * 512 >= 64 * PAGE
            clock.advance(keep + 1)
            store.scratch.sweep()
        st = os.fstat(fd)
        assert st.st_size == 0 and st.st_blocks == 0  # the pages are gone, not just the name
        assert store.scratch.held() == 0
        kept.close()
        os.close(fd)
    finally:
        store.close()


def test_kept_scratch_gives_way_to_its_jobs_cap_and_the_nodes(roots):
    """Scratch kept for a job's next restore never causes a refusal: a new partial copy over
    the job's cap, or a slot over the node's, deletes kept segments first."""
    store = SlotStore(roots[0], cap_bytes=7 * PAGE, job_scratch_cap=4 * PAGE)
    try:
        first = store.scratch.new(3 * PAGE, job="a")
        store.scratch.drop(first)  # kept: 3 of a's 4 pages
        second = store.scratch.new(PAGE, job="a")  # fits beside it
        store.scratch.drop(second)
        big = store.scratch.new(4 * PAGE, job="a")  # not without deleting both
        assert not os.path.exists(first.path) and not os.path.exists(second.path)
        assert store.scratch.held("a") == 4 * PAGE
        store.scratch.drop(big)
        other = store.scratch.new(4 * PAGE, job="b")  # the node's cap: a's kept copy goes
        assert not os.path.exists(big.path) and store.scratch.held() == 4 * PAGE
        store.scratch.drop(other)
    finally:
        store.close()


@pytest.fixture
def service(roots):
    local = SlotStore(roots[0], job_scratch_cap=PAGE * 16, scratch_keep=0)
    peer = SlotStore(roots[1])
    svc = CheckpointService(local, "n1", replicator=FakeReplicator(local, peer))
    try:
        yield svc, InProcessTransport(svc.handlers()), InProcessTransport(
            CheckpointService(peer, "n2").handlers())
    finally:
        local.close()
        peer.close()


def fetch(t, rank: int, pid: int) -> dict:
    """``ckpt_fetch`` with ``need``, as the worker of pid ``pid`` (the socket's credentials)."""
    t.peer["pid"] = pid
    return t.call("ckpt_fetch", job="job", rank=rank, generation=0, step=4, need=NEED)


def test_one_live_partial_copy_per_rank_and_caller(service):
    svc, t, t2 = service
    for rank in (0, 1):
        write_snapshot(t2, "job", rank, step=4, world=2)
    first = fetch(t, 0, pid=10)
    size = svc.store.scratch.held("job")
    assert size > 0 and os.path.exists(first["path"])
    again = fetch(t, 0, pid=10)  # the same worker asks again for rank 0: the first goes
    assert not os.path.exists(first["path"]) and svc.store.scratch.held("job") == size
    beside = [fetch(t, 0, pid=11), fetch(t, 1, pid=10)]  # another worker; another rank
    assert svc.store.scratch.held("job") == 3 * size
    for reply in (again, *beside):
        t.call("ckpt_release", pin=reply["pin"])
    t.call("ckpt_release", pin=first["pin"])  # already given back: nothing happens
    assert svc.store.scratch.held("job") == 0


def test_a_fetch_over_the_jobs_cap_is_refused_in_one_line_counted_and_shown(service, caplog):
    svc, t, t2 = service
    for rank in range(8):
        write_snapshot(t2, "job", rank, step=4, world=8, n=3000)  # 4 pages each
    held = []
    with pytest.raises(TransportError) as exc:
        for rank in range(8):  # a worker that never releases
            held.append(fetch(t, rank, pid=10))
    line = str(exc.value)
    assert "\n" not in line and "cannot fetch job rank" in line
    assert "over its cap of 65536 on this node (scratch_cap_mib)" in line
    assert 0 < len(held) < 8 and svc.store.scratch.held("job") <= 16 * PAGE
    with pytest.raises(TransportError, match="scratch_cap_mib"):
        fetch(t, 7, pid=10)
    status = svc.status()["job"]["scratch"]
    assert status == {"bytes": svc.store.scratch.held("job"), "cap": 16 * PAGE, "refused": 2}
    assert svc.counters["scratch_refused"] == 2 and svc.stats().scratch_bytes == status["bytes"]
    assert sum("REFUSED restore scratch" in r.message for r in caplog.records) == 1
    for reply in held:  # released: room again
        t.call("ckpt_release", pin=reply["pin"])
    t.call("ckpt_release", pin=fetch(t, 7, pid=10)["pin"])


def test_a_membership_change_sets_scratch_aside_within_the_jobs_cap(roots):
    """When a node of the job fails, the service sets aside (touched, by a thread) a scratch
    segment per snapshot of the job it holds: counted against the job's cap from then on,
    reused by the restore's partial copy, and left out (not refused, not counted as refused)
    when the cap has no room."""
    import threading

    from elasticd.testing.transport import InProcessTransport as Local

    store = SlotStore(roots[0], job_scratch_cap=16 * PAGE)
    try:
        svc = CheckpointService(store, "n1")
        t = Local(svc.handlers())
        write_snapshot(t, "job", 0, step=4, world=2, n=3000)  # 4 pages with its header
        size = store.latest("job", 0).header.layout.total_size
        assert svc.restores.membership_changed("other-job") == 0  # holds nothing of that job
        aside = svc.restores.membership_changed("job")
        assert aside == -(-size // PAGE) * PAGE and store.scratch.held("job") == aside
        for thread in threading.enumerate():  # the pages are touched by a thread of its own
            if thread.name == "elasticd-scratch-job":
                thread.join(10)
        segment = store.scratch.new(size, job="job")  # the restore's partial copy: the same one
        fd = segment.descriptor(writable=False)
        assert os.fstat(fd).st_blocks * 512 >= size  # touched before the restore asked
        os.close(fd)
        assert store.scratch.held("job") == aside
        store.scratch.drop(segment)
        crowded = SlotStore(roots[1], job_scratch_cap=PAGE)  # no room under the cap
        try:
            other = CheckpointService(crowded, "n2")
            write_snapshot(Local(other.handlers()), "job", 0, step=4, world=2, n=3000)
            assert other.restores.membership_changed("job") == 0 and crowded.scratch.held() == 0
            assert other.counters.get("scratch_refused", 0) == 0
        finally:
            crowded.close()
    finally:
        store.close()


def test_scratch_set_aside_again_still_goes_to_the_next_copy_of_its_rank(roots):
    """A membership change sets scratch aside (``prefill``) by taking the segments the last
    restore released, as they fit: each must still go to the next copy of the old rank it
    last held, whose pages it touched and the worker keeps mapped (worker/scratch_maps.py).
    Set aside as a copy of nothing, it went to whichever rank asked first."""
    import threading

    from elasticd.testing.transport import InProcessTransport as Local

    store = SlotStore(roots[0], job_scratch_cap=64 * PAGE)
    try:
        svc = CheckpointService(store, "n1")
        write_snapshot(Local(svc.handlers()), "job", 0, step=4, world=2, n=3000)
        size = store.latest("job", 0).header.layout.total_size
        one, two = (store.scratch.new(size, job="job", of=r) for r in (1, 2))
        store.scratch.drop(one)  # the last restore's copies of old ranks 1 and 2, released
        store.scratch.drop(two)
        assert svc.restores.membership_changed("job") > 0  # takes rank 1's (the first that fits) ...
        for thread in threading.enumerate():
            if thread.name == "elasticd-scratch-job":
                thread.join(10)
        assert store.scratch.new(size, job="job", of=1) is one  # ... and it is still rank 1's
        assert store.scratch.new(size, job="job", of=2) is two
        # Counted (a bench reads it): 2 files made, 1 set aside, 2 back to their own rank, none
        # to another rank's (the set-aside one is not counted as that).
        assert store.scratch.handed == {"same": 2, "other": 0, "aside": 1, "new": 2}
    finally:
        store.close()


class _Sessions(FakeReplicator):
    """A replicator whose transport can hand sessions over, or not (TLS)."""

    def __init__(self, local, peer, tls: bool) -> None:
        super().__init__(local, peer)
        self.connections = type("Connections", (), {"ssl_context": object() if tls else None})()


#: An FSDP2 state's meta, as far as the daemon reads it: one DTensor entry.
DTENSOR_META = {"v": 1, "objects": [["model", "module", {"@": "odict", "k": ["w"], "v": [
    {"@": "dtensor", "i": 0, "shape": [6000], "offsets": [0], "placements": ["S0"],
     "mesh": [2]}]}]]}


@pytest.mark.parametrize("meta,tls,aside", [(DTENSOR_META, False, False),
                                            (DTENSOR_META, True, True),
                                            (None, False, True)],
                         ids=["fsdp2: its workers fetch", "fsdp2 over TLS", "replicated"])
def test_scratch_is_set_aside_only_for_a_restore_that_uses_it(roots, meta, tls, aside):
    """A job whose reshard is the workers' own fetch (DTensors, sessions that can be handed
    over: worker/direct.py) never lands in restore scratch: none is set aside for it (it
    would take RAM and CPU from the recovery). Over TLS, or for a replicated state, it is."""
    store, peer = SlotStore(roots[0], job_scratch_cap=16 * PAGE), SlotStore(roots[1])
    try:
        svc = CheckpointService(store, "n1", replicator=_Sessions(store, peer, tls))
        write_snapshot(InProcessTransport(svc.handlers()), "job", 0, step=4, world=2, n=3000,
                       meta=meta)
        got = svc.restores.membership_changed("job")
        assert (got > 0) == aside and (store.scratch.held("job") > 0) == aside, got
    finally:
        store.close()
        peer.close()
