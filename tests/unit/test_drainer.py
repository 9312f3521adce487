"""The drain state machine (elasticd.recovery.drain) on the in-memory coordinator with fake
parts, and the checkpoint service's pause (quiesce) that a drain and a clean exit rely on."""

from __future__ import annotations

import shutil
import threading
import time
import uuid

import pytest

from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.testing.clock import FakeClock
from elasticd.cluster import drain_record
from elasticd.recovery import drain
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.testing.transport import InProcessTransport


class Parts:
    """Fake node parts that record what the drainer asked of them, in order."""

    replicates = True

    def __init__(self, failed_copies=0, short=(), failed_rounds=None):
        self.calls: list[str] = []
        self.held = ""
        self.failed_copies = failed_copies
        self.failed_rounds = failed_rounds  # hand-off rounds that fail; None: every one
        self.short = list(short)  # successive shortfall answers
        self.events: list[tuple[str, str]] = []

    def quiesce(self, timeout):
        self.calls.append("quiesce")
        return True

    def resume(self):
        self.calls.append("resume")

    def handoff(self, timeout, progress):
        self.calls.append("handoff")
        if self.failed_rounds is not None and self.calls.count("handoff") > self.failed_rounds:
            self.failed_copies = 0
        if progress:
            progress(0, 0, 3)
            progress(3 - self.failed_copies, self.failed_copies, 3)
        failed = [(0, "n2")] * self.failed_copies
        return {"job": {"version": [0, 7], "pushed": [(1, "n2")] * (3 - self.failed_copies),
                        "failed": failed, "complete": not failed}}

    def shortfall(self):
        return self.short.pop(0) if self.short else {}

    def hold(self, reason):
        self.calls.append(f"hold:{reason}")
        self.held = reason or ""

    def job_stopped(self):
        return bool(self.held)

    def record_event(self, kind, detail, data):
        self.events.append((kind, detail))


def make(parts, coord, keys):
    return drain.Drainer("n3", coord, keys, parts, stop_wait=5, read_interval=0)


@pytest.fixture
def etcd():
    return MemoryCoordinator(MemoryStore()), Keyspace("/t")


def run_until_final(d, coord, keys, timeout=10):
    d.step()
    d.join(timeout)
    return drain_record.read(coord, keys, "n3")


def test_drain_pauses_hands_off_then_holds_and_records(etcd):
    coord, keys = etcd
    parts = Parts()
    d = make(parts, coord, keys)
    assert d.step() is None  # no request: nothing happens
    drain_record.request(coord, keys, "n3", 30, "op@host", time.time())
    rec = run_until_final(d, coord, keys)
    assert rec.state == "drained" and rec.phase == "done"
    assert parts.calls == ["quiesce", "handoff", "hold:drained"]  # in this order
    assert (rec.copies_done, rec.copies_failed, rec.copies_planned) == (3, 0, 3)
    phases = [e[2] for e in rec.log]
    assert phases[:4] == ["", "snapshot", "replicas", "replicas"] and phases[-1] == "done"
    assert [k for k, _ in parts.events] == ["drained"]
    # a re-request while drained changes nothing; undo lets the node back in
    assert drain_record.request(coord, keys, "n3", 30, "op", time.time()).state == "drained"
    drain_record.undo(coord, keys, "n3")
    assert d.step() == "undrained: may run jobs again"
    assert parts.calls[-2:] == ["hold:None", "resume"] and parts.held == ""


def test_failed_handoff_keeps_the_node_running(etcd):
    coord, keys = etcd
    parts = Parts(failed_copies=1)
    d = make(parts, coord, keys)
    drain_record.request(coord, keys, "n3", 2, "op", time.time())
    rec = run_until_final(d, coord, keys)
    assert rec.state == "failed" and "could not be handed off within 2 s" in rec.detail
    assert parts.calls.count("handoff") > 1  # retried until the deadline, not failed at once
    assert "hold:drained" not in parts.calls and parts.calls[-1] == "resume"
    assert [k for k, _ in parts.events] == ["drain_failed"]
    # a new request after a failure starts a new drain
    assert drain_record.request(coord, keys, "n3", 30, "op", time.time()).state == "requested"


def test_a_step_committed_after_the_handoff_is_handed_off_too(etcd):
    coord, keys = etcd
    parts = Parts(short=[{"job": [1]}, {}])
    d = make(parts, coord, keys)
    drain_record.request(coord, keys, "n3", 30, "op", time.time())
    rec = run_until_final(d, coord, keys)
    assert rec.state == "drained"
    assert parts.calls.count("handoff") == 2


def test_a_drained_node_stays_out_after_a_daemon_restart(etcd):
    coord, keys = etcd
    drain_record.request(coord, keys, "n3", 30, "op", time.time())
    run_until_final(make(Parts(), coord, keys), coord, keys)
    parts = Parts()  # a new daemon process
    assert make(parts, coord, keys).step() == "drained: staying out of jobs until undrained"
    assert parts.held == "drained" and "handoff" not in parts.calls


def test_bad_records_are_refused_clearly(etcd):
    coord, keys = etcd
    coord.put(keys.drain("n3"), drain_record.DrainRecord("n3", state="bogus").encode())
    with pytest.raises(drain_record.records.CorruptRecord, match="unknown drain state"):
        drain_record.read(coord, keys, "n3")


def test_quiesce_refuses_new_snapshots_and_waits_for_the_one_in_flight():
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    service = CheckpointService(store, "n1")
    t = InProcessTransport(service.handlers())
    try:
        reply = t.call("ckpt_reserve", job="j", rank=0, world_size=1, nbytes=4096)
        assert "ticket" in reply
        result = {}
        th = threading.Thread(target=lambda: result.update(ok=service.snapshots.quiesce(5.0)))
        th.start()
        time.sleep(0.2)
        assert th.is_alive(), "quiesce returned with a snapshot in flight"
        assert t.call("ckpt_reserve", job="j", rank=1, world_size=2,
                      nbytes=4096)["skip"] is True
        with service.book.lock:  # the worker completes (or abandons) its slot
            service.book.jobs["j"].slots.clear()
        th.join(5)
        assert result == {"ok": True}
        assert service.snapshots.quiesce(0.1) is True
        service.snapshots.resume()
        assert "ticket" in t.call("ckpt_reserve", job="j", rank=0, world_size=1, nbytes=4096)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_copy_that_failed_once_is_tried_again(etcd):
    # CI saw a hand-off push fail (the commit moved on under it) and the drain give up at
    # 0.8 s of its 120 s: a failed copy is retried while the deadline allows.
    coord, keys = etcd
    parts = Parts(failed_copies=1, failed_rounds=1)
    d = make(parts, coord, keys)
    drain_record.request(coord, keys, "n3", 30, "op", time.time())
    rec = run_until_final(d, coord, keys)
    assert rec.state == "drained", rec.detail
    assert parts.calls.count("handoff") == 2
    assert (rec.copies_done, rec.copies_failed) == (5, 0)


# -- on a fake clock: every wait ends by its timeout -----------------------------------------
# Each of these hung before the waits went through the injected clock (a real sleep against a
# fake deadline that never moves); the pytest timeout turns such a hang into a failure.


def _drain_on(clock, parts, coord, keys, timeout):
    d = drain.Drainer("n3", coord, keys, parts, stop_wait=30, read_interval=0, clock=clock)
    drain_record.request(coord, keys, "n3", timeout, "op", clock.wall())
    d.step()
    d.join()
    return drain_record.read(coord, keys, "n3")


@pytest.mark.timeout(10)
def test_on_a_fake_clock_workers_that_never_stop_fail_the_drain_by_its_stop_wait(etcd):
    coord, keys = etcd
    clock = FakeClock()
    parts = Parts()
    parts.job_stopped = lambda: False  # the workers never stop
    start = clock.monotonic()
    rec = _drain_on(clock, parts, coord, keys, 60)
    assert rec.state == "failed" and "workers still running 30 s after the stop" in rec.detail
    assert clock.monotonic() - start >= 30
    assert parts.calls[-1] == "resume" and parts.held == ""


@pytest.mark.timeout(10)
def test_on_a_fake_clock_copies_that_keep_failing_fail_the_drain_by_its_timeout(etcd):
    coord, keys = etcd
    clock = FakeClock()
    parts = Parts(failed_copies=1)
    start = clock.monotonic()
    rec = _drain_on(clock, parts, coord, keys, 60)
    assert rec.state == "failed" and "could not be handed off within 60 s" in rec.detail
    assert 60 <= clock.monotonic() - start < 61
    assert parts.calls.count("handoff") > 100  # retried every 0.5 fake seconds


@pytest.mark.timeout(10)
def test_on_a_fake_clock_quiesce_gives_up_by_its_timeout():
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    clock = FakeClock()
    service = CheckpointService(store, "n1", clock=clock)
    t = InProcessTransport(service.handlers())
    try:
        assert "ticket" in t.call("ckpt_reserve", job="j", rank=0, world_size=1, nbytes=4096)
        start = clock.monotonic()
        assert service.snapshots.quiesce(60.0) is False  # the snapshot in flight never completes
        assert clock.monotonic() - start == pytest.approx(60.0)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
