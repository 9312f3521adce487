"""Loud protection state: the pure decision (elasticd.store.protection), the checkpoint
service that gathers its facts (register and slot requests as progress, replies that carry the
verdict), its metric, and the worker's once-a-minute warning."""

from __future__ import annotations

import logging
import shutil
import uuid

import pytest

from elasticd.store.protection import REASONS, JobView, assess
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.testing.clock import FakeClock
from elasticd.testing.transport import InProcessTransport
from elasticd.worker.transport import Transport
from elasticd.metrics import UNPROTECTED_REASONS, CheckpointSink, Metrics
from elasticd.store.api import Replication
from tests.unit.test_store_service import write_snapshot

OK = JobView(newest=(0, 50), replicated=True, placement=True, committed=(0, 49), lag=1,
             seconds=60)


@pytest.mark.parametrize("view,reason", [
    (OK, None),
    (JobView(failing="over the memory cap"), "snapshots_failing"),
    (JobView(**{**OK.__dict__, "placement": False}), "no_placement"),
    (JobView(**{**OK.__dict__, "placement": False, "seconds": 3}), None),  # still forming
    (JobView(**{**OK.__dict__, "lag": 11}), "commit_lag"),
    (JobView(**{**OK.__dict__, "lag": 10}), None),
    (JobView(**{**OK.__dict__, "replicated": False, "placement": False, "lag": 99}), None),
    (JobView(replicated=True, seconds=60), None),  # no snapshot yet: nothing to protect
    # The persistent tier, every K=5 steps (limit 3*max(K, grid) + lag_limit = 25 steps).
    (JobView(**{**OK.__dict__, "persist_every_steps": 5, "unpersisted_steps": 25}), None),
    (JobView(**{**OK.__dict__, "persist_every_steps": 5, "unpersisted_steps": 26}),
     "persist_stale"),
    (JobView(**{**OK.__dict__, "persist_every_steps": 5, "grid": 20, "unpersisted_steps": 70}),
     None),  # snapshots every 20 steps: flushes land up to 20 steps apart
    (JobView(**{**OK.__dict__, "persist_every_steps": 5, "unpersisted_steps": 26, "lag": 11}),
     "commit_lag"),  # the cause first
    (JobView(newest=(0, 50), seconds=60, persist_every_steps=5, unpersisted_steps=26),
     "persist_stale"),  # without replication too
    (JobView(newest=(0, 50), seconds=3, persist_every_steps=5, unpersisted_steps=26),
     None),  # young
    (JobView(newest=(0, 50), seconds=60, unpersisted_steps=999, unpersisted_seconds=1e6),
     None),  # no tier, or one without a cadence
    # Every T=10 s (limit 3*T + grace = 35 s), and with both K and T: past both.
    (JobView(newest=(0, 50), seconds=60, persist_every_seconds=10, unpersisted_steps=1,
             unpersisted_seconds=36), "persist_stale"),
    (JobView(newest=(0, 50), seconds=60, persist_every_seconds=10, unpersisted_steps=1,
             unpersisted_seconds=35), None),
    (JobView(newest=(0, 50), seconds=60, persist_every_seconds=10, unpersisted_steps=0,
             unpersisted_seconds=99), None),  # nothing new to persist
    (JobView(newest=(0, 50), seconds=60, persist_every_steps=5, persist_every_seconds=10,
             unpersisted_steps=99, unpersisted_seconds=30), None),
    (JobView(newest=(0, 50), seconds=60, persist_every_steps=5, persist_every_seconds=10,
             unpersisted_steps=99, unpersisted_seconds=36), "persist_stale"),
])
def test_assess(view, reason):
    verdict = assess(view, lag_limit=10, grace=5)
    assert (verdict.reason if verdict else None) == reason
    if verdict:
        assert str(verdict).startswith("UNPROTECTED: ")


def test_the_metric_labels_every_reason():
    assert UNPROTECTED_REASONS == REASONS  # metrics imports no domain module: a copy


class FakeReplicator(Replication):
    """What the service reads of replication: ``status()["jobs"]`` and the snapshot hand-off."""

    def __init__(self):
        self.jobs = {}

    def status(self):
        return {"jobs": self.jobs}

    def on_local_snapshot(self, job, rank, version):
        pass


@pytest.fixture
def setup():
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    clock = FakeClock()
    rep = FakeReplicator()
    service = CheckpointService(store, "n1", clock=clock, replicator=rep, lag_limit=10,
                                grace=5)
    reports = []
    service.on_progress.append(reports.append)
    try:
        yield service, InProcessTransport(service.handlers()), clock, rep, reports
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def gauge(metrics, reason):
    return metrics.registry.get_sample_value("elasticd_jobs_unprotected", {"reason": reason})


def test_register_and_slot_requests_are_progress_reports(setup):
    service, t, _, _, reports = setup
    reply = t.call("register", job="j", rank=1, world_size=2, local_rank=0, restart=3)
    assert reply == {"node": "n1", "unprotected": None}
    t.call("ckpt_reserve", job="j", rank=1, world_size=2, nbytes=4096, step=7, generation=0)
    assert [(r["rank"], r.get("step"), r.get("restart")) for r in reports] == [
        (1, None, 3), (1, 7, None)]
    assert reports[0]["world_size"] == 2 and reports[0]["_peer"]["pid"] > 0
    with pytest.raises(Exception, match="outside world size"):
        t.call("register", job="j", rank=2, world_size=2)


def test_each_reason_is_reported_everywhere_and_clears(setup):
    service, t, clock, rep, _ = setup
    metrics = Metrics()
    sink = CheckpointSink(metrics)
    write_snapshot(t, "j", 0, 1, world=1)
    sink.update(service.stats())
    assert service.book.unprotected("j") == ""  # young: placement is being formed
    clock.advance(6)
    sink.update(service.stats())
    assert "no replica placement" in service.book.unprotected("j")
    assert gauge(metrics, "no_placement") == 1
    status = service.status()["j"]
    assert status["unprotected"] and status["unprotected_kind"] == "no_placement"
    reply = t.call("ckpt_reserve", job="j", rank=0, world_size=1, nbytes=4096, step=2,
                   generation=0)
    assert reply["unprotected"].startswith("UNPROTECTED: no replica placement")
    assert t.call("register", job="j", rank=0, world_size=1)["unprotected"] == reply[
        "unprotected"]

    rep.jobs["j"] = {"placement": "n1 -> n2", "committed": [0, 1], "sync_lag": 30}
    sink.update(service.stats())
    assert "30 steps behind" in service.book.unprotected("j")
    assert gauge(metrics, "no_placement") == 0 and gauge(metrics, "commit_lag") == 1

    rep.jobs["j"]["sync_lag"] = 1
    sink.update(service.stats())
    assert service.book.unprotected("j") == "" and gauge(metrics, "commit_lag") == 0
    assert "unprotected" not in t.call("ckpt_reserve", job="j", rank=0, world_size=1,
                                       nbytes=4096, step=3, generation=0)


class FakeTransport(Transport):
    def __init__(self, unprotected):
        self.unprotected = unprotected
        self.calls = []

    def call(self, op, **fields):
        self.calls.append((op, fields))
        return {"node": "n1", "unprotected": self.unprotected}


def test_the_worker_registers_and_warns_at_most_once_a_minute(caplog, monkeypatch):
    pytest.importorskip("torch")
    from elasticd.worker.checkpointer import Checkpointer

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    t = FakeTransport("UNPROTECTED: no replica placement")
    with caplog.at_level(logging.WARNING, logger="elasticd.checkpoint"):
        ckpt = Checkpointer(transport=t, job="j", rank=3, world_size=4, local_world_size=1)
        assert t.calls[0] == ("register", {"job": "j", "rank": 3, "world_size": 4,
                                           "restart": 2, "local_rank": 0})
        for _ in range(5):
            ckpt._register(7)
        assert len([r for r in caplog.records if "UNPROTECTED" in r.getMessage()]) == 1
        ckpt._notices.warned_at -= 61  # a minute later, still unprotected: again
        ckpt._register(8)
        assert len([r for r in caplog.records if "UNPROTECTED" in r.getMessage()]) == 2
        t.unprotected = None
        ckpt._register(9)
        assert "protected again" in caplog.records[-1].getMessage()
    ckpt.close()


def test_local_slot_gauge_is_this_nodes_own_slots(setup):
    service, t, _, _, _ = setup
    metrics = Metrics()
    write_snapshot(t, "j", 0, 1, world=1)
    CheckpointSink(metrics).update(service.stats())
    held = service.store.bytes_held()
    assert held > 0 and service.stats().local_slot_bytes == held
    assert metrics.registry.get_sample_value("elasticd_local_slot_bytes") == held
