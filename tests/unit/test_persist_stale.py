"""A job whose persistent tier stops getting complete steps says so (``persist_stale``): in
/status, in ``elasticd_jobs_unprotected{reason}`` and in the workers' replies, and stops saying
so once a complete step lands. Two nodes' checkpoint services (real slot stores, one shared
tier directory, a fake clock), each holding one rank of a two-rank job: a step completes on the
tier only when both flush it."""

from __future__ import annotations

import shutil
import uuid

import pytest

from elasticd.metrics import CheckpointSink, Metrics
from elasticd.persistence.persister import Persister
from elasticd.store.service import CheckpointService
from elasticd.store.service_records import JobRecord
from elasticd.store.shm import SlotStore
from elasticd.testing.clock import FakeClock
from elasticd.testing.transport import InProcessTransport
from tests.unit.test_store_service import write_snapshot

K, LAG = 5, 10
LIMIT = 3 * K + LAG  # steps a tier may be behind (the snapshot grid here is 1 step)


class Node:
    def __init__(self, name, tier, clock, **persist):
        self.shm = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
        self.store = SlotStore(self.shm)
        self.persist = Persister(tier, keep=5, node_id=name, clock=clock, **persist) \
            if persist else None
        self.service = CheckpointService(self.store, name, self.persist, clock=clock,
                                         lag_limit=LAG, grace=5)
        self.t = InProcessTransport(self.service.handlers())

    def snapshot(self, rank, step):
        self.service.assess()  # the daemon's cycle, between two snapshots
        write_snapshot(self.t, "j", rank, step, world=2, local_world=1)
        if self.persist is not None:
            assert self.persist.flush(10)

    def kind(self):
        return self.service.status()["j"]["unprotected_kind"]

    def close(self):
        if self.persist is not None:
            self.persist.close()
        self.store.close()
        shutil.rmtree(self.shm, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path):
    clock = FakeClock()
    made = []

    def make(name, **persist):
        made.append(Node(name, str(tmp_path / "tier"), clock, **persist))
        return made[-1]
    try:
        yield make, clock
    finally:
        for node in made:
            node.close()


def gauge(metrics):
    return metrics.registry.get_sample_value("elasticd_jobs_unprotected",
                                             {"reason": "persist_stale"})


def test_a_tier_that_stops_completing_steps_is_reported_and_clears(cluster):
    make, clock = cluster
    n1, n2 = make("n1", every_steps=K), make("n2", every_steps=K)
    metrics = Metrics()
    sink = CheckpointSink(metrics)
    for step in range(1, 11):  # both nodes flush steps 5 and 10; n1 writes first each time
        n1.snapshot(0, step)
        n2.snapshot(1, step)
        clock.advance(1)
    # n1 wrote step 5 before n2 completed it: learned at its own next flush (step 10).
    assert n1.persist.persisted("j") == (0, 5)
    assert n1.kind() == "" and n2.kind() == ""

    # From step 11 only n1 snapshots (and flushes): the tier completes nothing more.
    for step in range(11, 11 + LIMIT):
        n1.snapshot(0, step)
        clock.advance(1)
    assert n1.persist.persisted("j") == (0, 10)
    sink.update(n1.service.stats())
    assert n1.kind() == "" and gauge(metrics) == 0  # 25 steps behind: at the limit

    n1.snapshot(0, 11 + LIMIT)
    # Stale on what n1 knows; the verdict waits for the writer to list the tier first.
    assert n1.kind() == ""
    assert n1.persist.flush(10)
    sink.update(n1.service.stats())
    status = n1.service.status()["j"]
    assert status["unprotected"] and status["unprotected_kind"] == "persist_stale"
    assert "no new complete step on the persistent tier for 26 steps" in \
        status["unprotected_reason"]
    assert "newest complete: step 10" in status["unprotected_reason"]
    assert gauge(metrics) == 1
    reply = n1.t.call("register", job="j", rank=0, world_size=2)
    assert reply["unprotected"].startswith("UNPROTECTED: no new complete step")

    # n2 catches up and flushes step 40 after n1: complete; n1 learns it from a listing.
    for step in range(37, 41):
        n1.snapshot(0, step)
    n2.snapshot(1, 40)
    assert n1.persist.persisted("j") == (0, 10)  # n1 wrote first: not seen by its flush
    clock.advance(31)  # the listing is older than persist_recheck: listed again
    assert n1.kind() == "persist_stale"
    assert n1.persist.flush(10)
    sink.update(n1.service.stats())
    assert n1.kind() == "" and gauge(metrics) == 0
    assert n1.service.status()["j"]["persisted"] == [0, 40]


@pytest.mark.parametrize("persist", [{}, {"every_steps": None}])
def test_a_job_without_a_persist_cadence_never_shows_it(cluster, persist):
    make, clock = cluster
    node = make("n1", **persist) if persist else make("n1")
    metrics = Metrics()
    for step in range(1, 4 * LIMIT):  # the other rank never snapshots: no step completes
        node.snapshot(0, step)
        clock.advance(10)
    if node.persist is not None:
        assert node.persist.persisted("j") is None
        assert node.persist.flush(10)
    CheckpointSink(metrics).update(node.service.stats())
    assert node.kind() == "" and gauge(metrics) == 0


def test_every_seconds_three_periods_of_time(cluster):
    make, clock = cluster
    node = make("n1", every_seconds=10.0)
    for step in range(1, 10):  # behind from the cycle at 10 s: 35 s later, at the limit
        node.snapshot(0, step)  # (30 s + the 5 s grace)
        clock.advance(5)
    assert node.kind() == ""
    node.snapshot(0, 10)
    clock.advance(5)
    assert node.kind() == ""  # stale; the listing is asked for
    assert node.persist.flush(10)
    status = node.service.status()["j"]
    assert status["unprotected_kind"] == "persist_stale"
    assert "newest complete: none" in status["unprotected_reason"]


def test_a_grid_that_widened_once_does_not_loosen_the_bound_for_good():
    """The snapshot grid widens under load and narrows again; the staleness bound follows the
    recent gaps, not the widest the job ever had (3 × 16 steps would hide a stale tier)."""
    record = JobRecord()
    steps = [0, 16, 32, 48, 49, 50, 51, 52, 53, 54, 55, 56]
    for step in steps[:4]:
        record.reached((0, step))
    assert record.grid == 16
    for step in steps[4:]:
        record.reached((0, step))
    assert record.grid == 1
    record.reached((1, 3))  # a new generation: no gap across it
    assert record.grid == 1

