"""Replication statistics become Prometheus metrics: totals and gauges read at scrape time,
pushes timed, rejected connections counted by reason, unknown reasons folded into "other"."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elasticd.metrics import Metrics, ReplicationFigures, ReplicationSink, ServerFigures
from elasticd.recovery.replicator import ReplicationStats
from elasticd.replication.server import ServerStats


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


STATS = dict(
    replication_bytes_total=4096, replication_skipped_total=3, commits_total=7,
    replication_failures_total={"unreachable": 2, "no_space": 1, "a peer's new code": 5},
    committed_step=41, sync_lag_steps=2, under_replicated_shards=1,
    replica_bytes_held=1 << 20, rereplications_total=4, fetches_total=2,
    fetch_bytes_total=2048, fetch_failures_total={"no address": 1, "corrupt": 1, "protocol": 4},
    replication_commit_wait_timeouts_total=6, etcd_errors_total=8, fetch_seconds_total=1.5,
)


def test_before_attach_every_family_is_exported_with_its_initial_value():
    got = samples(Metrics())
    assert got[("elasticd_committed_step", ())] == -1
    assert got[("elasticd_sync_lag_steps", ())] == 0
    assert got[("elasticd_replication_failures_total", (("reason", "stale"),))] == 0
    assert got[("elasticd_replica_pushes_received_total", (("outcome", "aborted"),))] == 0


def test_attached_statistics_are_read_at_scrape_time():
    m = Metrics()
    stats = ReplicationStats(**STATS)
    server = SimpleNamespace(pushes_committed=5, pushes_refused=1, pushes_aborted=2,
                             bytes_received=999, protocol_errors=3)
    m.replication.collector.attach(lambda: stats, lambda: server)
    got = samples(m)
    assert got[("elasticd_replication_bytes_total", ())] == 4096
    assert got[("elasticd_replication_commits_total", ())] == 7
    assert got[("elasticd_committed_step", ())] == 41
    assert got[("elasticd_sync_lag_steps", ())] == 2
    assert got[("elasticd_shards_unprotected", ())] == 1
    assert got[("elasticd_replica_bytes_held", ())] == 1 << 20
    assert got[("elasticd_replication_failures_total", (("reason", "unreachable"),))] == 2
    # A reason the exporter does not know is never a label of its own.
    assert got[("elasticd_replication_failures_total", (("reason", "other"),))] == 5
    assert got[("elasticd_replica_fetch_failures_total", (("reason", "no_address"),))] == 1
    assert got[("elasticd_replica_fetch_failures_total", (("reason", "protocol"),))] == 4
    assert got[("elasticd_replica_pushes_received_total", (("outcome", "aborted"),))] == 2
    assert got[("elasticd_replica_bytes_received_total", ())] == 999
    assert got[("elasticd_replica_protocol_errors_total", ())] == 3
    assert got[("elasticd_replication_commit_wait_timeouts_total", ())] == 6
    assert got[("elasticd_replication_etcd_errors_total", ())] == 8
    assert got[("elasticd_replica_fetch_seconds_total", ())] == 1.5
    stats.committed_step = 42  # the next scrape sees the new value
    assert samples(m)[("elasticd_committed_step", ())] == 42


def test_a_failing_source_leaves_its_families_out_but_the_scrape_works():
    m = Metrics()

    def broken():
        raise RuntimeError("replicator closing")

    m.replication.collector.attach(broken, lambda: None)
    got = samples(m)
    assert ("elasticd_committed_step", ()) not in got
    assert ("elasticd_nodes_alive", ()) in got


def test_sink_times_pushes_and_classifies_rejections():
    m = Metrics()
    sink = ReplicationSink(m)
    sink.pushed(0.003, 100)
    sink.pushed(0.4, 100)
    sink.rejected("127.0.0.1:5", "UnsupportedVersion: peer speaks replication protocol v2")
    sink.rejected("127.0.0.1:6", "AuthFailed: bad proof")
    sink.rejected("127.0.0.1:7", "SSLError: wrong version number")
    got = samples(m)
    assert got[("elasticd_replication_seconds_count", ())] == 2
    assert got[("elasticd_replication_seconds_bucket", (("le", "0.005"),))] == 1
    for reason in ("version", "auth", "tls"):
        assert got[("elasticd_replication_connections_rejected_total",
                    (("reason", reason),))] == 1


def test_the_exporter_reads_only_what_the_statistics_have():
    """metrics.py imports no domain module: it names what it reads in its own protocols, and
    these must be fields of the real statistics (a renamed field fails here, not at a scrape)."""
    for protocol, real in ((ReplicationFigures, ReplicationStats),
                           (ServerFigures, ServerStats)):
        fields = {f.name: f.type for f in dataclasses.fields(real)}
        for name, kind in protocol.__annotations__.items():
            assert name in fields, f"{real.__name__} has no {name}"
            assert str(kind) == str(fields[name]), (name, kind, fields[name])
