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


class CheckpointSink:
    """Turns the checkpoint service's events into metrics (elasticd.checkpoint.telemetry)."""

    def __init__(self, metrics: "Metrics") -> None:
        self.m = metrics

    def snapshot_completed(self, job: str, rank: int, step: int, nbytes: int,
                           stall_seconds: float) -> None:
        self.m.snapshots.inc()
        self.m.snapshot_stall_seconds.observe(stall_seconds)

    def snapshot_skipped(self, job: str, reason: str) -> None:
        self.m.snapshots_skipped.labels(reason).inc()

    def snapshot_refused(self, job: str, source: str) -> None:
        self.m.snapshots_refused.labels(source).inc()

    def restored(self, job: str, source: str, seconds: float, steps_lost: int,
                 nbytes: int) -> None:
        self.m.restores.labels(source).inc()
        self.m.restore_seconds.labels(source).observe(seconds)
        self.m.restore_steps_lost.set(steps_lost)

    def persisted(self, job: str, step: int, seconds: float, nbytes: int, ok: bool) -> None:
        self.m.persists.labels("ok" if ok else "failed").inc()
        if ok:
            self.m.persist_seconds.observe(seconds)

    def update(self, stats: dict) -> None:
        """Gauges from CheckpointService.stats(), once per main-loop cycle."""
        self.m.snapshot_bytes.set(stats["snapshot_bytes"])
        self.m.snapshot_step.set(stats["snapshot_step"])
        self.m.replica_bytes_held.set(stats["replica_bytes_held"])
        self.m.jobs_unprotected.set(stats["unprotected_jobs"])
        self.m.persisted_step.set(stats["persisted_step"])


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
        # -- checkpoints (fed by elasticd.checkpoint.service through CheckpointSink) ---------
        self.snapshot_stall_seconds = Histogram(
            "elasticd_snapshot_stall_seconds",
            "Time the training loop waited for one snapshot (save and optimizer hook)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
            registry=r)
        self.snapshots = Counter("elasticd_snapshots_total",
                                 "Snapshots sealed in this node's RAM", registry=r)
        self.snapshot_bytes = Gauge("elasticd_snapshot_bytes",
                                    "Bytes of the latest snapshot of every local rank", registry=r)
        self.snapshot_step = Gauge("elasticd_snapshot_step",
                                   "Newest step every local rank holds in RAM", registry=r)
        self.snapshots_skipped = Counter(
            "elasticd_snapshots_skipped_total",
            "Snapshots skipped, by reason (over_budget: the memory cap; busy: slot pinned)",
            ["reason"], registry=r)
        for reason in ("over_budget", "busy"):
            self.snapshots_skipped.labels(reason)
        self.jobs_unprotected = Gauge(
            "elasticd_jobs_unprotected", "Jobs whose last snapshot was skipped over budget",
            registry=r)
        self.snapshots_refused = Counter(
            "elasticd_snapshots_refused_total",
            "Corrupt or truncated snapshots refused at restore, by source", ["source"],
            registry=r)
        self.replica_bytes_held = Gauge(
            "elasticd_replica_bytes_held", "Bytes of shared-memory slots this node holds",
            registry=r)
        self.persisted_step = Gauge("elasticd_persisted_step",
                                    "Newest step complete on the persistent tier", registry=r)
        self.persist_seconds = Histogram(
            "elasticd_persist_seconds", "Time to flush this node's ranks of one step",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.persists = Counter("elasticd_persists_total",
                                "Flushes to the persistent tier, by outcome", ["outcome"],
                                registry=r)
        for outcome in ("ok", "failed"):
            self.persists.labels(outcome)
        self.restores = Counter("elasticd_restores_total", "Worker restores, by source",
                                ["source"], registry=r)
        self.restore_seconds = Histogram(
            "elasticd_restore_seconds", "Time one worker took to restore, by source", ["source"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        for source in ("local", "peer", "persistent", "none"):
            self.restores.labels(source)
            self.snapshots_refused.labels(source)
            self.restore_seconds.labels(source)
        self.restore_steps_lost = Gauge("elasticd_restore_steps_lost",
                                        "Steps lost at the last restore", registry=r)
        self.loop_cycles = Counter(
            "elasticd_loop_cycles_total", "Main loop cycles completed", registry=r)
        self.loop_last_cycle = Gauge(
            "elasticd_loop_last_cycle_timestamp_seconds",
            "Wall time of the last completed main loop cycle", registry=r)
