"""Builds elasticd's Grafana dashboards (JSON) from the panel lists below.

    python grafana/build.py          # rewrites grafana/dashboards/*.json

The committed JSON must equal what this script generates (tests/integration/test_dashboards.py
checks it), so edit the panels here, not the JSON. Every query uses an ``elasticd_`` metric and
is run against a real Prometheus by that test.

Grafana's own builder library (grafana-foundation-sdk) ships one release per Grafana version
under unusual version strings; for two dashboards of plain time series and stat panels a
hundred lines of our own keep the dependency list short.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def panel(title: str, exprs: list[tuple[str, str]], kind: str = "timeseries", unit: str = "",
          description: str = "", recovery: bool = False) -> dict[str, Any]:
    """One panel; ``exprs`` are (PromQL, legend) pairs. ``recovery`` marks panels that must
    show a non-zero value after a failure (the dashboard test checks it)."""
    return {
        "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(65 + i), "expr": e, "legendFormat": legend,
                     "datasource": DATASOURCE} for i, (e, legend) in enumerate(exprs)],
        "elasticd": {"recovery": recovery},
    }


Q = "[$__rate_interval]"
R = "[$__range]"

OVERVIEW = [
    ("Cluster health", [
        panel("Nodes alive", [("max(elasticd_nodes_alive)", "nodes")], "stat"),
        panel("etcd reachable (worst node)", [("min(elasticd_etcd_up)", "etcd up")], "stat"),
        panel("World size", [("max(elasticd_world_size)", "world size")], "stat"),
        panel("Nodes running a job", [("sum(elasticd_job_running)", "nodes")], "stat"),
        panel("etcd outages", [(f"sum(increase(elasticd_etcd_outages_total{R}))", "outages")],
              "stat"),
        panel("Lease keep-alive failures",
              [(f"sum(rate(elasticd_lease_keepalive_failures_total{Q}))", "failures/s")],
              unit="ops"),
    ]),
    ("Recovery", [
        panel("Node failures detected", [
            (f"max(increase(elasticd_node_failures_detected_total{R}))", "failures")], "stat",
              recovery=True, description="Failures seen (each survivor counts each one)."),
        panel("Failure detection latency", [
            ("histogram_quantile(0.5, sum by (le) "
             f"(increase(elasticd_failure_detection_seconds_bucket{R})))", "p50"),
            ("histogram_quantile(0.99, sum by (le) "
             f"(increase(elasticd_failure_detection_seconds_bucket{R})))", "p99")],
              unit="s", recovery=True),
        panel("Worker restarts by reason", [
            (f"sum by (reason) (increase(elasticd_worker_restarts_total{R}))", "{{reason}}")],
              recovery=True),
        panel("Rendezvous (restart to first step)", [
            ("histogram_quantile(0.5, sum by (le) "
             f"(increase(elasticd_rendezvous_seconds_bucket{R})))", "p50"),
            ("histogram_quantile(0.99, sum by (le) "
             f"(increase(elasticd_rendezvous_seconds_bucket{R})))", "p99")], unit="s",
              recovery=True),
        panel("Recovery phases (p50, p99)", [
            ("histogram_quantile(0.5, sum by (le, phase) "
             f"(increase(elasticd_recovery_phase_seconds_bucket{R})))", "p50 {{phase}}"),
            ("histogram_quantile(0.99, sum by (le, phase) "
             f"(increase(elasticd_recovery_phase_seconds_bucket{R})))", "p99 {{phase}}")],
              "bargauge", unit="s", recovery=True,
              description="Where recoveries spend their time, from a node's failure to the "
              "first step: detect, abort (workers killed), rendezvous (round closed), start "
              "(workers up, restore begun), restore, first_step. One observation per "
              "recovery; elasticctl history shows each one's timeline."),
        panel("Last recovery by phase", [
            ("max by (phase) (elasticd_last_recovery_phase_seconds and on (instance) "
             "(elasticd_last_recovery_timestamp_seconds == "
             "scalar(max(elasticd_last_recovery_timestamp_seconds))))", "{{phase}}")],
              "bargauge", unit="s", recovery=True,
              description="The phases of the newest recovery (from the node that wrote its "
              "timeline); a phase not seen is empty."),
        panel("Hangs detected", [(f"sum(increase(elasticd_hangs_detected_total{R}))", "hangs")],
              "stat"),
        panel("Jobs failed in a crash loop", [
            (f"sum(increase(elasticd_crash_loops_total{R}))", "jobs")], "stat",
              description="Worker groups restarted crash_loop_restarts times in a row with no "
              "new committed step: the job was stopped as failed (alerted)."),
        panel("Fencings", [(f"sum(increase(elasticd_fenced_total{R}))", "fenced")], "stat"),
        panel("Restores by source", [
            (f"sum by (source) (increase(elasticd_restores_total{R}))", "{{source}}")],
              recovery=True, description="Worker restores: local RAM, a peer's RAM, the "
              "persistent tier (alerted), none (fresh start)."),
        panel("Restore time by source (p99)", [
            ("histogram_quantile(0.99, sum by (le, source) "
             f"(increase(elasticd_restore_seconds_bucket{R})))", "{{source}}")], unit="s"),
        panel("Steps lost at the last restore", [
            ("max(elasticd_restore_steps_lost)", "steps")], "stat",
              description="Equals the sync lag at the failure."),
        panel("Shards fetched from holders", [
            (f"sum(increase(elasticd_replica_fetches_total{R}))", "fetches")], "stat",
              recovery=True),
        panel("Holders that failed a fetch", [
            (f"sum by (reason) (increase(elasticd_replica_fetch_failures_total{R}))",
             "{{reason}}")], description="missing, corrupt (checksum), unreachable; lost: "
              "no holder had an intact copy (persistent tier used)."),
    ]),
    ("Sync (in-RAM snapshots and their replicas)", [
        panel("Committed step", [("max(elasticd_committed_step)", "committed"),
                                 ("max(elasticd_persisted_step)", "persisted")], "stat",
              description="Every rank has m verified copies of the committed step."),
        panel("Sync lag (worst node)", [("max(elasticd_sync_lag_steps)", "steps")],
              description="Newest local snapshot minus committed step: what a failure now "
              "would lose."),
        panel("Ranks with fewer than m copies", [("max(elasticd_shards_unprotected)", "ranks")],
              "stat"),
        panel("Jobs UNPROTECTED by reason", [
            ("max by (reason) (elasticd_jobs_unprotected)", "{{reason}}")],
              description="snapshots_failing, no_placement, commit_lag, persist_stale: a node "
              "failure now "
              "would set the job back further than it should (alerted after 1 min)."),
        panel("Replication throughput", [
            (f"sum(rate(elasticd_replication_bytes_total{Q}))", "pushed"),
            (f"sum(rate(elasticd_replica_bytes_received_total{Q}))", "received")], unit="Bps"),
        panel("Push time (one rank's snapshot to one peer)", [
            ("histogram_quantile(0.5, sum by (le) "
             f"(rate(elasticd_replication_seconds_bucket{Q})))", "p50"),
            ("histogram_quantile(0.99, sum by (le) "
             f"(rate(elasticd_replication_seconds_bucket{Q})))", "p99")], unit="s"),
        panel("Replication failures by reason", [
            (f"sum by (reason) (increase(elasticd_replication_failures_total{R}))",
             "{{reason}}")]),
        panel("Intermediate steps skipped", [
            (f"sum(rate(elasticd_replication_skipped_total{Q}))", "skipped/s")], unit="ops"),
        panel("Snapshot stall (training loop wait, p99)", [
            ("histogram_quantile(0.99, sum by (le) "
             f"(rate(elasticd_snapshot_stall_seconds_bucket{Q})))", "p99")], unit="s"),
        panel("Shared memory held (all nodes)", [
            ("sum(elasticd_local_slot_bytes)", "own snapshots"),
            ("sum(elasticd_replica_bytes_held)", "replicas")], unit="bytes"),
        panel("Replica connections rejected", [
            (f"sum by (reason) (increase(elasticd_replication_connections_rejected_total{R}))",
             "{{reason}}")]),
        panel("Persistent tier writer busy", [
            (f"sum by (outcome) (increase(elasticd_persist_writer_busy_total{R}))",
             "{{outcome}}")], description="Steps due for the persistent tier that found its "
              "writer still flushing an earlier one: waited, skipped, dropped. Rising: the "
              "tier's disk is slower than the flush cadence asks (persist_stale alerts when "
              "a job is left without a recent complete step)."),
    ]),
]

NODE = [
    ("Node", [
        panel("Peers alive (this node's view)",
              [('elasticd_nodes_alive{instance=~"$instance"}', "{{instance}}")]),
        panel("etcd reachable", [('elasticd_etcd_up{instance=~"$instance"}', "{{instance}}")]),
        panel("Main loop cycles per second",
              [(f'rate(elasticd_loop_cycles_total{{instance=~"$instance"}}{Q})',
                "{{instance}}")], unit="ops"),
        panel("Seconds since the last loop cycle",
              [('time() - elasticd_loop_last_cycle_timestamp_seconds{instance=~"$instance"}',
                "{{instance}}")], unit="s"),
        panel("Leases lost", [(f'increase(elasticd_leases_lost_total{{instance=~"$instance"}}{R})',
                               "{{instance}}")], "stat"),
        panel("Job running", [('elasticd_job_running{instance=~"$instance"}', "{{instance}}")]),
        panel("World size", [('elasticd_world_size{instance=~"$instance"}', "{{instance}}")]),
        panel("Worker generations", [('elasticd_rendezvous_round{instance=~"$instance"}',
                                      "{{instance}}")]),
        panel("Version", [('elasticd_build_info{instance=~"$instance"}', "{{version}}")],
              "table"),
    ]),
    ("Sync", [
        panel("Snapshot, committed and persisted step", [
            ('elasticd_snapshot_step{instance=~"$instance"}', "{{instance}} snapshot"),
            ('elasticd_committed_step{instance=~"$instance"}', "{{instance}} committed"),
            ('elasticd_persisted_step{instance=~"$instance"}', "{{instance}} persisted")]),
        panel("Sync lag", [('elasticd_sync_lag_steps{instance=~"$instance"}', "{{instance}}")]),
        panel("Ranks with fewer than m copies",
              [('elasticd_shards_unprotected{instance=~"$instance"}', "{{instance}}")]),
        panel("Shared memory held", [
            ('elasticd_local_slot_bytes{instance=~"$instance"}', "{{instance}} own snapshots"),
            ('elasticd_replica_bytes_held{instance=~"$instance"}', "{{instance}} replicas"),
            ('elasticd_scratch_bytes{instance=~"$instance"}', "{{instance}} restore scratch")],
              unit="bytes", description="Budget: (1 + m-1) x state per node, and restore "
              "scratch up to scratch_cap_mib per job; see docs/operations.md."),
        panel("Bytes pushed and received", [
            (f'rate(elasticd_replication_bytes_total{{instance=~"$instance"}}{Q})',
             "{{instance}} pushed"),
            (f'rate(elasticd_replica_bytes_received_total{{instance=~"$instance"}}{Q})',
             "{{instance}} received")], unit="Bps"),
        panel("Push time p99", [
            ("histogram_quantile(0.99, sum by (le, instance) "
             f'(rate(elasticd_replication_seconds_bucket{{instance=~"$instance"}}{Q})))',
             "{{instance}}")], unit="s"),
        panel("Push failures by reason", [
            (f'sum by (instance, reason) (increase(elasticd_replication_failures_total'
             f'{{instance=~"$instance"}}{R}))', "{{instance}} {{reason}}")]),
        panel("Pushes received by outcome", [
            (f'sum by (instance, outcome) (increase(elasticd_replica_pushes_received_total'
             f'{{instance=~"$instance"}}{R}))', "{{instance}} {{outcome}}")]),
        panel("Protocol errors from authenticated peers", [
            (f'increase(elasticd_replica_protocol_errors_total{{instance=~"$instance"}}{R})',
             "{{instance}}")]),
        panel("Connections rejected by reason", [
            (f'sum by (instance, reason) (increase('
             f'elasticd_replication_connections_rejected_total{{instance=~"$instance"}}{R}))',
             "{{instance}} {{reason}}")]),
        panel("Restores by source", [
            (f'sum by (instance, source) (increase(elasticd_restores_total'
             f'{{instance=~"$instance"}}{R}))', "{{instance}} {{source}}")], recovery=True),
        panel("Restore time p99 by source", [
            ("histogram_quantile(0.99, sum by (le, instance, source) "
             f'(increase(elasticd_restore_seconds_bucket{{instance=~"$instance"}}{R})))',
             "{{instance}} {{source}}")], unit="s"),
        panel("Snapshot stall p99", [
            ("histogram_quantile(0.99, sum by (le, instance) "
             f'(rate(elasticd_snapshot_stall_seconds_bucket{{instance=~"$instance"}}{Q})))',
             "{{instance}}")], unit="s"),
        panel("Persistent tier writer busy", [
            (f'sum by (instance, outcome) (increase(elasticd_persist_writer_busy_total'
             f'{{instance=~"$instance"}}{R}))', "{{instance}} {{outcome}}")],
              description="waited, skipped, dropped: this node's tier disk is slower than "
              "the flush cadence."),
    ]),
]


def dashboard(uid: str, title: str, rows: list[tuple[str, list[dict]]],
              instance_var: bool) -> dict[str, Any]:
    panels, y, pid = [], 0, 1
    for row_title, row in rows:
        panels.append({"type": "row", "title": row_title, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, p in enumerate(row):
            w = 8 if p["type"] != "stat" else 4
            x = (i * w) % 24
            panels.append({**p, "id": pid, "gridPos": {"h": 6 if p["type"] == "stat" else 8,
                                                       "w": w, "x": x, "y": y + (i * w) // 24 * 8}})
            pid += 1
        y += ((len(row) * 8) // 24 + 1) * 8
    templating = [{"name": "datasource", "type": "datasource", "query": "prometheus",
                   "label": "Data source"}]
    if instance_var:
        templating.append({"name": "instance", "type": "query", "datasource": DATASOURCE,
                           "query": "label_values(elasticd_build_info, instance)",
                           "refresh": 2, "includeAll": True, "multi": True,
                           "label": "Node (instance)"})
    return {"uid": uid, "title": title, "tags": ["elasticd"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"}, "editable": True,
            "templating": {"list": templating}, "panels": panels}


def build() -> dict[str, dict[str, Any]]:
    return {
        "elasticd-overview.json": dashboard("elasticd-overview", "elasticd: cluster overview",
                                            OVERVIEW, instance_var=False),
        "elasticd-node.json": dashboard("elasticd-node", "elasticd: node", NODE,
                                        instance_var=True),
    }


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def main() -> int:
    out = os.path.join(HERE, "dashboards")
    os.makedirs(out, exist_ok=True)
    for name, doc in build().items():
        with open(os.path.join(out, name), "w") as fh:
            fh.write(render(doc))
        print(f"wrote grafana/dashboards/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
