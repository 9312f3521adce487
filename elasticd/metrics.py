"""Every Prometheus metric elasticd exports, defined in one place.

Naming follows Prometheus' rules: one ``elasticd_`` prefix, base units in the name, counters
end in ``_total``, no high-cardinality labels (no step, no peer id). Each daemon owns a fresh
``CollectorRegistry`` so that several daemons in one process (tests) never share a metric.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

import elasticd

# Failure detection is bounded below by the lease TTL (2 s in tests, 5-30 s in production).
DETECTION_BUCKETS = (0.5, 1, 2, 3, 4, 5, 7.5, 10, 15, 20, 30, 45, 60, 120)


class Metrics:
    """The daemon's metrics, registered in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.build_info = Info("elasticd_build", "elasticd version", registry=r)
        self.build_info.info({"version": elasticd.__version__})
        self.nodes_alive = Gauge(
            "elasticd_nodes_alive", "Nodes with a live record in etcd, as this node sees them",
            registry=r)
        self.etcd_up = Gauge(
            "elasticd_etcd_up", "1 when the last etcd request succeeded, else 0", registry=r)
        self.etcd_outages = Counter(
            "elasticd_etcd_outages_total", "Periods during which etcd was unreachable", registry=r)
        self.keepalive_failures = Counter(
            "elasticd_lease_keepalive_failures_total",
            "Lease keep-alive attempts that failed (etcd unreachable or lease lost)", registry=r)
        self.leases_lost = Counter(
            "elasticd_leases_lost_total", "Times this node found its lease gone", registry=r)
        self.node_failures = Counter(
            "elasticd_node_failures_detected_total",
            "Peer lease expiries this node saw and confirmed as failures", registry=r)
        self.node_departures = Counter(
            "elasticd_node_departures_total", "Peers that left cleanly (lease revoked)", registry=r)
        self.provisional_expiries = Counter(
            "elasticd_provisional_expiries_total",
            "Peer expiries seen while this node was cut off from etcd, by outcome",
            ["outcome"], registry=r)
        for outcome in ("rejoined", "confirmed"):
            self.provisional_expiries.labels(outcome)
        self.detection_seconds = Histogram(
            "elasticd_failure_detection_seconds",
            "From a failed peer's last heartbeat record to this node's detection of its expiry",
            buckets=DETECTION_BUCKETS, registry=r)
        self.fenced = Counter(
            "elasticd_fenced_total",
            "Times this node found itself declared dead and fenced itself", registry=r)
        self.worker_restarts = Counter(
            "elasticd_worker_restarts_total",
            "Worker group restarts this daemon caused or saw, by reason", ["reason"], registry=r)
        for reason in ("peer_failed", "hang", "agent_died"):
            self.worker_restarts.labels(reason)
        self.world_size = Gauge(
            "elasticd_world_size", "World size of the job's current worker group on this node",
            registry=r)
        self.rendezvous_round = Gauge(
            "elasticd_rendezvous_round",
            "Worker generations this node's agent has started for the job (restarts + 1)",
            registry=r)
        self.rendezvous_seconds = Histogram(
            "elasticd_rendezvous_seconds",
            "From a worker group (re)start to its first progress report (rendezvous, process "
            "group set-up and the first step)", buckets=(0.5, 1, 2, 3, 4, 5, 7.5, 10, 15, 20,
                                                         30, 60, 120, 300), registry=r)
        self.hangs = Counter(
            "elasticd_hangs_detected_total", "Worker groups restarted for making no progress",
            registry=r)
        self.job_running = Gauge(
            "elasticd_job_running", "1 while this node runs a job's agent", registry=r)
        self.loop_cycles = Counter(
            "elasticd_loop_cycles_total", "Main loop cycles completed", registry=r)
        self.loop_last_cycle = Gauge(
            "elasticd_loop_last_cycle_timestamp_seconds",
            "Wall time of the last completed main loop cycle", registry=r)
