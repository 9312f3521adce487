"""What users and operators depend on, written out literally so that a change shows as a diff.

The public names ``import elasticd`` and ``import elasticd.worker`` offer, every Prometheus
metric the daemon registers (read from the registry a real :class:`Daemon` builds), the etcd
key layout (every key :class:`Keyspace` builds, and where ``elasticctl`` finds the replication
records), ``elasticctl``'s commands and options (from its argparse parser) and the keys of each
command's ``--format json`` document (the real commands run on the in-memory coordinator). A
refactoring must leave all of this as it is; a deliberate change edits the literal here, in the
same commit, where a reviewer sees it.
"""

from __future__ import annotations

import argparse
import io
import json
import types
from typing import Any

import pytest

import elasticd
import elasticd.worker
from elasticd.cli import main as cli
from elasticd.cli import options
from elasticd.testing.clock import FakeClock
from elasticd.cluster import timeline
from elasticd.cluster.events import Event, EventLog
from elasticd.config import Settings
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.daemon.daemon import Daemon
from elasticd.daemon import main as daemon_main
from elasticd.daemon.http import StatusServer

# -- Python names -------------------------------------------------------------------------------

# in_process, Reformation, Round: added on purpose (issue 31), the in-process worker API.
ELASTICD_NAMES = ["Checkpointer", "ElasticSampler", "ElasticdError", "RNGState", "Reformation",
                  "RestoreResult", "Round", "in_process"]
WORKER_ALL = ["DaemonClient", "DaemonClientError", "DaemonError", "DaemonTimeout",
              "DaemonUnavailable", "WorkerIdentity", "default_client", "progress"]


def test_import_elasticd_offers_the_same_names():
    names = [n for n in dir(elasticd) if not n.startswith("_")
             and not isinstance(getattr(elasticd, n), types.ModuleType)]  # submodules: imports
    assert names == ELASTICD_NAMES
    assert not hasattr(elasticd, "__all__")
    assert elasticd.__version__ == "0.1.0"
    assert all(isinstance(getattr(elasticd, n), type) for n in ELASTICD_NAMES
               if n != "in_process")
    assert callable(elasticd.in_process)  # a decorator
    assert sorted(elasticd.worker.__all__) == WORKER_ALL
    assert all(hasattr(elasticd.worker, n) for n in WORKER_ALL)


# -- metrics ------------------------------------------------------------------------------------

#: Exposed name -> (type, label names).
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "elasticd_build_info": ("info", ("version",)),
    "elasticd_commit_coordinator": ("gauge", ()),
    "elasticd_committed_step": ("gauge", ()),
    "elasticd_compute_seconds": ("gauge", ()),
    "elasticd_straggler": ("gauge", ()),
    "elasticd_crash_loops_total": ("counter", ()),
    "elasticd_etcd_data_losses_total": ("counter", ()),
    "elasticd_etcd_outages_total": ("counter", ()),
    "elasticd_etcd_up": ("gauge", ()),
    "elasticd_failure_detection_seconds": ("histogram", ()),
    "elasticd_fenced_total": ("counter", ()),
    "elasticd_hang_timeout_seconds": ("gauge", ()),
    "elasticd_hangs_detected_total": ("counter", ()),
    "elasticd_job_running": ("gauge", ()),
    "elasticd_jobs_unprotected": ("gauge", ("reason",)),
    "elasticd_last_recovery_phase_seconds": ("gauge", ("phase",)),
    "elasticd_last_recovery_timestamp_seconds": ("gauge", ()),
    "elasticd_lease_keepalive_failures_total": ("counter", ()),
    "elasticd_leases_lost_total": ("counter", ()),
    "elasticd_local_slot_bytes": ("gauge", ()),
    "elasticd_loop_cycles_total": ("counter", ()),
    "elasticd_loop_last_cycle_timestamp_seconds": ("gauge", ()),
    "elasticd_node_departures_total": ("counter", ()),
    "elasticd_node_failures_detected_total": ("counter", ()),
    "elasticd_nodes_alive": ("gauge", ()),
    "elasticd_persist_seconds": ("histogram", ()),
    "elasticd_persisted_step": ("gauge", ()),
    "elasticd_persists_total": ("counter", ("outcome",)),
    # Added on purpose (issue 28): the persister's busy writer, counted but never exposed.
    "elasticd_persist_writer_busy_total": ("counter", ("outcome",)),
    "elasticd_provisional_expiries_total": ("counter", ("outcome",)),
    "elasticd_recovery_phase_seconds": ("histogram", ("phase",)),
    "elasticd_rendezvous_round": ("gauge", ()),
    "elasticd_rendezvous_seconds": ("histogram", ()),
    "elasticd_replica_bytes_held": ("gauge", ()),
    "elasticd_replica_bytes_received_total": ("counter", ()),
    "elasticd_replica_fetch_bytes_total": ("counter", ()),
    "elasticd_replica_fetch_seconds_total": ("counter", ()),
    "elasticd_replica_fetch_failures_total": ("counter", ("reason",)),
    "elasticd_replica_fetches_total": ("counter", ()),
    "elasticd_replica_protocol_errors_total": ("counter", ()),
    "elasticd_replica_pushes_received_total": ("counter", ("outcome",)),
    "elasticd_replication_bytes_total": ("counter", ()),
    "elasticd_replication_commit_wait_timeouts_total": ("counter", ()),
    "elasticd_replication_commits_total": ("counter", ()),
    "elasticd_replication_connections_rejected_total": ("counter", ("reason",)),
    "elasticd_replication_etcd_errors_total": ("counter", ()),
    "elasticd_replication_failures_total": ("counter", ("reason",)),
    "elasticd_replication_seconds": ("histogram", ()),
    "elasticd_replication_skipped_total": ("counter", ()),
    "elasticd_rereplications_total": ("counter", ()),
    "elasticd_restore_seconds": ("histogram", ("source",)),
    "elasticd_restore_steps_lost": ("gauge", ()),
    "elasticd_restores_total": ("counter", ("source",)),
    "elasticd_scratch_bytes": ("gauge", ()),
    "elasticd_scratch_refused_total": ("counter", ()),
    "elasticd_direct_fetch_bytes_total": ("counter", ("landed",)),
    "elasticd_direct_fetch_fallbacks_total": ("counter", ()),
    "elasticd_shards_unprotected": ("gauge", ()),
    "elasticd_snapshot_bytes": ("gauge", ()),
    "elasticd_snapshot_stall_seconds": ("histogram", ()),
    "elasticd_snapshot_step": ("gauge", ()),
    "elasticd_snapshots_refused_total": ("counter", ("source",)),
    "elasticd_snapshots_skipped_total": ("counter", ("reason",)),
    "elasticd_snapshots_newest_only_total": ("counter", ("reason",)),
    "elasticd_snapshots_total": ("counter", ()),
    "elasticd_sync_lag_steps": ("gauge", ()),
    "elasticd_worker_restarts_total": ("counter", ("reason",)),
    # Added on purpose (issue 31): the path an in-process job's recovery took.
    "elasticd_inprocess_recoveries_total": ("counter", ("path",)),
    "elasticd_world_size": ("gauge", ()),
}


def _exposed(family: Any) -> str:
    suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
    return family.name + suffix


def test_every_metric_the_daemon_registers():
    settings = Settings(node_id="n1", etcd="mem:1")
    daemon = Daemon(settings, MemoryCoordinator(MemoryStore(FakeClock())), clock=FakeClock())
    try:
        got = {}
        for family in daemon.metrics.registry.collect():
            labels = {k for s in family.samples for k in s.labels if k != "le"}
            got[_exposed(family)] = (family.type, tuple(sorted(labels)))
    finally:
        daemon.close()
    assert got == METRICS


# -- etcd keys ----------------------------------------------------------------------------------

KEYS = {
    "cluster": "/elasticd/cluster",
    "nodes": "/elasticd/nodes/",
    "node": "/elasticd/nodes/n1",
    "events": "/elasticd/events/",
    "event": "/elasticd/events/n1/0000000000001a2b/failed",
    "drains": "/elasticd/drain/",
    "drain": "/elasticd/drain/n1",
    "jobs": "/elasticd/jobs/",
    "job": "/elasticd/jobs/j/",
    "job_spec": "/elasticd/jobs/j/spec",
    "job_control": "/elasticd/jobs/j/control",
    "job_nodes": "/elasticd/jobs/j/nodes/",
    "job_node": "/elasticd/jobs/j/nodes/n1",
    "job_rdzv": "/elasticd/jobs/j/rdzv/",
    "job_placement": "/elasticd/jobs/j/placement",
    "job_ckpt": "/elasticd/jobs/j/ckpt/",
    "job_rdzv_round": "/elasticd/jobs/j/rdzv/native/round",
    "job_committed": "/elasticd/jobs/j/ckpt/committed",
    "job_commit_grid": "/elasticd/jobs/j/ckpt/committed.grid",
    "job_coordinator": "/elasticd/jobs/j/ckpt/committed.coordinator",
    "job_commit_ahead": "/elasticd/jobs/j/ckpt/committed.ahead",
    "job_commit_placement": "/elasticd/jobs/j/ckpt/placement",
    "job_replicated_prefix": "/elasticd/jobs/j/ckpt/replicated/",
    "job_replicated": "/elasticd/jobs/j/ckpt/replicated/n1",
    "job_fences": "/elasticd/jobs/j/ckpt/fence",
    "job_fence_prefix": "/elasticd/jobs/j/ckpt/fence/",
    "job_fence": "/elasticd/jobs/j/ckpt/fence/n1",
    "job_fence_epoch": "/elasticd/jobs/j/ckpt/fence.epoch",
}


def test_etcd_key_layout():
    k = Keyspace("/elasticd")
    job, rdzv, repl = k.job_keys("j"), k.rendezvous("j"), k.replication("j")
    built = {
        "cluster": k.cluster, "nodes": k.nodes, "node": k.node("n1"), "events": k.events,
        "event": k.event("n1", 0x1A2B, "failed"), "drains": k.drains, "drain": k.drain("n1"),
        "jobs": k.jobs, "job": k.job("j"),
        "job_spec": job.spec, "job_control": job.control, "job_nodes": job.nodes,
        "job_node": job.node("n1"),
        "job_rdzv": rdzv.prefix, "job_rdzv_round": rdzv.round,
        "job_placement": repl.placement, "job_ckpt": repl.ckpt, "job_committed": repl.committed,
        "job_commit_grid": repl.commit_grid, "job_coordinator": repl.coordinator,
        "job_commit_ahead": repl.commit_ahead, "job_commit_placement": repl.commit_placement,
        "job_replicated_prefix": repl.replicated_prefix, "job_replicated": repl.replicated("n1"),
        "job_fences": repl.fences, "job_fence_prefix": repl.fence_prefix,
        "job_fence": repl.fence("n1"), "job_fence_epoch": repl.fence_epoch,
    }
    # Each builder, by the view that holds it: a builder added or removed must be pinned here.
    # Keyspace.job_spec ... job_fence_epoch moved on purpose (issue 28) into the job's three
    # views; KEYS still names each key by its old builder, and no string changed.
    builders = {
        Keyspace: {"cluster", "nodes", "node", "events", "event", "drains", "drain", "jobs", "job",
                   "job_keys", "rendezvous", "replication", "node_of", "job_key", "prefix"},
        type(job): {"spec", "control", "nodes", "node", "path"},
        type(rdzv): {"prefix", "round", "path"},
        type(repl): {"placement", "ckpt", "committed", "commit_grid", "coordinator",
                     "commit_ahead", "commit_placement", "fences", "fence_epoch", "fence_prefix",
                     "fence", "replicated_prefix", "replicated", "path"},
    }
    for view, names in builders.items():
        instance = k if view is Keyspace else view("/elasticd/jobs/j")
        public = {n for n in dir(instance) if not n.startswith("_")}
        assert public == names, f"a key builder of {view.__name__} was added or removed: pin it"
    assert {n: v.decode() for n, v in built.items()} == KEYS
    assert k.node_of(b"/elasticd/nodes/n1") == "n1"
    assert k.job_key(b"/elasticd/jobs/j/nodes/n1") == ("j", "nodes", "n1")
    assert Keyspace("/other").node("n1") == b"/other/nodes/n1"
    assert Keyspace("/other").replication("j").fence("n1") == b"/other/jobs/j/ckpt/fence/n1"


# -- the replication wire format ------------------------------------------------------------------


def test_replication_wire_format():
    """Nodes of a cluster speak one protocol version; a change of the frames is a new version,
    refused by older peers with one line (test_replication_wire.py)."""
    from elasticd.replication import wire

    # v6: added on purpose (issue 30), a pretagged DATA frame carries a run of blocks; v7: a
    # FETCH may ask for several ranges (issue 30).
    assert wire.VERSION == 7
    assert (wire.MAGIC, wire.HEADER.format, wire.CHECKED.format) == (
        b"EDRP", "!4sBBHI16s", "!4sBBHI")
    assert (wire.OFFSET.format, wire.RUN.format, wire.RUN_ENTRY.format) == ("!Q", "!QI", "!I16s")
    assert (wire.FLAG_SEALED, wire.FLAG_PRETAGGED, wire.MAX_RUN_BLOCKS) == (1, 2, 64)
    assert {t.name: t.value for t in wire.FrameType} == {
        "HELLO": 1, "CHALLENGE": 2, "AUTH": 3, "PUT_BEGIN": 4, "DATA": 5, "PUT_END": 6,
        "ACK": 7, "NACK": 8, "FETCH": 9, "FETCH_REPLY": 10, "ERROR": 11, "REPORT": 12,
        "REPORT_REPLY": 13}


# -- elasticctl ---------------------------------------------------------------------------------

#: The options every command takes (before or after it).
SHARED_OPTIONS = ["--etcd", "--etcd-ca-cert", "--etcd-cert", "--etcd-key", "--etcd-password",
                  "--etcd-timeout", "--etcd-user", "--format", "--help", "--prefix", "--watch", "-h"]
#: Command -> its own options and positionals (``-h`` and the shared ones left out).
COMMANDS = {
    "nodes": [],
    "status": [],
    "history": ["--kind", "--limit"],
    "submit": [
        # --in-process: added on purpose (issue 31), the opt-in to in-process re-formation.
        "--crash-loop-restarts", "--cwd", "--env", "--hang-first-step", "--hang-timeout",
        "--hang-timeout-floor", "--in-process", "--max-restarts", "--nnodes", "--no-wait",
        # --reform-deadline: added on purpose (issue 31), the in-process deadline as a field.
        "--nproc-per-node", "--python", "--reform-deadline", "--straggler-drain",
        "--straggler-factor", "--straggler-steps", "--user", "args", "name", "script"],
    "jobs": [],
    "stop": ["--force", "--wait", "name"],
    "retry": ["name"],
    "logs": ["name"],
    "placement": ["job"],
    "checkpoints": ["job"],
    "drain": ["--force", "--no-wait", "--status", "--timeout", "--undo", "node"],
}


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(opt if a.option_strings else a.dest for a in parser._actions
                  for opt in (a.option_strings or [a.dest]))


def test_elasticctl_commands_and_options():
    parser = cli.build_parser()
    shared = _options(parser)
    assert [o for o in shared if o != "command"] == SHARED_OPTIONS
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    got = {name: [o for o in _options(p) if o not in shared] for name, p in sub.choices.items()}
    assert got == COMMANDS
    assert sorted(cli.COMMANDS) == sorted(got)


# -- elasticd -----------------------------------------------------------------------------------

#: ``elasticd``'s flags: one per setting of ``config.Settings`` (the cluster secret itself
#: excepted: a flag would show in ``ps``), and ``--config``.
ELASTICD_FLAGS = [
    "--agent-etcd-cert", "--agent-etcd-key", "--agent-etcd-users", "--agent-restarts",
    "--cluster-secret-file", "--config", "--etcd", "--etcd-ca-cert", "--etcd-cert", "--etcd-key",
    "--etcd-password", "--etcd-timeout", "--etcd-user", "--events-retention",
    "--heartbeat-interval", "--help", "--job-env-allow", "--job-python", "--job-users",
    "--lease-ttl", "--listen", "--log-level", "--loop-interval", "--memory-cap-mib", "--node-id",
    "--outage-grace", "--persist-dir", "--persist-every-seconds", "--persist-every-steps",
    "--persist-keep", "--prefix", "--provisional-grace", "--rdzv-grow", "--rdzv-last-call",
    "--replicas", "--replication-listen", "--scratch-cap-mib", "--shm-dir", "--state-dir",
    "--stop-grace", "--unprotected-lag-steps", "--worker-start", "-h"]


def test_elasticd_flags():
    assert _options(daemon_main.build_parser()) == ELASTICD_FLAGS


#: Replication records where ``elasticctl placement`` and ``checkpoints`` look for them.
REPLICATION_RECORDS = {
    b"/elasticd/jobs/j/placement":
        b'{"groups":[["n1"]],"holders":{"n1":["n1"]},"m":1,"nodes":["n1"],"ranks":{"n1":[0]},'
        b'"record":"placement","requested_m":1,"round":1,"schema":1,"strategy":"group"}',
    b"/elasticd/jobs/j/ckpt/committed":
        b'{"at":1.5,"generation":1,"holders":{"0":["n1"]},"m":1,"ranks":[0],'
        b'"record":"ckpt_committed","round":1,"schema":1,"step":40}',
    b"/elasticd/jobs/j/ckpt/committed.coordinator":
        b'{"at":1.5,"node":"n1","record":"ckpt_coordinator","schema":1,"term":7}',
}

#: A node's view of job ``j``, as a daemon writes it.
NODE_JOB_STATUS = (
    b'{"agent_pid":0,"agent_starts":0,"at":0.0,"detail":"ok","last_step":-1,"log":"",'
    b'"node":"n1","ranks":[0],"record":"node_job_status","schema":1,"state":"running",'
    b'"unprotected":"","worker_restarts":0,"world_size":0}')

#: A ``timeline`` event's ``timeline`` object in ``history`` and ``status`` (null for others).
#: (Added on purpose, issue 27: where the failure is placed, its range, each rank's source.)
# path, path_phases, reform: added on purpose (issue 31), the path a recovery took and its
# phases (a restart's record here: its path_phases are the phases).
TIMELINE_KEYS = (
    "detect_range failed failure_evidence job marks.aborted marks.detected marks.failure "
    "marks.first_step marks.restore_finished marks.restore_started marks.round_closed "
    "overlapped path path_phases.abort path_phases.detect path_phases.first_step "
    "path_phases.rendezvous path_phases.restore path_phases.start phases.abort "
    "phases.detect phases.first_step phases.rendezvous phases.restore phases.start "
    "ranks[].bytes ranks[].node ranks[].path ranks[].rank ranks[].seconds ranks[].source ranks[].step "
    "ranks[].steps_lost ranks_restored reform restore_bytes restore_source step steps_lost "
    "total_seconds").split()

#: Command -> the paths of its JSON document's values (``[]``: each element of a list; an
#: event's ``data`` is the event's own, not descended into).
JSON_KEYS = {
    "submit":
        "detail job nnodes nproc_per_node refused script script_sha256 state submitted user",
    "jobs": (
        "[].args [].desired [].hang_timeout [].job [].nnodes [].nodes.n1.agent_pid "
        "[].nodes.n1.agent_starts [].nodes.n1.at [].nodes.n1.compute_seconds "
        "[].nodes.n1.detail [].nodes.n1.hang_timeout "
        "[].nodes.n1.hang_timeout_source [].nodes.n1.last_step [].nodes.n1.log "
        "[].nodes.n1.node [].nodes.n1.ranks [].nodes.n1.state [].nodes.n1.straggler "
        "[].nodes.n1.unprotected "
        "[].nodes.n1.worker_restarts [].nodes.n1.world_size [].nproc_per_node [].protection "
        "[].reason [].running_on [].script [].state [].state_detail [].stragglers "
        "[].submitted_at [].user"),
    "logs":
        "[].hostname [].log [].node [].state",
    "nodes": (
        "[].address [].drain [].heartbeat_age_seconds [].hostname [].lease [].node [].pid "
        "[].sentence [].state [].up_seconds [].version"),
    "status": (
        "etcd nodes[].address nodes[].drain nodes[].heartbeat_age_seconds nodes[].hostname "
        "nodes[].lease nodes[].node nodes[].pid nodes[].sentence nodes[].state "
        "nodes[].up_seconds nodes[].version nodes_alive prefix recent_events[].at "
        "recent_events[].at_iso recent_events[].by recent_events[].data "
        "recent_events[].detail recent_events[].detection_seconds recent_events[].job "
        "recent_events[].kind recent_events[].lease recent_events[].node "
        "recent_events[].path recent_events[].rank "
        "recent_events[].recovery_seconds recent_events[].restore_seconds "
        "recent_events[].source recent_events[].step recent_events[].steps_lost "
        "recent_events[].timeline"
        + "".join(f" recent_events[].timeline.{k}" for k in TIMELINE_KEYS)),
    "history": (
        "[].at [].at_iso [].by [].data [].detail [].detection_seconds [].job [].kind [].lease "
        "[].node [].path [].rank [].recovery_seconds [].restore_seconds [].source [].step "
        "[].steps_lost [].timeline" + "".join(f" [].timeline.{k}" for k in TIMELINE_KEYS)),
    "placement": (
        "committed coordinator.node coordinator.since coordinator.term describe job m nodes "
        "ranks[].committed_holders ranks[].holders "
        "ranks[].live_copies ranks[].newest_replicated ranks[].owner ranks[].rank "
        "ranks[].under_replicated round strategy under_replicated_ranks"),
    "checkpoints": (
        "committed.at committed.generation committed.m committed.ranks committed.step "
        "coordinator.node coordinator.since coordinator.term job "
        "nodes[].latest_local nodes[].node nodes[].persisted nodes[].reachable "
        "nodes[].replica_bytes nodes[].snapshot_bytes nodes[].sync_lag nodes[].unprotected "
        "persisted placement "
        "ranks[].holders ranks[].owner ranks[].rank ranks[].versions unprotected"),
    "drain n1 --no-wait": (
        "by copies_done copies_failed copies_planned detail jobs node phase requested_at "
        "seconds state"),
    "drain n1 --status": (
        "by copies_done copies_failed copies_planned detail jobs node phase requested_at "
        "seconds state"),
    "drain n1 --undo": (
        "by copies_done copies_failed copies_planned detail jobs node phase previous_state "
        "requested_at seconds state undone"),
    "stop":
        "desired job still_running_on",
    "retry":
        "job refused_on retried",
}


def _paths(doc: Any, at: str = "") -> list[str]:
    if isinstance(doc, dict) and doc and not at.endswith("data"):
        return sorted(p for k, v in doc.items() for p in _paths(v, f"{at}.{k}" if at else k))
    if isinstance(doc, list) and doc and all(isinstance(v, dict) for v in doc):
        return sorted({p for v in doc for p in _paths(v, at + "[]")})
    return [at]


@pytest.fixture
def cluster():
    """One live daemon (serving /status on loopback) on the in-memory coordinator."""
    clock = FakeClock(1_000.0)
    store = MemoryStore(clock)
    coord = MemoryCoordinator(store)
    daemon = Daemon(Settings(node_id="n1", etcd="mem:1"), coord, clock=clock)
    server = StatusServer(("127.0.0.1", 0), daemon.metrics.registry, daemon.status, lambda: True)
    server.start()
    daemon.registration.http_address = server.address
    daemon.join(keep_alive_thread=False)
    try:
        yield coord
    finally:
        server.stop()
        daemon.close()


def test_elasticctl_json_keys(cluster, tmp_path):
    coord, keys = cluster, Keyspace("/elasticd")
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    EventLog(coord, keys).record(Event("failed", "n2", 7, 1_000.0, "n1", "n2 failed",
                                       {"detection_seconds": 2.5}))
    EventLog(coord, keys).record(Event("recovered", "n1", 7, 1_001.0, "n1", "restored",
                                       {"job": "j", "rank": 0, "source": "peer", "seconds": 0.5,
                                        "steps_lost": 1, "step": 40}, instance="1"))
    tl = timeline.assemble(job="j", failed=["n2"], detected_at=1_000.0, detection_seconds=2.5,
                           lease_ttl=2.0, aborted=[1_000.01], round_closed=[1_000.5],
                           restores=[timeline.RankRestore("j", 1_001.0, 0.5, "peer", 10, 40)],
                           first_steps=[1_001.2])
    EventLog(coord, keys).record(Event("timeline", "n2", 7, 1_001.5, "n1", tl.describe(),
                                       tl.as_dict(), instance="j"))
    for key, value in REPLICATION_RECORDS.items():
        coord.put(key, value)
    lines = [
        # --no-wait: no daemon cycle here answers (the keys are those of a wait's answer).
        ["submit", "j", "--nnodes", "1:2", "--nproc-per-node", "1", "--user", "nobody",
         "--no-wait", "--cwd", str(tmp_path), str(script), "--", "--epochs", "1"],
        ["jobs"], ["logs", "j"], ["nodes"], ["status"], ["history"], ["placement", "j"],
        ["checkpoints", "j"], ["drain", "n1", "--no-wait", "--force"],
        ["drain", "n1", "--status"], ["drain", "n1", "--undo"], ["retry", "j"],
        ["stop", "j", "--force"],
    ]
    got = {}
    for line in lines:
        if line == ["jobs"]:
            coord.put(b"/elasticd/jobs/j/nodes/n1", NODE_JOB_STATUS)
        args = options.resolve(cli.build_parser().parse_args(
            [*line[:1], "--format", "json", "--etcd", "127.0.0.1:2379", *line[1:]]))
        out = io.StringIO()
        assert cli._loop(args, coord, keys, out) == 0, line
        name = " ".join(line[:3] if line[0] == "drain" else line[:1])
        got[name] = " ".join(_paths(json.loads(out.getvalue())))
    assert got == JSON_KEYS
