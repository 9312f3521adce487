"""The scale simulator's reading of etcd's /metrics (bench/scale_etcd_probe.py): what a lost
lease at N = 1,000 is read against, so each figure must be the one etcd meant."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import scale_etcd_probe  # noqa: E402 - bench/ is not a package

METRICS = """\
# HELP etcd_server_proposals_committed_total The total number of consensus proposals committed.
# TYPE etcd_server_proposals_committed_total gauge
etcd_server_proposals_committed_total 1500
etcd_server_proposals_applied_total 1060
etcd_server_proposals_pending 12
etcd_debugging_mvcc_slow_watcher_total 3
etcd_debugging_mvcc_pending_events_total 40
etcd_server_slow_apply_total 7
etcd_debugging_server_lease_expired_total 2
etcd_disk_wal_fsync_duration_seconds_bucket{le="0.064"} 90
etcd_disk_wal_fsync_duration_seconds_bucket{le="0.128"} 95
etcd_disk_wal_fsync_duration_seconds_bucket{le="0.256"} 99
etcd_disk_wal_fsync_duration_seconds_bucket{le="+Inf"} 100
etcd_disk_backend_commit_duration_seconds_bucket{le="0.128"} 10
etcd_disk_backend_commit_duration_seconds_bucket{le="+Inf"} 10
grpc_server_handled_total{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 900
grpc_server_handled_total{grpc_code="Unavailable",grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"} 4
grpc_server_handled_total{grpc_code="Canceled",grpc_method="Watch",grpc_service="etcdserverpb.Watch",grpc_type="bidi_stream"} 0
"""


def test_the_apply_backlog_the_slow_disk_calls_and_the_failed_calls_are_read_as_etcd_meant():
    m = scale_etcd_probe.parse(METRICS)
    assert m["apply_backlog"] == 440  # committed - applied: what a renewal waits for
    assert (m["pending_proposals"], m["slow_watchers"], m["pending_events"]) == (12, 3, 40)
    assert (m["slow_applies"], m["leases_expired"]) == (7, 2)
    assert m["slow_fsyncs"] == 5  # above 128 ms: +Inf's count minus le="0.128"'s
    assert m["slow_backend_commits"] == 0
    assert m["failed:LeaseKeepAlive:Unavailable"] == 4
    assert not any(k.startswith("failed:Range") or k.startswith("failed:Watch") for k in m)
