"""A step due for the persistent tier that finds the writer still flushing an earlier one (a disk
slower than the flush cadence) shows in ``elasticd_persist_writer_busy_total``: held for the
writer (waited), not written (skipped), or held and then dropped because its copies went."""

from __future__ import annotations

import shutil
import threading
import uuid

import pytest

from elasticd.metrics import CheckpointSink, Metrics
from elasticd.persistence.persister import Persister
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.testing.transport import InProcessTransport
from tests.unit.test_persist_commits import Commits, busy
from tests.unit.test_store_service import write_snapshot


@pytest.fixture
def node(tmp_path, monkeypatch):
    """One node flushing every step, its writer held busy by another job's step until the test
    sets the gate; ``commits`` None: the node's own completed steps are offered instead."""
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store, metrics = SlotStore(root), Metrics()
    persister = Persister(str(tmp_path / "persist"), keep=5, node_id="n1")
    gate, real = threading.Event(), persister.tier.write_rank
    monkeypatch.setattr(persister.tier, "write_rank",
                        lambda header, buf, uid=None: (gate.wait(10), real(header, buf, uid))[1])

    def make(commits: bool):
        rep = Commits(store) if commits else None
        service = CheckpointService(store, "n1", persister, metrics_sink=CheckpointSink(metrics),
                                    replicator=rep)
        t = InProcessTransport(service.handlers())
        write_snapshot(t, "other", 0, 1, world=1)  # without commits, the service offers it
        if commits:
            assert persister.submit("other", [store.latest("other", 0, pin=True)])
        assert persister._pending == 1 and busy(metrics, "skipped") == 0  # the writer is busy
        return t, rep, store, persister, gate, metrics

    try:
        yield make
    finally:
        gate.set()
        persister.close()
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_committed_step_waits_for_the_busy_writer_or_is_dropped_when_its_copies_go(node):
    t, commits, store, persister, gate, metrics = node(commits=True)
    write_snapshot(t, "job", 0, 1, world=1)
    commits.commit("job", (0, 1))
    assert (busy(metrics, "waited"), busy(metrics, "dropped")) == (1, 0)
    # Its copy goes before the writer is free (released, both slots overwritten by steps
    # never committed): the step is dropped when the writer comes to it.
    store.release_retained("job", None, (0, 1))
    for step in (2, 3):
        write_snapshot(t, "job", 0, step, world=1)
    gate.set()
    assert persister.flush(10)
    assert (busy(metrics, "waited"), busy(metrics, "dropped"), busy(metrics, "skipped")) \
        == (1, 1, 0)


def test_a_step_of_a_job_without_commits_is_skipped_while_the_writer_is_busy(node):
    t, _, _, persister, gate, metrics = node(commits=False)
    write_snapshot(t, "job", 0, 1, world=1)
    assert (busy(metrics, "skipped"), busy(metrics, "waited")) == (1, 0)
    gate.set()
    assert persister.flush(10)
    write_snapshot(t, "job", 0, 2, world=1)  # the writer is free: written, nothing counted
    assert persister.flush(10)
    assert busy(metrics, "skipped") == 1
    persister.close()
    write_snapshot(t, "job", 0, 3, world=1)  # closed: dropped, but not for a busy writer
    assert busy(metrics, "skipped") == 1
