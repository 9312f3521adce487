"""The daemon-side checkpoint service, driven through its handlers as the local socket would.

Snapshots are written here with numpy the way a worker writes them (payload at the layout's
offsets, unsealed header JSON after the preamble), so these tests need no torch. Slots live in a
unique /dev/shm directory per test, removed afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from elasticd.snapshot.format import (
    PREAMBLE_SIZE,
    SnapshotHeader,
    TensorSpec,
    _header_json,
    layout,
)
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.testing.transport import InProcessTransport, TransportError
from elasticd.persistence.persister import Persister
from elasticd.persistence.tier import Tier


class Sink:
    """A metrics sink that keeps every event as a tuple."""

    def __init__(self):
        self.events = []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args: self.events.append((name, *args))


@pytest.fixture
def env(root, tmp_path):
    store = SlotStore(root)
    persister = Persister(str(tmp_path / "persist"), keep=2, every_steps=2)
    sink = Sink()
    service = CheckpointService(store, "n1", persister, metrics_sink=sink)
    try:
        yield service, InProcessTransport(service.handlers()), sink
    finally:
        persister.close()
        store.close()
    assert not os.path.exists(root)


def write_snapshot(t, job, rank, step, *, world=2, generation=0, n=1000, local_world=None,
                   meta=None):
    """Reserves, fills and completes one snapshot like a worker; returns the reply and data."""
    data = (np.arange(n, dtype=np.float32) + step * 1000 + rank).astype(np.float32)
    lay = layout([TensorSpec("w", "float32", (n,))], job=job, meta={"pad": "x" * 200})
    reply = t.call("ckpt_reserve", job=job, rank=rank, world_size=world,
                   nbytes=lay.total_size, local_world_size=local_world or world)
    if reply.get("skip"):
        return reply, data
    with open(reply["path"], "r+b") as f:
        e = lay.entries[0]
        f.seek(e.offset)
        f.write(data.tobytes())
        header = SnapshotHeader(job, step, generation, rank, world, lay,
                                {"step": step} if meta is None else meta,
                                (0,) * lay.num_blocks)
        body = json.dumps(_header_json(header)).encode()
        f.seek(PREAMBLE_SIZE)
        f.write(body)
    done = t.call("ckpt_complete", job=job, rank=rank, ticket=reply["ticket"],
                  header_size=len(body), stall_seconds=0.001)
    return done, data


def test_reserve_complete_list_open(env):
    service, t, sink = env
    write_snapshot(t, "job", 0, step=1)
    done, data = write_snapshot(t, "job", 0, step=2)
    assert done["step"] == 2 and done["generation"] == 0
    listed = t.call("ckpt_list", job="job", rank=0, world_size=2)
    assert listed["ram"] == {"0": [[0, 2], [0, 1]]}  # the previous snapshot is listed too
    assert listed["progress"] == [0, 2]
    assert t.call("ckpt_list", job="job", world_size=3)["ram"] == {"0": []}
    opened = t.call("ckpt_open", job="job", rank=0, generation=0, step=2)
    with open(opened["path"], "rb") as f:
        f.seek(opened["offset"])
        raw = f.read(opened["size"])
    from tests.snapshot_entries import entry
    assert np.array_equal(entry(raw, "w", np.float32, job="job", rank=0), data)
    t.call("ckpt_release", pin=opened["pin"])
    status = service.status()["job"]
    assert status["ranks"] == {"0": [0, 2]} and status["bytes"] == done["bytes"]
    assert not status["unprotected"]
    assert service.counters["snapshots"] == 2
    assert ("snapshot_completed", "job", 0, 2, done["bytes"], 0.001) in sink.events


def test_bad_requests_are_refused(env):
    _, t, _ = env
    reply = t.call("ckpt_reserve", job="job", rank=0, world_size=1, nbytes=10000)
    with pytest.raises(TransportError, match="ticket"):
        t.call("ckpt_complete", job="job", rank=0, ticket=reply["ticket"] + 1, header_size=10)
    with open(reply["path"], "r+b") as f:
        f.seek(PREAMBLE_SIZE)
        f.write(b'{"job": "job", "garbage": true}')
    with pytest.raises(TransportError, match="snapshot refused"):
        t.call("ckpt_complete", job="job", rank=0, ticket=reply["ticket"], header_size=31)
    with pytest.raises(TransportError, match="rank 3 outside"):
        t.call("ckpt_reserve", job="job", rank=3, world_size=2, nbytes=10)
    with pytest.raises(TransportError, match="nbytes"):
        t.call("ckpt_reserve", job="job", rank=0, world_size=1, nbytes="big")
    with pytest.raises(TransportError, match="job name"):
        t.call("ckpt_reserve", job="../etc", rank=0, world_size=1, nbytes=10)
    with pytest.raises(TransportError, match="not held"):
        t.call("ckpt_open", job="job", rank=0, generation=0, step=9)


def test_over_budget_skips_warns_once_and_marks_unprotected(root, caplog):
    store = SlotStore(root, cap_bytes=64 << 10)
    sink = Sink()
    service = CheckpointService(store, "n1", metrics_sink=sink)
    t = InProcessTransport(service.handlers())
    try:
        with caplog.at_level(logging.WARNING):
            for step in (1, 2, 3):
                reply, _ = write_snapshot(t, "big", 0, step, world=1, n=100_000)
                assert reply["skip"] is True and "over_budget" in reply["reason"]
        warnings = [r for r in caplog.records if "UNPROTECTED" in r.getMessage()]
        assert len(warnings) == 1
        assert service.status()["big"]["unprotected"] is True
        assert service.counters["skipped_over_budget"] == 3
        assert service.stats().unprotected_jobs == {
            "snapshots_failing": 1, "no_placement": 0, "commit_lag": 0, "persist_stale": 0}
        assert "over the memory cap" in service.book.unprotected("big")
        assert sink.events.count(("snapshot_skipped", "big", "over_budget")) == 3
        write_snapshot(t, "big", 0, 4, world=1, n=1000)  # fits: protected again
        assert service.status()["big"]["unprotected"] is False
        assert service.book.unprotected("big") == ""
    finally:
        store.close()


def test_pinned_slot_makes_reserve_skip_until_released(env):
    service, t, _ = env
    write_snapshot(t, "job", 0, 1, world=1)
    write_snapshot(t, "job", 0, 2, world=1)
    opened = t.call("ckpt_open", job="job", rank=0, generation=0, step=1)
    reply, _ = write_snapshot(t, "job", 0, 3, world=1)
    assert reply["skip"] and "busy" in reply["reason"]
    t.call("ckpt_release", pin=opened["pin"])
    done, _ = write_snapshot(t, "job", 0, 3, world=1)
    assert done["step"] == 3
    assert service.counters["skipped_busy"] == 1


def test_forgotten_pins_expire(root):
    from elasticd.testing.clock import FakeClock

    clock = FakeClock()
    store = SlotStore(root)
    service = CheckpointService(store, "n1", clock=clock, pin_ttl=60)
    t = InProcessTransport(service.handlers())
    try:
        write_snapshot(t, "job", 0, 1, world=1)
        write_snapshot(t, "job", 0, 2, world=1)
        t.call("ckpt_open", job="job", rank=0, generation=0, step=1)  # its worker dies
        clock.advance(61)
        done, _ = write_snapshot(t, "job", 0, 3, world=1)
        assert done["step"] == 3
    finally:
        store.close()


def test_corrupt_snapshot_is_refused_counted_and_no_longer_listed(env, caplog):
    service, t, sink = env
    write_snapshot(t, "job", 0, 1, world=1)
    path = t.call("ckpt_list", job="job")["ram"]
    opened = t.call("ckpt_open", job="job", rank=0, generation=0, step=1)
    t.call("ckpt_release", pin=opened["pin"])
    with open(opened["path"], "r+b") as f:
        f.seek(opened["size"] - 7)  # inside the payload
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level(logging.ERROR), pytest.raises(TransportError, match="checksum"):
        t.call("ckpt_open", job="job", rank=0, generation=0, step=1)
    assert any("REFUSED corrupt snapshot" in r.getMessage() for r in caplog.records)
    assert service.counters["refused"] == 1
    assert ("snapshot_refused", "job", "local") in sink.events
    assert path == {"0": [[0, 1]]}
    assert t.call("ckpt_list", job="job")["ram"] == {"0": []}


def test_step_complete_on_every_local_rank_is_persisted(env):
    service, t, sink = env
    for step in (1, 2, 3, 4):
        for rank in (0, 1):
            write_snapshot(t, "job", rank, step, world=2)
        service.persist.flush(5)  # a flush offered while the writer is busy would be skipped
    tier = Tier(service.persist.root)
    assert [m.version() for m in tier.complete_steps("job")] == [(0, 4), (0, 2)]
    snap = tier.read("job", (0, 4), 1)
    assert snap.world_size == 2 and snap.meta == {"step": 4}
    listed = t.call("ckpt_list", job="job", world_size=2)
    assert listed["persisted"] == [[0, 4], [0, 2]]
    assert listed["persist_root"] == service.persist.root
    assert service.status()["job"]["persisted"] == [0, 4]
    assert service.stats().persisted_step == 4
    assert [e[0] for e in sink.events].count("persisted") == 2


def test_node_with_some_ranks_persists_only_its_own(env):
    service, t, _ = env
    for rank in (2, 3):  # this node holds ranks 2 and 3 of a world of 4
        write_snapshot(t, "job", rank, 2, world=4, local_world=2)
    service.persist.flush(5)
    directory = Tier(service.persist.root).step_dir("job", (0, 2))
    assert sorted(os.listdir(directory)) == ["rank-2.json", "rank-2.safetensors",
                                             "rank-3.json", "rank-3.safetensors"]
    assert t.call("ckpt_list", job="job")["persisted"] == []  # not complete: no manifest


def test_a_node_whose_rank_changed_in_a_new_generation_still_persists(env):
    # Same world size, another rank for this node after a restart: the old rank's slots still
    # hold its old copies, and requiring them too stopped this node persisting for good.
    service, t, _ = env
    write_snapshot(t, "job", 0, 2, world=2, local_world=1)
    service.persist.flush(5)
    write_snapshot(t, "job", 1, 4, world=2, local_world=1, generation=1)
    service.persist.flush(5)
    tier = Tier(service.persist.root)
    assert sorted(os.listdir(tier.step_dir("job", (1, 4)))) == ["rank-1.json",
                                                               "rank-1.safetensors"]


def test_report_reaches_history_metrics_and_status(env):
    service, t, sink = env
    t.call("ckpt_report", job="job", rank=1, source="persistent", seconds=0.5, steps_lost=2,
           bytes=1234, generation=0, step=5, refused=["persistent step (0, 7): bad"])
    assert service.status()["job"]["last_restore"]["steps_lost"] == 2
    assert service.status()["job"]["last_restore"]["source"] == "persistent"
    assert service.counters["restores_persistent"] == 1
    assert service.status()["job"]["last_restore"]["path"] is None  # an older worker's report: no path
    assert ("restored", "job", "persistent", 0.5, 2, 1234) in sink.events
    assert ("snapshot_refused", "job", "persistent") in sink.events
    with pytest.raises(TransportError, match="source"):
        t.call("ckpt_report", job="job", rank=1, source="disk", seconds=0.5, steps_lost=0,
               bytes=0)
    t.call("ckpt_report", job="job", rank=1, source="local", seconds=0.5, steps_lost=0,
           bytes=0, path="in_process")
    assert service.status()["job"]["last_restore"]["path"] == "in_process"
    with pytest.raises(TransportError, match="path"):
        t.call("ckpt_report", job="job", rank=1, source="local", seconds=0.5, steps_lost=0,
               bytes=0, path="teleport")


def test_remove_job_deletes_slots_and_pins(env, root):
    service, t, _ = env
    write_snapshot(t, "gone", 0, 1, world=1)
    write_snapshot(t, "kept", 0, 1, world=1)
    t.call("ckpt_open", job="gone", rank=0, generation=0, step=1)
    service.remove_job("gone")
    assert sorted(os.listdir(root)) == ["kept"]
    assert list(service.status()) == ["kept"]
    assert service.store.holdings() == [("kept", 0, 0, 1)]


def test_slots_stay_the_daemons_and_come_as_descriptors(env, root):
    service, _, _ = env
    t = InProcessTransport(service.handlers(), uid=4321)
    reply = t.call("ckpt_reserve", job="job", rank=0, world_size=1, nbytes=5000)
    [fd] = reply["_fds"]
    try:
        held, named = os.fstat(fd), os.stat(reply["path"])
        assert (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
        assert os.get_blocking(fd) and os.O_RDWR & _flags(fd) == os.O_RDWR
    finally:
        os.close(fd)
    assert named.st_uid == os.geteuid() and stat.S_IMODE(named.st_mode) == 0o600
    for directory in (root, os.path.join(root, "job"), os.path.join(root, "job", "0")):
        st = os.stat(directory)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700


def _flags(fd):
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return int(next(line for line in f if line.startswith("flags:")).split()[1], 8)


def test_restarted_service_adopts_progress_from_scanned_slots(root):
    store = SlotStore(root)
    t = InProcessTransport(CheckpointService(store, "n1").handlers())
    write_snapshot(t, "job", 0, 5, world=1)
    store.close(unlink=False)
    again = SlotStore(root)
    try:
        again.scan()
        t2 = InProcessTransport(CheckpointService(again, "n1").handlers())
        assert t2.call("ckpt_list", job="job")["progress"] == [0, 5]
    finally:
        again.close()


def test_daemon_side_modules_do_not_import_torch():
    modules = ["elasticd", "elasticd.store.service", "elasticd.local.wire",
               "elasticd.store.telemetry", "elasticd.persistence.persister",
               "elasticd.persistence.tier"]
    code = f"import sys, {', '.join(modules)}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_off_the_snapshot_grid_a_reservation_is_skipped_quietly(env, caplog):
    # When commits lag, the job's grid (replication/commit.py, Grid) makes every node snapshot
    # the same steps. Off the grid a reservation is a routine skip: no warning, no failure.
    service, t, sink = env

    class Grid:
        grid = 4

        def snapshot_grid(self, job):
            return self.grid

        def status(self):
            return {"jobs": {}}

    service.replicator = service.snapshots.replicator = Grid()
    ask = dict(job="job", rank=0, world_size=2, nbytes=4096, local_world_size=2, generation=0)
    with caplog.at_level(logging.WARNING):
        off = t.call("ckpt_reserve", step=6, **ask)
    assert off["skip"] and off["grid"] == 4 and "grid" in off["reason"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert service.counters["skipped_grid"] == 1 and not service.book.unprotected("job")
    # Counted in the metrics too (elasticd_snapshots_skipped_total{reason="grid"}): a job the
    # grid keeps at one snapshot in two showed none of its skips, so two jobs asking for the
    # same cadence looked alike while one took half the snapshots of the other.
    assert sink.events.count(("snapshot_skipped", "job", "grid")) == 1
    on = t.call("ckpt_reserve", step=8, **ask)
    assert not on.get("skip") and on["capacity"] >= 4096
    Grid.grid = 1
    assert not t.call("ckpt_reserve", step=9, **ask).get("skip")


def test_a_reply_that_could_not_be_delivered_gives_its_read_pin_back(env):
    # A worker killed while its ckpt_fetch ran (a restore round aborted during a fetch from a
    # frozen holder) never reads the reply, nor releases its pin: the local API hands the
    # reply back, and the slot is free for the next snapshot at once (not after pin_ttl).
    service, t, _ = env
    write_snapshot(t, "job", 0, 1, world=1)
    write_snapshot(t, "job", 0, 2, world=1)
    opened = t.call("ckpt_open", job="job", rank=0, generation=0, step=1)
    service.restores.undelivered("ckpt_open", opened)
    done, _ = write_snapshot(t, "job", 0, 3, world=1)
    assert done["step"] == 3
    assert service.counters["skipped_busy"] == 0
