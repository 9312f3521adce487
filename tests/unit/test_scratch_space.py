"""The slot store's restore scratch alone (:mod:`elasticd.store.scratch_space`): its files on a
real tmpfs root, the node's cap shared with slot bytes the store reports, kept segments that give
way to slots, and the lock every call takes (the store's)."""

from __future__ import annotations

import os
import shutil
import threading
import uuid

import pytest

from elasticd.snapshot.segment import PAGE
from elasticd.store.api import OverBudget, ScratchOverCap
from elasticd.store.scratch_space import ScratchSpace
from elasticd.store.shm_root import claim_root
from elasticd.testing.clock import FakeClock


class Host:
    """What the store gives its scratch: a root, its lock, its slot bytes."""

    def __init__(self, root: str, cap: int | None, job_cap: int | None, keep: float = 30.0):
        self.fd, self.lock, self.slots = claim_root(root), threading.Lock(), 0
        self.clock = FakeClock()
        self.space = ScratchSpace(self.fd, root, self.lock, self._slot_bytes, cap, job_cap, keep,
                                  self._check, self.clock)

    def _slot_bytes(self) -> int:
        assert self.lock.locked()  # the store's slots are read under its lock only
        return self.slots

    @staticmethod
    def _check(job: str) -> None:
        if "/" in job:
            raise ValueError(f"bad job {job!r}")


@pytest.fixture
def host():
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    made = Host(root, cap=8 * PAGE, job_cap=4 * PAGE)
    yield made
    with made.lock:
        made.space.drain_locked()
    os.close(made.fd)
    shutil.rmtree(root, ignore_errors=True)


def test_slot_bytes_count_against_the_nodes_cap(host):
    host.slots = 6 * PAGE
    with pytest.raises(OverBudget, match="partial copy"):
        host.space.new(3 * PAGE, job="a")
    host.slots = 5 * PAGE
    segment = host.space.new(3 * PAGE, job="a")
    assert host.space.held("a") == 3 * PAGE and os.path.exists(segment.path)
    host.slots = 0
    with pytest.raises(ScratchOverCap):
        host.space.reserve("a", 2 * PAGE)  # 5 of the job's 4 pages
    with pytest.raises(ValueError, match="bad job"):
        host.space.new(PAGE, job="a/b")


def test_kept_scratch_gives_way_to_slots_and_expires(host):
    segment = host.space.new(4 * PAGE, job="a")
    host.space.drop(segment)  # kept for a's next restore, still counted
    assert host.space.held("a") == 4 * PAGE and os.path.exists(segment.path)
    with host.lock:
        host.space.make_room_locked(4 * PAGE)  # 4 more of slots fit beside it: it stays
    assert os.path.exists(segment.path)
    host.slots = 4 * PAGE
    with host.lock:
        host.space.make_room_locked(PAGE)  # a slot needs its room: the kept copy goes
    assert host.space.held() == 0 and not os.path.exists(segment.path)
    host.slots = 0
    again = host.space.new(PAGE, job="a")
    host.space.drop(again)
    host.clock.advance(31)
    host.space.sweep()
    assert host.space.held() == 0 and not os.path.exists(again.path)


def test_a_booking_is_taken_over_or_given_back(host):
    booking = host.space.reserve("a", 3 * PAGE)
    assert host.space.held("a") == 3 * PAGE
    made = host.space.new(3 * PAGE, job="a", reservation=booking)
    assert host.space.held("a") == 3 * PAGE
    booking.release()  # used: nothing more to give back
    assert host.space.held("a") == 3 * PAGE
    host.space.drop(made)
    with host.lock:
        host.space.drain_locked("a")  # a left the node
    assert host.space.held() == 0 and not os.path.exists(made.path)
    host.space.reserve("b", PAGE).release()
    assert host.space.held() == 0


def test_a_kept_segment_goes_back_to_the_next_copy_of_the_same_rank(host):
    # Old ranks 0 and 1 of a world of 3 are the same size, and a worker lets go of the other
    # rank's copy before its own. Taken by size alone, rank 0's next copy got rank 1's
    # segment, whose pages are touched at other offsets: touched again, and both grew.
    zero = host.space.new(2 * PAGE, job="a", of=0)
    one = host.space.new(2 * PAGE, job="a", of=1)
    zero.reserve_range(0, PAGE)
    one.reserve_range(PAGE, 2 * PAGE)
    host.space.drop(one)
    host.space.drop(zero)
    assert host.space.new(2 * PAGE, job="a", of=0) is zero
    assert host.space.new(2 * PAGE, job="a", of=1) is one
    for segment in (zero, one):
        host.space.drop(segment)
    # A copy of another rank (or of nothing said) still takes a kept one that fits.
    assert host.space.new(2 * PAGE, job="a", of=2) in (zero, one)
    assert host.space.new(2 * PAGE, job="a") in (zero, one)
