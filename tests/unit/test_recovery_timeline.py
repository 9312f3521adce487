"""A recovery's timeline: its pure assembly, reading it back from hostile data, the daemon side
that writes it once per failure (in-memory etcd, fake clock), and ``elasticctl history``."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import sys

import pytest

from elasticd.agent.manager import JobManager
from elasticd.cli import main as cli
from elasticd.cli import options
from elasticd.testing.clock import FakeClock
from elasticd.cluster import timeline
from elasticd.cluster.events import Event, EventLog
from elasticd.cluster.jobspec import JobSpec, NodeJobStatus
from elasticd.coordination import records
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.daemon.recovery_timeline import TimelineRecorder
from elasticd.metrics import RECOVERY_PHASES, Metrics

T0 = 1_700_000_000.0


def _restore(at: float, seconds: float = 0.1, source: str = "peer", job: str = "j",
             nbytes: int = 1000, step: int | None = 40) -> timeline.RankRestore:
    return timeline.RankRestore(job, at, seconds, source, nbytes, step)


def _full(**over) -> timeline.Timeline:
    args = dict(job="j", failed=["n2"], detected_at=T0 + 2.3, detection_seconds=3.1,
                lease_ttl=2.0, aborted=[T0 - 51, T0 + 2.31, T0 + 2.5],
                round_closed=[T0 - 50, T0 + 2.9],
                restores=[_restore(T0 + 3.9, 0.2, "local"), _restore(T0 + 3.95, 0.3, "peer")],
                first_steps=[T0 - 49, T0 + 4.2])
    args.update(over)
    return timeline.assemble(**args)


# -- assembly -------------------------------------------------------------------------------

def test_phases_are_measured_between_the_moments_and_add_up_to_the_total():
    t = _full()
    assert t.phases() == {"detect": 2.0, "abort": 0.01, "rendezvous": 0.59, "start": 0.75,
                          "restore": 0.3, "first_step": 0.25}
    assert t.failure_at == T0 + 0.3  # the lease TTL, not the older heartbeat record
    # The moments of the recovery before this failure are not this one's.
    assert (t.aborted_at, t.round_closed_at) == (T0 + 2.31, T0 + 2.9)
    assert t.total == 3.9 == pytest.approx(sum(t.phases().values()))
    assert (t.restore_source, t.restore_bytes, t.ranks_restored, t.step) == ("local+peer",
                                                                            2000, 2, 40)
    assert t.overlapped == []
    assert "j recovered from n2's failure: 3.90 s" in t.describe()


def test_a_fresher_heartbeat_record_places_the_failure_closer():
    assert _full(detection_seconds=1.5).phases()["detect"] == 1.5


def test_a_moment_not_seen_is_missing_with_both_its_phases_never_invented():
    t = _full(aborted=[])
    assert t.aborted_at is None
    p = t.phases()
    assert p["abort"] is None and p["rendezvous"] is None
    assert p["detect"] == 2.0 and p["start"] == 0.75
    assert t.total == 3.9  # failure and first step are known
    t = _full(first_steps=[], restores=[])
    assert t.total is None and t.restore_started_at is None and t.ranks_restored == 0
    assert t.phases()["restore"] is None and t.restore_source == ""


def test_a_moment_before_the_one_preceding_it_is_moved_up_and_named():
    # The agents' rendezvous noticed the dead peer before the daemon's watch did.
    t = _full(round_closed=[T0 + 2.2])
    assert t.round_closed_at == t.aborted_at == T0 + 2.31
    assert t.overlapped == ["round_closed"]
    assert t.phases()["rendezvous"] == 0.0
    marks = [m for m in t.marks() if m is not None]
    assert marks == sorted(marks)
    assert t.total == pytest.approx(sum(t.phases().values()))


def test_only_this_jobs_restores_of_this_recovery_count():
    t = _full(restores=[_restore(T0 + 3.9, 0.2, "local"),
                        _restore(T0 + 3.9, 0.2, "peer", job="other"),  # another job
                        _restore(T0 - 10.0, 0.2, "peer"),  # an earlier recovery
                        _restore(T0 + 9.0, 0.2, "persistent")])  # after the first step
    assert (t.restore_source, t.ranks_restored) == ("local", 1)
    assert t.restore_started_at == T0 + 3.7 and t.restore_finished_at == T0 + 3.9


# -- reading it back --------------------------------------------------------------------------

def test_a_stored_timeline_reads_back():
    t = _full()
    stored = json.loads(json.dumps(t.as_dict()))
    assert timeline.decode(stored) == t


@pytest.mark.parametrize("change", [
    {"detected_at": "soon"}, {"failed": "n2"}, {"failed": []}, {"first_step_at": True},
    {"restore_bytes": -1}, {"step": 1.5}, {"overlapped": [3]},
    {"first_step_at": T0 - 100},  # out of order
])
def test_a_forged_timeline_is_refused_with_the_reason(change):
    data = {**_full().as_dict(), **change}
    with pytest.raises(records.CorruptRecord):
        timeline.decode(data)


def test_a_timeline_without_its_detection_or_not_an_object_is_refused():
    data = _full().as_dict()
    del data["detected_at"]
    for bad in (data, [], "x", None):
        with pytest.raises(records.CorruptRecord):
            timeline.decode(bad)


def test_a_restore_event_that_does_not_read_is_left_out():
    good = {"job": "j", "seconds": 0.2, "source": "peer", "bytes": 10, "step": 3}
    assert timeline.restore_of(good, T0) == timeline.RankRestore("j", T0, 0.2, "peer", 10, 3)
    for change in ({"job": 1}, {"seconds": "x"}, {"seconds": -1}, {"bytes": 1.5},
                   {"step": "7"}, {"source": None}):
        assert timeline.restore_of({**good, **change}, T0) is None


def test_the_metric_labels_are_the_phases():
    assert RECOVERY_PHASES == timeline.PHASES


# -- the writer (daemon side) -------------------------------------------------------------------

@pytest.fixture
def env():
    clock = FakeClock(1_000.0, wall_offset=T0 - 1_000.0)
    coord = MemoryCoordinator(MemoryStore(clock))
    keys = Keyspace("/t")
    events = EventLog(coord, keys)

    def recorder(node: str = "n1") -> TimelineRecorder:
        return TimelineRecorder(node, coord, keys, events, Metrics(), clock, lambda: 2.0)

    return clock, coord, keys, events, recorder


def _fail(clock, events, node="n2", lease=0x2B, detection=3.0):
    events.record(Event("failed", node, lease, clock.wall(), "n3", "n2 failed",
                        {"detection_seconds": detection}))


def _recover(clock, rec, events, new_pid=22):
    """What the writer sees of a recovery after its detection, 0.01 s apart and more."""
    clock.advance(0.01)
    rec.on_progress({"job": "j", "step": 41, "_peer": {"pid": 11}})  # an old worker's last
    clock.advance(0.5)
    rec.on_round_closed("j")
    clock.advance(0.7)
    rec.on_restore({"job": "j", "rank": 0, "step": 40})
    events.record(Event("recovered", "n1", 1, clock.wall(), "n1", "restored",
                        {"job": "j", "rank": 0, "source": "peer", "seconds": 0.2,
                         "steps_lost": 1, "bytes": 4096, "step": 40}, instance="a"))
    rec.on_progress({"job": "j", "step": 40, "_peer": {"pid": new_pid}})  # its register
    clock.advance(0.3)
    rec.on_progress({"job": "j", "step": 41, "_peer": {"pid": new_pid}})  # the first step


def test_the_writer_records_one_timeline_per_failure_and_observes_each_phase(env):
    clock, coord, keys, events, recorder = env
    rec = recorder()
    rec.on_progress({"job": "j", "step": 39, "_peer": {"pid": 11}})  # the old group
    clock.advance(0.1)
    _fail(clock, events)
    rec.on_failure("j", "n2", 0x2B, writer=True, aborted=True)
    assert rec.step() is None  # no first step yet
    _recover(clock, rec, events)
    assert rec.step() == "recovery timeline of j written"
    assert rec.step() is None  # once
    [stored] = [e for e in events.list() if e.kind == timeline.KIND]
    assert (stored.node, stored.lease, stored.by, stored.instance) == ("n2", 0x2B, "n1", "j")
    t = timeline.decode(stored.data)
    # The failure is placed at the failed node's last sign of life: the last step this node's
    # workers trained with it (0.1 s before the detection), not a lease TTL before it.
    assert t.failure_evidence == "step" and t.failure_latest_at is None
    assert t.phases() == {"detect": 0.1, "abort": 0.0, "rendezvous": 0.51, "start": 0.5,
                          "restore": 0.2, "first_step": 0.3}
    assert t.total == 1.61 and t.restore_source == "peer" and t.step == 40
    assert t.ranks == [{"rank": 0, "node": "n1", "source": "peer", "seconds": 0.2,
                        "bytes": 4096, "step": 40, "steps_lost": 1}]
    assert rec.last == t
    metrics = rec.metrics
    count = {p: metrics.registry.get_sample_value("elasticd_recovery_phase_seconds_count",
                                                  {"phase": p}) for p in timeline.PHASES}
    assert count == {p: 1.0 for p in timeline.PHASES}
    assert metrics.registry.get_sample_value("elasticd_last_recovery_phase_seconds",
                                             {"phase": "first_step"}) == 0.3
    assert metrics.registry.get_sample_value(
        "elasticd_last_recovery_timestamp_seconds") == t.first_step_at


def test_a_second_writer_with_another_view_stores_no_second_copy(env):
    clock, coord, keys, events, recorder = env
    a, b, other = recorder("n1"), recorder("n3"), recorder("n4")
    _fail(clock, events)
    for rec, writer in ((a, True), (b, True), (other, False)):
        rec.on_failure("j", "n2", 0x2B, writer=writer, aborted=True)
    _recover(clock, a, events)
    for rec in (b, other):
        rec.on_progress({"job": "j", "step": 41, "_peer": {"pid": 33}})
        assert other.step() is None
    assert a.step() == "recovery timeline of j written"
    assert b.step() is None and other.step() is None
    clock.advance(11)  # the stand-in's wait: it finds the record there
    assert other.step() is None
    assert [e.by for e in events.list() if e.kind == timeline.KIND] == ["n1"]
    # ... and shows the stored record in its /status, as the writer does.
    assert other.last == a.last is not None
    for rec in (b, other):  # only the node that stored it observes
        assert rec.metrics.registry.get_sample_value(
            "elasticd_recovery_phase_seconds_count", {"phase": "detect"}) == 0


def test_a_stand_in_writes_when_the_writer_did_not(env):
    clock, coord, keys, events, recorder = env
    rec = recorder("n3")
    rec.on_progress({"job": "j", "step": 39, "_peer": {"pid": 11}})  # the old group
    _fail(clock, events)
    rec.on_failure("j", "n2", 0x2B, writer=False, aborted=True)
    _recover(clock, rec, events)
    assert rec.step() is None
    clock.advance(9)
    assert rec.step() is None
    clock.advance(1.5)
    assert rec.step() == "recovery timeline of j written"
    [stored] = [e for e in events.list() if e.kind == timeline.KIND]
    assert stored.by == "n3" and timeline.decode(stored.data).total == 1.51


def test_a_recovery_that_never_trains_again_is_written_with_what_was_seen(env):
    clock, coord, keys, events, recorder = env
    rec = recorder()
    _fail(clock, events)
    rec.on_failure("j", "n2", 0x2B, writer=True, aborted=False)
    clock.advance(599)
    assert rec.step() is None
    clock.advance(2)
    rec.step()
    [stored] = [e for e in events.list() if e.kind == timeline.KIND]
    t = timeline.decode(stored.data)
    assert t.aborted_at is None and t.round_closed_at is None and t.first_step_at is None
    assert t.total is None and t.phases()["detect"] == 2.0
    assert math.isnan(rec.metrics.registry.get_sample_value(
        "elasticd_last_recovery_phase_seconds", {"phase": "abort"}))


def test_the_agents_abort_before_the_daemon_saw_the_failure_counts(env):
    clock, coord, keys, events, recorder = env
    rec = recorder()
    rec.on_progress({"job": "j", "step": 39, "_peer": {"pid": 11}})
    _fail(clock, events)  # recorded by another node; this one's watch is slower
    clock.advance(0.1)
    rec.on_abort("j")  # the agent's workers_aborted
    rec.on_round_closed("j")
    clock.advance(0.2)
    rec.on_failure("j", "n2", 0x2B, writer=True, aborted=False)  # it found none to kill
    _recover(clock, rec, events)
    rec.step()
    [stored] = [e for e in events.list() if e.kind == timeline.KIND]
    t = timeline.decode(stored.data)
    assert t.aborted_at == t.detected_at + 0.1 and t.overlapped == []
    assert t.phases()["abort"] == 0.1 and t.phases()["rendezvous"] == 0.0


def test_a_failure_during_a_recovery_joins_it(env):
    clock, coord, keys, events, recorder = env
    rec = recorder()
    _fail(clock, events)
    rec.on_failure("j", "n2", 0x2B, writer=True, aborted=True)
    clock.advance(1.0)
    rec.on_failure("j", "n3", 0x3C, writer=True, aborted=True)
    _recover(clock, rec, events, new_pid=44)
    rec.step()
    [stored] = [e for e in events.list() if e.kind == timeline.KIND]
    t = timeline.decode(stored.data)
    assert t.failed == ["n2", "n3"] and stored.node == "n2"
    assert t.phases()["abort"] == 0.0  # the first abort; the group it started never trained
    assert t.phases()["rendezvous"] == 1.51


def test_a_forged_failed_event_costs_only_its_detection(env, caplog):
    clock, coord, keys, events, recorder = env
    coord.put(keys.event("n2", 0x2B, "failed"), b'{"schema":1,"record":"event","kind":3}')
    rec = recorder()
    rec.on_failure("j", "n2", 0x2B, writer=True, aborted=True)
    _recover(clock, rec, events)
    with caplog.at_level(logging.WARNING):
        rec.step()
    assert "ignoring the failed event" in caplog.text
    [stored] = [e for e in events.list() if e.kind == timeline.KIND]
    t = timeline.decode(stored.data)
    assert t.detected_at == T0 and t.phases()["detect"] == 2.0  # its own detection, the TTL


# -- who writes, and the round closes the job watch sees -----------------------------------

@pytest.fixture
def manager(tmp_path):
    coord = MemoryCoordinator()
    keys = Keyspace("/t")
    lease = coord.grant_lease(10)
    spec = JobSpec(name="job", nnodes_min=2, nnodes_max=3, nproc_per_node=1,
                   script=sys.executable, args=[], script_sha256="0" * 64, user="root",
                   cwd=str(tmp_path))
    coord.put(keys.job_keys("job").spec, spec.encode())
    mgr = JobManager("n3", coord, keys, etcd="127.0.0.1:1", state_dir=str(tmp_path),
                     metrics=Metrics(), lease=lambda: lease, clock=FakeClock())
    mgr.records.start_watch()
    yield coord, keys, mgr, lease
    mgr.records.close()


def test_the_writer_is_the_lowest_surviving_node_that_ran_workers(manager):
    coord, keys, mgr, lease = manager
    # n0: a spare; n1: its workers just restarted (ranks emptied, its steps stay)
    for node, ranks, step in (("n1", [], 40), ("n2", [1], 40), ("n0", [], -1)):
        coord.put(keys.job_keys("job").node(node),
                  NodeJobStatus(node, "running", ranks=ranks, last_step=step).encode(), lease)
    mgr.records.refresh()
    mgr.group.job = "job"
    mgr.board.set("running", "", ranks=[2])
    assert mgr.recovery_writer("n2") == "n1"
    assert mgr.recovery_writer("n1") == "n2"
    coord.delete(keys.job_keys("job").node("n1"))
    coord.delete(keys.job_keys("job").node("n2"))
    mgr.records.refresh()
    mgr.board.set("running", "")
    assert mgr.recovery_writer("n2") == "n0"  # no node ran workers: a spare writes
    mgr.group.job = None
    assert mgr.recovery_writer("n1") is None


def test_a_round_record_is_noted_as_it_arrives_and_not_queued(manager):
    coord, keys, mgr, lease = manager
    seen = []
    mgr.on_round_closed = seen.append
    coord.put(keys.rendezvous("job").round, b"{}")
    coord.put(keys.rendezvous("job").prefix + b"native/nodes/a", b"{}")  # a join: not a close
    coord.put(keys.rendezvous("job").prefix + b"store/x", b"{}")
    assert seen == ["job"]
    assert mgr.records._feed.empty()


# -- elasticctl history -----------------------------------------------------------------------

def _history(coord, *argv):
    args = options.resolve(cli.build_parser().parse_args(
        ["history", "--etcd", "127.0.0.1:2379", *argv]))
    out = io.StringIO()
    assert cli._loop(args, coord, Keyspace("/t"), out) == 0
    return out.getvalue()


def test_history_shows_each_phase_in_both_formats(env):
    clock, coord, keys, events, recorder = env
    t = _full(aborted=[])
    events.record(Event(timeline.KIND, "n2", 0x2B, T0 + 5, "n1", t.describe(), t.as_dict(),
                        instance="j"))
    [row] = json.loads(_history(coord, "--format", "json"))
    assert row["kind"] == "timeline" and row["job"] == "j" and row["step"] == 40
    assert row["timeline"]["phases"] == t.phases()
    assert row["timeline"]["marks"]["aborted"] is None
    assert row["recovery_seconds"] == t.total == 3.9
    assert row["detection_seconds"] == 2.0 and row["source"] == "local+peer"
    assert row["restore_seconds"] == 0.3 and row["timeline"]["detect_range"] == [1.333, 2.75]
    text = _history(coord)
    table = text.split("recoveries (seconds per phase, from the failure to the first step):\n")[1]
    head, line = table.splitlines()[:2]
    assert head.split() == ["WHEN", "JOB", "FAILED", "PATH", "DETECT", "ABORT", "RENDEZVOUS",
                            "START", "RESTORE", "FIRST", "STEP", "TOTAL", "SOURCE", "BYTES",
                            "STEP"]
    # Only the lease placed the failure: the detect phase is shown as the range it can be.
    assert line.split()[1:] == ["j", "n2", "restart", "1.33-2.75", "-", "-", "0.75", "0.30",
                                "0.25", "3.90", "local+peer", "2.0", "KiB", "40"]
    assert ("  path restart (seconds): detect 2.000, abort -, rendezvous -, start 0.750, "
            "restore 0.300, first step 0.250") in text


def test_history_ignores_a_forged_timeline_with_one_warning(env, caplog):
    clock, coord, keys, events, recorder = env
    bad = {**_full().as_dict(), "first_step_at": "never"}
    events.record(Event(timeline.KIND, "n2", 0x2B, T0 + 5, "n1", "forged", bad, instance="j"))
    with caplog.at_level(logging.WARNING):
        [row] = json.loads(_history(coord, "--format", "json"))
        _history(coord)
    assert row["timeline"] is None and row["job"] is None
    assert caplog.text.count("ignoring the timeline of n2's failure") == 1
    assert "recoveries" not in _history(coord)


def test_every_phase_reads_in_the_table_even_from_an_old_or_partial_record(env):
    clock, coord, keys, events, recorder = env
    t = dataclasses.replace(_full(), restore_source="", ranks_restored=0, restore_bytes=0)
    events.record(Event(timeline.KIND, "n2", 0x2B, T0 + 5, "n1", "x", t.as_dict(),
                        instance="j"))
    assert "recoveries" in _history(coord, "--kind", "timeline")


def test_the_agents_report_of_its_abort_reaches_the_timeline():
    from elasticd.config import Settings
    from elasticd.daemon.daemon import Daemon

    clock = FakeClock()
    daemon = Daemon(Settings(node_id="n1", etcd="mem:1"),
                    MemoryCoordinator(MemoryStore(clock)), clock=clock)
    try:
        aborted = daemon.channel.handlers()["workers_aborted"]
        daemon.jobs.group.job = "j"
        assert aborted({"job": "other", "workers": 1}) is None  # not the job running here
        assert aborted({"job": "j", "workers": 1}) is None  # the server replies {}
        assert list(daemon.timeline._jobs["j"].aborts) == [clock.wall()]
        assert "other" not in daemon.timeline._jobs
    finally:
        daemon.jobs.group.job = None
        daemon.close()


def test_a_trained_workers_exit_is_an_abort_and_the_local_api_reports_it(env, tmp_path):
    import os
    import time

    from elasticd.daemon.local_api import LocalServer
    from elasticd.worker.client import DaemonClient, WorkerIdentity

    clock, coord, keys, events, recorder = env
    rec = recorder()
    server = LocalServer(str(tmp_path / "d.sock"), {"progress": rec.on_progress})
    server.on_close.append(lambda conn: rec.on_connection_closed({**conn, "job": "j"}))
    server.start()
    try:
        client = DaemonClient(server.path, WorkerIdentity(), timeout=1.0)
        client.send("progress", job="j", step=5)
        deadline = time.monotonic() + 5
        while not rec._jobs.get("j") or not rec._jobs["j"].stepped:
            assert time.monotonic() < deadline, "the progress never arrived"
            time.sleep(0.01)
        assert rec._jobs["j"].stepped == {os.getpid()} and not rec._jobs["j"].aborts
        client.close()  # as when the worker dies
        while not rec._jobs["j"].aborts:
            assert time.monotonic() < deadline, "the close was not reported"
            time.sleep(0.01)
    finally:
        server.stop()
    rec.on_connection_closed({"pid": 999999, "job": "j"})  # never trained: not an abort
    rec.on_connection_closed({"pid": 1, "job": None})
    assert len(rec._jobs["j"].aborts) == 1


def test_a_recovery_done_before_the_lease_expired_keeps_its_real_moments():
    # Killed outright: the survivors' agents re-formed at once and trained again 1.7 s after
    # the failure, before the daemons saw the lease expire (2.0 s): nothing is moved later
    # than it happened, and "detected" is the first moment anything noticed.
    # (The failure is placed a lease TTL before the detection at T0 + 2.3: T0 + 0.3.)
    t = _full(aborted=[T0 + 0.6], round_closed=[T0 + 0.8], first_steps=[T0 + 2.0],
              restores=[])
    assert t.first_step_at == T0 + 2.0 and t.overlapped == ["detected"]
    assert t.detected_at == T0 + 0.6 == t.aborted_at
    seen = [m for m in t.marks() if m is not None]
    assert seen == sorted(seen)
    assert t.total == 1.7


# -- where the failure is placed (its last sign of life) ---------------------------------------

def test_the_failure_is_placed_at_the_newest_sign_of_life_before_the_detection():
    # The lease alone: the last keep-alive, a TTL before the expiry was seen (etcd may see it
    # up to EXPIRY_SLACK late), and the next one was due TTL/3 later: the failure lies between,
    # and the detect phase is a range.
    t = _full()
    assert (t.failure_evidence, t.failure_at) == ("keepalive", T0 + 0.3)
    assert t.failure_latest_at == round(T0 + 0.3 + 2.0 / 3, 3)
    assert t.detect_range() == (1.333, 2.75)
    assert "detected 1.33-2.75 s after it" in t.describe()
    # A newer record write is a sign too (still only the lease's word: a range).
    t = _full(detection_seconds=1.5)
    assert (t.failure_evidence, t.phases()["detect"]) == ("record", 1.5)
    assert t.detect_range() is not None
    # A step the writer's workers trained with it, or a replication frame it sent: measured.
    t = _full(signs={"step": T0 + 1.9, "frame": T0 + 1.95})
    assert (t.failure_evidence, t.failure_at, t.failure_latest_at) == ("frame", T0 + 1.95, None)
    assert t.phases()["detect"] == 0.35 and t.detect_range() is None
    assert t.total == pytest.approx(sum(t.phases().values()))
    assert _full(signs={"step": T0 + 1.9, "frame": None}).failure_evidence == "step"
    # A step a little older than a TTL before the detection: etcd saw the lease gone late
    # (kill, last keep-alive, expiry seen 0.3 s after its due time): the step is the measure.
    t = _full(signs={"step": T0 + 0.05})
    assert (t.failure_evidence, t.failure_at, t.phases()["detect"]) == ("step", T0 + 0.05, 2.25)
    # Older than the lease allows (the node lived on without stepping): the lease places it.
    assert _full(signs={"step": T0 - 0.5}).failure_evidence == "keepalive"


def test_a_sign_after_the_detection_is_not_one_of_this_failure():
    # A node restarted under the same name, or a clock step: never placed after the detection.
    t = _full(signs={"frame": T0 + 2.4, "step": float("nan")})
    assert t.failure_evidence == "keepalive" and t.failure_at == T0 + 0.3
    assert timeline.place_failure(10.0, None, None, {}) == (None, "", None)
    assert timeline.place_failure(10.0, None, None, {"other": 9.0}) == (None, "", None)


def test_each_ranks_source_is_kept_by_rank():
    t = _full(restores=[
        timeline.RankRestore("j", T0 + 3.9, 0.2, "local", 10, 40, 2, "n3", 1),
        timeline.RankRestore("j", T0 + 3.9, 0.3, "peer", 20, 40, 1, "n4", 1),
        timeline.RankRestore("j", T0 + 3.8, 0.1, "local", 30, 40, 0, "n1", 0)])
    assert [(e["rank"], e["node"], e["source"]) for e in t.ranks] == [
        (0, "n1", "local"), (1, "n4", "peer"), (2, "n3", "local")]
    assert t.steps_lost == 1 and t.summary()["ranks"][1]["bytes"] == 20
    assert timeline.decode(json.loads(json.dumps(t.as_dict()))) == t


def test_each_rank_says_whether_it_was_kept_in_process_or_started_in_a_mixed_round(env):
    # Ranks 0 and 1 survived in-process; rank 2 is the replacement node's, started; an older
    # worker (rank 3) did not say.
    t = _full(path="in_process", reform={"group_made": T0 + 3.5}, restores=[
        timeline.RankRestore("j", T0 + 3.9, 0.2, "local", 10, 40, 0, "n1", 0, "in_process"),
        timeline.RankRestore("j", T0 + 3.9, 0.2, "local", 10, 40, 1, "n1", 0, "in_process"),
        timeline.RankRestore("j", T0 + 3.95, 0.3, "peer", 20, 40, 2, "n4", 0, "restart"),
        timeline.RankRestore("j", T0 + 3.95, 0.3, "peer", 20, 40, 3, "n4", 0)])
    assert t.rank_paths == {"0": "in_process", "1": "in_process", "2": "restart"}
    assert [e["path"] for e in t.summary()["ranks"]] == ["in_process", "in_process", "restart",
                                                         None]
    assert "(2 ranks kept, 1 started)" in t.describe()
    back = timeline.decode(json.loads(json.dumps(t.as_dict())))
    assert back == t
    # Stored beside the rank entries, whose keys a daemon of the release before checks.
    assert all(set(e) == set(timeline._RANK_KEYS) for e in t.as_dict()["ranks"])

    # A recovered event says it; elasticctl history prints it on the rank's line.
    data = {"job": "j", "rank": 2, "source": "peer", "seconds": 0.3, "step": 40,
            "path": "restart"}
    assert timeline.restore_of(data, T0, "n4").path == "restart"
    assert timeline.restore_of({**data, "path": "teleport"}, T0, "n4") is None
    lines = cli.rank_sources([{"timeline": t.summary()}])
    ranks = [line for line in lines if line.startswith("  rank ")]
    assert ranks[0].startswith("  rank 0 on n1: step 40 from local RAM")
    assert ranks[0].endswith("0 steps lost; its process kept in-process")
    assert ranks[2].startswith("  rank 2 on n4: step 40 from a peer's RAM")
    assert ranks[2].endswith("; its process started")
    assert ranks[3].endswith("0 steps lost")  # it did not say
    # On the restart path every rank was started: not said on each line.
    plain = _full(restores=[dataclasses.replace(r, path="restart") for r in (
        timeline.RankRestore("j", T0 + 3.9, 0.2, "local", 10, 40, 0, "n1", 0),)])
    assert cli.rank_sources([{"timeline": plain.summary()}])[-1].endswith("0 steps lost")


@pytest.mark.parametrize("change", [
    {"rank_paths": {"0": "teleport"}}, {"rank_paths": {"x": "restart"}},
    {"rank_paths": {"0": 1}}, {"rank_paths": ["restart"]},
])
def test_a_forged_rank_path_is_refused(change):
    with pytest.raises(records.CorruptRecord):
        timeline.decode({**_full().as_dict(), **change})


@pytest.mark.parametrize("change", [
    {"failure_evidence": "rumour"}, {"failure_latest_at": T0 + 9.0},
    {"failure_latest_at": T0 - 1.0}, {"ranks": [{"rank": 0}]}, {"ranks": ["x"]},
    {"ranks": [{"rank": 0, "node": "n1", "source": "peer", "seconds": -1.0, "bytes": 0,
                "step": 1, "steps_lost": 0}]},
    {"ranks": [{"rank": 0, "node": "n1", "source": "peer", "seconds": 1.0, "bytes": 0,
                "step": 1, "steps_lost": 0, "extra": 1}]},
])
def test_a_forged_placement_or_rank_entry_is_refused(change):
    with pytest.raises(records.CorruptRecord):
        timeline.decode({**_full().as_dict(), **change})


def test_a_record_written_before_signs_were_kept_still_reads():
    data = _full().as_dict()
    for key in ("failure_evidence", "failure_latest_at", "ranks"):
        del data[key]
    t = timeline.decode(data)
    assert t.failure_evidence == "" and t.ranks == [] and t.detect_range() is None
    assert "a lease TTL before its detection" in t.describe()


def test_the_writer_places_the_failure_at_its_workers_last_step_or_a_frame(env):
    clock, coord, keys, events, recorder = env
    heard = {}
    rec = TimelineRecorder("n1", coord, keys, events, Metrics(), clock, lambda: 2.0,
                           last_heard=heard.get)
    rec.on_progress({"job": "j", "step": 39, "_peer": {"pid": 11}})
    stepped = clock.wall()
    clock.advance(0.05)
    rec.on_connection_closed({"pid": 11, "job": "j"})  # gloo saw the dead peer: an abort
    clock.advance(1.5)
    _fail(clock, events)
    rec.on_failure("j", "n2", 0x2B, writer=True, aborted=False)
    _recover(clock, rec, events)  # the old worker's last words come after the abort
    rec.step()
    t = rec.last
    assert (t.failure_evidence, t.failure_at) == ("step", round(stepped, 3))
    assert t.phases()["detect"] == 1.55
    # A replication frame received later than that step is the newer sign.
    heard["n2"] = stepped + 0.02
    assert rec._assemble(rec_open(rec, "n2")).failure_evidence == "frame"


def rec_open(rec, node):
    from elasticd.daemon.recovery_timeline import _Recovery

    return _Recovery("j", [node], 0x2B, rec.clock.wall(), rec.clock.monotonic(), True)


def test_a_spares_failure_stops_no_step_so_steps_place_nothing(env):
    clock, coord, keys, events, recorder = env
    rec = recorder()
    rec.on_progress({"job": "j", "step": 39, "_peer": {"pid": 11}})
    clock.advance(1.0)
    _fail(clock, events)
    rec.on_failure("j", "n2", 0x2B, writer=True, aborted=True, in_group=False)
    _recover(clock, rec, events)
    rec.step()
    assert rec.last.failure_evidence == "keepalive"


def test_history_measures_the_failure_and_its_restores_from_the_timelines_placement(env):
    clock, coord, keys, events, recorder = env
    events.record(Event("failed", "n2", 0x2B, T0 + 2.3, "n3", "n2 failed",
                        {"detection_seconds": 2.0}))
    events.record(Event("recovered", "n4", 9, T0 + 3.9, "n4", "restored " + "x" * 120,
                        {"job": "j", "rank": 1, "source": "peer", "seconds": 0.2,
                         "steps_lost": 2, "bytes": 10, "step": 40}, instance="a"))
    t = _full(signs={"step": T0 + 0.55},
              restores=[timeline.RankRestore("j", T0 + 3.9, 0.2, "peer", 10, 40, 1, "n4", 2)])
    events.record(Event(timeline.KIND, "n2", 0x2B, T0 + 5, "n1", t.describe(), t.as_dict(),
                        instance="j"))
    failed, recovered, tl = json.loads(_history(coord, "--format", "json"))
    assert failed["detection_seconds"] == 1.75 == t.phases()["detect"]  # not the lease's 2.0
    assert recovered["recovery_seconds"] == 3.35  # from the failure as the timeline places it
    assert (tl["steps_lost"], tl["restore_seconds"], tl["recovery_seconds"]) == (2, 0.2, t.total)
    text = _history(coord)
    assert "x" * 120 in text  # the last column is never cut
    assert "  rank 1 on n4: step 40 from a peer's RAM (a copy on another node) in 0.200 s, " \
           "2 steps lost" in text
    assert "placed at its last step trained with the others" in text


def test_restores_recorded_before_the_failed_event_are_measured_from_the_failure(env):
    # One host: the survivors re-formed and restored before the lease was seen expired.
    clock, coord, keys, events, recorder = env
    events.record(Event("recovered", "n1", 9, T0 + 2.0, "n1", "restored",
                        {"job": "j", "rank": 0, "source": "peer", "seconds": 0.2,
                         "steps_lost": 0, "bytes": 10, "step": 40}, instance="a"))
    events.record(Event("failed", "n2", 0x2B, T0 + 2.3, "n3", "n2 failed",
                        {"detection_seconds": 2.0}))
    t = _full(signs={"step": T0 + 0.4}, first_steps=[T0 + 2.4],
              restores=[timeline.RankRestore("j", T0 + 2.0, 0.2, "peer", 10, 40, 0, "n1", 0)])
    events.record(Event(timeline.KIND, "n2", 0x2B, T0 + 3, "n1", t.describe(), t.as_dict(),
                        instance="j"))
    recovered, failed, _ = json.loads(_history(coord, "--format", "json"))
    assert recovered["recovery_seconds"] == 1.6 and failed["detection_seconds"] == 1.9


# -- the path a recovery took (issue 31: in-process or restart, each with its phases) ------------

def test_an_in_process_recovery_has_its_own_phases_from_its_reported_moments():
    # The agent's round closed at T0 + 2.6 (before the daemon's watch saw it, T0 + 2.9); the
    # slowest local worker made its new group at T0 + 2.65; restores T0 + 3.6 .. 3.95.
    reform = {"learned": T0 + 0.4, "round_closed": T0 + 2.6, "all_left": T0 + 2.6,
              "group_made": T0 + 2.65, "bogus": 1.0}
    t = _full(path="in_process", reform=reform)
    assert t.path == "in_process" and t.round_closed_at == T0 + 2.6
    assert t.group_made_at == T0 + 2.65
    assert t.reform == {k: v for k, v in reform.items() if k != "bogus"}
    assert t.path_phases() == {"detect": 2.0, "round_closed": 0.3, "group": 0.05,
                               "restore": 1.3, "first_step": 0.25}
    assert sum(t.path_phases().values()) == pytest.approx(t.total)
    assert "recovered in-process from n2's failure" in t.describe()
    assert "round_closed 0.30, group 0.05" in t.describe()
    assert timeline.decode(json.loads(json.dumps(t.as_dict()))) == t
    summary = t.summary()
    assert summary["path"] == "in_process" and summary["path_phases"] == t.path_phases()
    # The restart path keeps the phases it always had, and no moments of a re-formation.
    r = _full(reform=reform)
    assert r.path == "restart" and r.path_phases() == r.phases() and r.reform == {}
    assert r.group_made_at is None and r.round_closed_at == T0 + 2.6


def test_a_group_moment_out_of_its_place_is_kept_in_order():
    # Reported before the round closed (clocks of two processes): moved up to the close;
    # after the restore started: kept at the restore's start.
    assert _full(path="in_process", reform={"group_made": T0}).group_made_at == \
        _full().round_closed_at
    t = _full(path="in_process", reform={"group_made": T0 + 3.8})
    assert t.group_made_at == t.restore_started_at == T0 + 3.65


@pytest.mark.parametrize("change", [
    {"path": "teleport"}, {"group_made_at": T0 - 100}, {"reform": {"x": 1.0}},
    {"reform": {"learned": "now"}}, {"path": 3},
])
def test_a_forged_path_or_moment_is_refused(change):
    data = {**_full(path="in_process", reform={"group_made": T0 + 3.0}).as_dict(), **change}
    with pytest.raises(records.CorruptRecord):
        timeline.decode(data)


def test_a_record_written_before_paths_were_kept_reads_with_no_path():
    data = _full().as_dict()
    for k in ("path", "group_made_at", "reform"):
        del data[k]
    t = timeline.decode(data)
    assert t.path == "" and t.path_phases() == t.phases() and t.summary()["path"] is None


def test_the_writer_records_the_path_and_the_moments_its_agent_and_workers_reported(env):
    clock, coord, keys, events, recorder = env
    rec = recorder()
    rec.on_progress({"job": "j", "step": 1, "_peer": {"pid": 11}})  # its first step, long ago
    clock.advance(100)
    rec.on_progress({"job": "j", "step": 39, "_peer": {"pid": 11}})
    clock.advance(0.1)
    learned = clock.wall()
    _fail(clock, events)
    rec.on_failure("j", "n2", 0x2B, writer=True, aborted=False)
    clock.advance(0.2)
    closed = clock.wall()
    # Two local workers report their moments (the slower one's count), then the agent.
    for pid, made in ((11, closed + 0.01), (12, closed + 0.03)):
        rec.on_reform_moments({"job": "j", "_peer": {"pid": pid},
                               "times": {"learned": learned, "round_closed": closed,
                                         "left": closed, "assigned": closed,
                                         "group_made": made, "restored": 5.0}})
    rec.on_reform_moments({"job": "j", "times": {"left": closed}})  # no group: ignored
    rec.on_reformed({"job": "j", "path": "in_process", "seconds": 0.2,
                     "times": {"learned": learned, "round_closed": closed,
                               "all_left": closed}})
    clock.advance(0.1)
    rec.on_restore({"job": "j", "rank": 0, "step": 39})
    events.record(Event("recovered", "n1", 1, clock.wall(), "n1", "restored",
                        {"job": "j", "rank": 0, "source": "local", "seconds": 0.05,
                         "steps_lost": 0, "step": 39}, instance="a"))
    assert rec.step() is None
    clock.advance(0.02)
    # The kept process (pid 11, which stepped before the failure) trains again: a first step.
    rec.on_progress({"job": "j", "step": 40, "_peer": {"pid": 11}})
    assert rec.step() == "recovery timeline of j written"
    [stored] = [e for e in events.list() if e.kind == timeline.KIND]
    t = timeline.decode(stored.data)
    assert t.path == "in_process"
    assert t.reform == {"learned": round(learned, 3), "round_closed": round(closed, 3),
                        "all_left": round(closed, 3), "left": round(closed, 3),
                        "assigned": round(closed, 3), "group_made": round(closed + 0.03, 3)}
    assert t.round_closed_at == round(closed, 3)  # the agent's, before the watch's
    assert t.group_made_at == round(closed + 0.03, 3)
    assert list(t.path_phases()) == list(timeline.IN_PROCESS_PHASES)
    assert t.path_phases()["group"] == 0.03 and t.path_phases()["first_step"] == 0.02
    assert t.total is not None  # it trained again: the kept process's step counted


def test_a_recovery_with_no_word_from_an_agent_or_a_fallback_is_the_restart_path(env):
    clock, coord, keys, events, recorder = env
    for lease, said in ((0x2B, None), (0x3C, {"job": "j", "path": "restart",
                                              "why": "a local worker is not running"})):
        rec = recorder()
        rec.on_progress({"job": "j", "step": 39, "_peer": {"pid": 11}})
        _fail(clock, events, lease=lease)
        rec.on_failure("j", "n2", lease, writer=True, aborted=True)
        if said:
            rec.on_reformed(said)
        _recover(clock, rec, events)
        rec.step()
        assert rec.last is not None and rec.last.path == "restart"
        assert rec.last.path_phases() == rec.last.phases() and rec.last.reform == {}
        clock.advance(1000)


def test_the_agents_and_workers_reports_reach_the_timeline_through_the_daemon():
    from elasticd.config import Settings
    from elasticd.daemon.daemon import Daemon

    clock = FakeClock()
    daemon = Daemon(Settings(node_id="n1", etcd="mem:1"),
                    MemoryCoordinator(MemoryStore(clock)), clock=clock)
    try:
        handlers = daemon.channel.handlers()
        daemon.jobs.group.job = "j"
        assert handlers["reformed"]({"job": "j", "path": "in_process",
                                     "times": {"round_closed": 5.0}}) is None
        assert handlers["reform_moments"]({"job": "j", "times": {"group_made": 6.0}}) is None
        m = daemon.timeline._jobs["j"]
        assert [(p, t) for _, p, t in m.reforms] == [("in_process", {"round_closed": 5.0})]
        assert list(m.worker_moments) == [{"group_made": 6.0}]
    finally:
        daemon.jobs.group.job = None
        daemon.close()
