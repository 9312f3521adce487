"""Every Prometheus metric elasticd exports, defined in one place.

Naming follows Prometheus' rules: one ``elasticd_`` prefix, base units in the name, counters
end in ``_total``, no high-cardinality labels (no step, no peer id). Each daemon owns a fresh
``CollectorRegistry`` so that several daemons in one process (tests) never share a metric.
"""

from __future__ import annotations

import collections
import logging
import threading
import types
from functools import partial
from typing import Any, Callable, Iterator, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

import elasticd

log = logging.getLogger(__name__)

# Failure detection is bounded below by the lease TTL (2 s in tests, 5-30 s in production).
DETECTION_BUCKETS = (0.5, 1, 2, 3, 4, 5, 7.5, 10, 15, 20, 30, 45, 60, 120)
# One phase of a recovery (elasticd.cluster.timeline): from a few ms (an abort, a restore from
# local RAM) to the lease TTL (detection) and minutes (a restore from disk, a slow rendezvous).
RECOVERY_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 20, 30,
                          60, 120, 300)
# One push of one rank's snapshot: a few KiB in tests (ms), 256 MiB took 0.07 s and 1 GiB
# ~0.3 s over loopback (bench/results/peer_restore.json, 3.8 GB/s), a multi-GiB shard over a
# real network several seconds.
REPLICATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                       10, 30, 60)

#: Label values of elasticd_replication_failures_total: the pusher's own reasons, then the
#: refusal codes a peer's sink sends (elasticd.replication.api); anything else is "other"
#: (a peer's code is never used as a label unchecked: it would be unbounded cardinality).
PUSH_FAILURE_REASONS = ("unreachable", "no_address", "connection", "remote", "source_missing",
                        "rereplication", "stale", "in_progress", "no_space", "other")
#: Label values of elasticd_recovery_phase_seconds (elasticd.cluster.timeline.PHASES; a test
#: compares: metrics imports no domain module).
RECOVERY_PHASES = ("detect", "abort", "rendezvous", "start", "restore", "first_step")
#: Label values of elasticd_replica_fetch_failures_total (elasticd.recovery.fetch).
FETCH_FAILURE_REASONS = ("missing", "corrupt", "protocol", "unreachable", "no_address", "lost",
                         "other")
#: Label values of elasticd_jobs_unprotected (checkpoint.protection.REASONS; a test compares).
UNPROTECTED_REASONS = ("snapshots_failing", "no_placement", "commit_lag", "persist_stale")
#: Label values of elasticd_persist_writer_busy_total (elasticd.store.service_snapshots).
PERSIST_BUSY_OUTCOMES = ("waited", "skipped", "dropped")
#: Label values of elasticd_replication_connections_rejected_total.
REJECT_REASONS = ("auth", "version", "tls")
#: Label values of elasticd_replica_pushes_received_total (the replica server's outcomes).
RECEIVED_OUTCOMES = ("committed", "refused", "aborted")


class CheckpointSink:
    """Turns the checkpoint service's events into metrics (elasticd.store.telemetry)."""

    def __init__(self, metrics: "Metrics") -> None:
        self.m = metrics

    def snapshot_completed(self, job: str, rank: int, step: int, nbytes: int,
                           stall_seconds: float) -> None:
        self.m.checkpoints.snapshots.inc()
        self.m.checkpoints.snapshot_stall_seconds.observe(stall_seconds)

    def snapshot_skipped(self, job: str, reason: str) -> None:
        self.m.checkpoints.snapshots_skipped.labels(reason).inc()

    def snapshot_newest_only(self, job: str, refused: str) -> None:
        self.m.checkpoints.snapshots_newest_only.labels(refused).inc()

    def snapshot_refused(self, job: str, source: str) -> None:
        self.m.restore.snapshots_refused.labels(source).inc()

    def scratch_refused(self, job: str) -> None:
        self.m.restore.scratch_refused.inc()

    def direct_fetched(self, job: str, wire_bytes: int, routed_bytes: int) -> None:
        self.m.restore.direct_bytes.labels("in_place").inc(routed_bytes)
        self.m.restore.direct_bytes.labels("staging").inc(max(0, wire_bytes - routed_bytes))

    def direct_fell_back(self, job: str) -> None:
        self.m.restore.direct_fell_back.inc()

    def restored(self, job: str, source: str, seconds: float, steps_lost: int,
                 nbytes: int) -> None:
        self.m.restore.restores.labels(source).inc()
        self.m.restore.seconds.labels(source).observe(seconds)
        self.m.restore.steps_lost.set(steps_lost)

    def persisted(self, job: str, step: int, seconds: float, nbytes: int, ok: bool) -> None:
        self.m.persistence.persists.labels("ok" if ok else "failed").inc()
        if ok:
            self.m.persistence.seconds.observe(seconds)

    def persist_writer_busy(self, job: str, outcome: str) -> None:
        self.m.persistence.writer_busy.labels(outcome).inc()

    def update(self, stats: Any) -> None:
        """Gauges from ``CheckpointService.stats()`` (a ``CheckpointStats``), once per cycle."""
        self.m.checkpoints.snapshot_bytes.set(stats.snapshot_bytes)
        self.m.checkpoints.snapshot_step.set(stats.snapshot_step)
        self.m.checkpoints.local_slot_bytes.set(stats.local_slot_bytes)
        self.m.restore.scratch_bytes.set(stats.scratch_bytes)
        for reason, count in stats.unprotected_jobs.items():
            self.m.checkpoints.jobs_unprotected.labels(reason).set(count)
        self.m.persistence.persisted_step.set(stats.persisted_step)


def _kinds(r: CollectorRegistry) -> tuple[Callable[..., Counter], Callable[..., Gauge],
                                          Callable[..., Histogram]]:
    """Counter, Gauge and Histogram constructors that register in ``r``."""
    return partial(Counter, registry=r), partial(Gauge, registry=r), partial(Histogram, registry=r)


class EtcdMetrics:
    """etcd's health as this node sees it, and this node's lease (lost, fenced)."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, gauge, _ = _kinds(r)
        self.up = gauge("elasticd_etcd_up", "1 when the last etcd request succeeded, else 0")
        self.outages = counter(
            "elasticd_etcd_outages_total", "Periods during which etcd was unreachable")
        self.data_losses = counter(
            "elasticd_etcd_data_losses_total",
            "Times this node found that etcd had lost its data (restarted empty)")
        self.keepalive_failures = counter(
            "elasticd_lease_keepalive_failures_total",
            "Lease keep-alive attempts that failed (etcd unreachable or lease lost)")
        self.leases_lost = counter(
            "elasticd_leases_lost_total", "Times this node found its lease gone")
        self.fenced = counter(
            "elasticd_fenced_total", "Times this node found itself declared dead and fenced itself")


class MembershipMetrics:
    """The cluster's members as this node sees them: alive, failed, departed, provisional."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, gauge, histogram = _kinds(r)
        self.nodes_alive = gauge(
            "elasticd_nodes_alive", "Nodes with a live record in etcd, as this node sees them")
        self.node_failures = counter(
            "elasticd_node_failures_detected_total",
            "Peer lease expiries this node saw and confirmed as failures")
        self.node_departures = counter(
            "elasticd_node_departures_total", "Peers that left cleanly (lease revoked)")
        self.provisional_expiries = counter(
            "elasticd_provisional_expiries_total",
            "Peer expiries seen while this node was cut off from etcd, by outcome", ["outcome"])
        for outcome in ("rejoined", "confirmed"):
            self.provisional_expiries.labels(outcome)
        self.detection_seconds = histogram(
            "elasticd_failure_detection_seconds",
            "From a failed peer's last sign of life this node can date (its record's last "
            "write, or one lease TTL before its expiry if later) to this node's detection of "
            "its expiry", buckets=DETECTION_BUCKETS)


class LoopMetrics:
    """The daemon's main loop: is it still turning."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, gauge, _ = _kinds(r)
        self.cycles = counter("elasticd_loop_cycles_total", "Main loop cycles completed")
        self.last_cycle = gauge(
            "elasticd_loop_last_cycle_timestamp_seconds",
            "Wall time of the last completed main loop cycle")


class RendezvousMetrics:
    """The job's worker groups as rendezvous forms them: size, generation, time to form, and
    the path an in-process job's recovery took."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, gauge, histogram = _kinds(r)
        self.recoveries = counter(
            "elasticd_inprocess_recoveries_total",
            "Recoveries of an in-process job after a peer's failure on this node, by the path "
            "its workers took: in_process (kept through the round) or restart (the fallback)",
            ["path"])
        for path in ("in_process", "restart"):
            self.recoveries.labels(path)
        self.world_size = gauge(
            "elasticd_world_size", "World size of the job's current worker group on this node")
        self.round = gauge(
            "elasticd_rendezvous_round",
            "Worker generations this node's agent has started for the job (restarts + 1)")
        self.seconds = histogram(
            "elasticd_rendezvous_seconds",
            "From a worker group (re)start to its first progress report (rendezvous, process "
            "group set-up and the first step)", buckets=(0.5, 1, 2, 3, 4, 5, 7.5, 10, 15, 20,
                                                         30, 60, 120, 300))


class JobMetrics:
    """The job's workers on this node: running, restarted, crash-looping, hung, straggling."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, gauge, _ = _kinds(r)
        self.worker_restarts = counter(
            "elasticd_worker_restarts_total",
            "Worker group restarts this daemon caused or saw, by reason", ["reason"])
        for reason in ("peer_failed", "hang", "agent_died"):
            self.worker_restarts.labels(reason)
        self.crash_loops = counter(
            "elasticd_crash_loops_total",
            "Jobs this node stopped as failed: worker groups restarted crash_loop_restarts "
            "times in a row without a new committed step")
        self.hangs = counter(
            "elasticd_hangs_detected_total", "Worker groups restarted for making no progress")
        self.hang_timeout_seconds = gauge(
            "elasticd_hang_timeout_seconds",
            "Seconds without progress after which this node restarts its job's workers: the "
            "job's --hang-timeout, or the timeout learned from its step times (0: off, or no "
            "job)")
        self.compute_seconds = gauge(
            "elasticd_compute_seconds",
            "This node's compute time per training step outside collectives (the median over "
            "its ranks of each one's last 50 steps, as its workers measure it; NaN: not "
            "measured)")
        self.compute_seconds.set(float("nan"))
        self.straggler = gauge(
            "elasticd_straggler",
            "1 while this node is named a straggler of its job: its compute time per step has "
            "stayed above the job's --straggler-factor times the other nodes' median "
            "(elasticd.agent.straggler)")
        self.running = gauge("elasticd_job_running", "1 while this node runs a job's agent")


class RecoveryMetrics:
    """Recovery timelines (written by one node per failure: daemon/recovery_timeline.py)."""

    def __init__(self, r: CollectorRegistry) -> None:
        _, gauge, histogram = _kinds(r)
        self.phase_seconds = histogram(
            "elasticd_recovery_phase_seconds",
            "Seconds of each phase of a recovery from a node's failure to the first step "
            "(detect, abort, rendezvous, start, restore, first_step); observed once per "
            "recovery, by the node that writes its timeline", ["phase"],
            buckets=RECOVERY_PHASE_BUCKETS)
        self.last_phase_seconds = gauge(
            "elasticd_last_recovery_phase_seconds",
            "Each phase of the last recovery whose timeline this node wrote (NaN: not seen)",
            ["phase"])
        self.last_timestamp = gauge(
            "elasticd_last_recovery_timestamp_seconds",
            "When the last recovery whose timeline this node wrote trained again (0: none)")
        for phase in RECOVERY_PHASES:
            self.phase_seconds.labels(phase)
            self.last_phase_seconds.labels(phase).set(float("nan"))


class CheckpointMetrics:
    """Snapshots in this node's RAM and whether its jobs are protected (fed by
    elasticd.store.service through CheckpointSink)."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, gauge, histogram = _kinds(r)
        self.snapshot_stall_seconds = histogram(
            "elasticd_snapshot_stall_seconds",
            "Time the training loop waited for one snapshot (save and optimizer hook)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        self.snapshots = counter("elasticd_snapshots_total", "Snapshots sealed in this node's RAM")
        self.snapshot_bytes = gauge("elasticd_snapshot_bytes",
                                    "Bytes of the latest snapshot of every local rank")
        self.snapshot_step = gauge("elasticd_snapshot_step",
                                   "Newest step every local rank holds in RAM")
        self.snapshots_skipped = counter(
            "elasticd_snapshots_skipped_total",
            "Snapshots skipped, by reason (over_budget: the memory cap; busy: slot pinned; "
            "commit_pending: both slots hold copies awaiting or holding the commit; grid: "
            "off the job's snapshot grid while commits lag)", ["reason"])
        self.snapshots_newest_only = counter(
            "elasticd_snapshots_newest_only_total",
            "Snapshots of an in-process job the commit slots refused, taken into its newest "
            "pair (this node's own restore only, never replicated), by why the commit slots "
            "refused them (a reason of elasticd_snapshots_skipped_total)", ["reason"])
        for reason in ("over_budget", "busy", "commit_pending", "grid"):
            self.snapshots_skipped.labels(reason)
            if reason != "over_budget":  # a newest pair is refused over the cap too
                self.snapshots_newest_only.labels(reason)
        self.jobs_unprotected = gauge(
            "elasticd_jobs_unprotected",
            "Jobs a node failure now would set back further than it should, by reason "
            "(snapshots_failing, no_placement, commit_lag, persist_stale)", ["reason"])
        for reason in UNPROTECTED_REASONS:
            self.jobs_unprotected.labels(reason)
        self.local_slot_bytes = gauge(
            "elasticd_local_slot_bytes",
            "Bytes of shared-memory slot files holding this node's own ranks' snapshots")


class RestoreMetrics:
    """Workers' restores: by source, how long, steps lost, copies refused, scratch."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, gauge, histogram = _kinds(r)
        self.snapshots_refused = counter(
            "elasticd_snapshots_refused_total",
            "Corrupt or truncated snapshots refused at restore, by source", ["source"])
        self.scratch_bytes = gauge(
            "elasticd_scratch_bytes",
            "Bytes of restore scratch (partial copies of old ranks' shards after a change of "
            "world size, and bookings for them) held on this node")
        self.scratch_refused = counter(
            "elasticd_scratch_refused_total",
            "Partial copies for a restore refused because they would take a job's scratch "
            "over its cap (scratch_cap_mib): that rank's restore failed")
        self.direct_bytes = counter(
            "elasticd_direct_fetch_bytes_total",
            "Bytes workers fetched themselves for a reshard over sessions handed over "
            "(elasticd/worker/direct.py), by where they landed: in_place (straight into the "
            "live tensors) or staging", ["landed"])
        for landed in ("in_place", "staging"):
            self.direct_bytes.labels(landed)
        self.direct_fell_back = counter(
            "elasticd_direct_fetch_fallbacks_total",
            "Reshards whose worker could not fetch its rows itself and took the daemon's "
            "path (the reason is in the restore's refused list)")
        self.restores = counter("elasticd_restores_total", "Worker restores, by source", ["source"])
        self.seconds = histogram(
            "elasticd_restore_seconds", "Time one worker took to restore, by source", ["source"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        for source in ("local", "peer", "persistent", "none"):
            self.restores.labels(source)
            self.snapshots_refused.labels(source)
            self.seconds.labels(source)
        self.steps_lost = gauge(
            "elasticd_restore_steps_lost", "Steps lost at the last restore")


class PersistenceMetrics:
    """Flushes of this node's ranks to the persistent tier."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, gauge, histogram = _kinds(r)
        self.persisted_step = gauge(
            "elasticd_persisted_step", "Newest step complete on the persistent tier")
        self.seconds = histogram(
            "elasticd_persist_seconds", "Time to flush this node's ranks of one step",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.persists = counter("elasticd_persists_total",
                                "Flushes to the persistent tier, by outcome", ["outcome"])
        for outcome in ("ok", "failed"):
            self.persists.labels(outcome)
        self.writer_busy = counter(
            "elasticd_persist_writer_busy_total",
            "Steps due for the persistent tier that found its writer still flushing an earlier "
            "one (its disk is slower than the flush cadence), by what became of them (waited: "
            "held for the writer, written once it is free unless a newer step replaces it; "
            "skipped: not written; dropped: held, but its copies were gone once the writer was "
            "free)", ["outcome"])
        for outcome in PERSIST_BUSY_OUTCOMES:
            self.writer_busy.labels(outcome)


class ReplicationMetrics:
    """Replication: pushes timed by ReplicationSink, connections the replica server rejected,
    and the replicator's and server's totals, read at scrape time by :attr:`collector`."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, _, histogram = _kinds(r)
        self.seconds = histogram(
            "elasticd_replication_seconds",
            "Time one push of a rank's snapshot to a peer took (sent, verified and stored)",
            buckets=REPLICATION_BUCKETS)
        self.rejected = counter(
            "elasticd_replication_connections_rejected_total",
            "Connections to this node's replica server rejected before any data, by reason "
            "(auth: no proof of the cluster secret or a replayed handshake; version: another "
            "wire protocol version; tls)", ["reason"])
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.collector = ReplicationCollector()
        r.register(self.collector)


class Metrics:
    """The daemon's metrics, registered in their own registry, grouped by what they measure."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.build_info = Info("elasticd_build", "elasticd version", registry=r)
        self.build_info.info({"version": elasticd.__version__})
        self.etcd = EtcdMetrics(r)
        self.membership = MembershipMetrics(r)
        self.loop = LoopMetrics(r)
        self.rendezvous = RendezvousMetrics(r)
        self.jobs = JobMetrics(r)
        self.recovery = RecoveryMetrics(r)
        self.checkpoints = CheckpointMetrics(r)
        self.restore = RestoreMetrics(r)
        self.persistence = PersistenceMetrics(r)
        self.replication = ReplicationMetrics(r)


class ReplicationSink:
    """Turns replication events into metrics: timed pushes (from the replicator's pusher) and
    rejected connections (the replica server's ``auth_failures`` callback)."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def pushed(self, seconds: float, nbytes: int) -> None:
        self.m.replication.seconds.observe(seconds)

    def rejected(self, peer: str, reason: str) -> None:
        """``reason`` is the server's text, ``"ExceptionName: message"``."""
        kind = reason.split(":", 1)[0]
        label = ("version" if kind == "UnsupportedVersion"
                 else "tls" if kind.startswith("SSL") else "auth")
        self.m.replication.rejected.labels(label).inc()


class ReplicationFigures(Protocol):
    """What the collector reads of ``Replicator.stats()`` (``recovery.replicator.
    ReplicationStats``, which ``tests/unit/test_metrics_replication.py`` checks against this):
    typed here so that this module imports no domain module and reads no attribute by name."""

    replication_bytes_total: int
    replication_failures_total: dict[str, int]
    replication_skipped_total: int
    replication_commit_wait_timeouts_total: int
    commits_total: int
    committed_step: int
    sync_lag_steps: int
    under_replicated_shards: int
    replica_bytes_held: int
    rereplications_total: int
    fetches_total: int
    fetch_bytes_total: int
    fetch_seconds_total: float
    fetch_failures_total: dict[str, int]
    etcd_errors_total: int
    commit_coordinator: int


class ServerFigures(Protocol):
    """What the collector reads of ``ReplicaServer.snapshot_stats()`` (``ServerStats``)."""

    pushes_committed: int
    pushes_refused: int
    pushes_aborted: int
    protocol_errors: int
    bytes_received: int


def _initial(*protocols: type) -> Any:
    """The figures exported while replication is off (or not attached yet): every family at
    its initial value (0, no labels counted, -1 for a step)."""
    return types.SimpleNamespace(**{
        name: {} if kind.startswith("dict") else -1 if name.endswith("_step") else 0
        for protocol in protocols for name, kind in protocol.__annotations__.items()})


class ReplicationCollector:
    """Exports the replicator's and the replica server's totals and gauges at scrape time.

    Before :meth:`attach` (replication off) every family is exported with zeros, so that the
    dashboards and alert rules see the same series on every node.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: Callable[[], ReplicationFigures] | None = None
        self._server: Callable[[], ServerFigures] | None = None

    def attach(self, stats: Callable[[], ReplicationFigures],
               server_stats: Callable[[], ServerFigures]) -> None:
        """``stats``: ``Replicator.stats``; ``server_stats``: ``ReplicaServer.snapshot_stats``."""
        with self._lock:
            self._stats, self._server = stats, server_stats

    def describe(self) -> list[Metric]:
        return list(self._families(None, None))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            stats_fn, server_fn = self._stats, self._server
        try:
            stats = stats_fn() if stats_fn is not None else None
            server = server_fn() if server_fn is not None else None
        except Exception:  # noqa: BLE001 — a scrape must not fail for one part; zeros would
            # make counters look reset, so these families are left out of this scrape instead.
            log.exception("reading replication statistics for /metrics failed")
            return
        yield from self._families(stats, server)

    @staticmethod
    def _families(stats: ReplicationFigures | None,
                  server_stats: ServerFigures | None) -> Iterator[Metric]:
        """None before :meth:`attach`: the initial values."""
        none = _initial(ReplicationFigures, ServerFigures)
        st: ReplicationFigures = stats if stats is not None else none
        server: ServerFigures = server_stats if server_stats is not None else none
        def by_label(name: str, doc: str, label: str, values: tuple[str, ...],
                     counts: dict[str, int]) -> Metric:
            folded: collections.Counter[str] = collections.Counter()
            for key, n in counts.items():
                folded[key.replace(" ", "_") if key.replace(" ", "_") in values else "other"] += n
            c = CounterMetricFamily(name, doc, labels=[label])
            for v in values:
                c.add_metric([v], folded.get(v, 0))
            return c

        yield CounterMetricFamily("elasticd_replication_bytes",
                                  "Bytes of snapshots pushed to peers",
                                  st.replication_bytes_total)
        yield by_label("elasticd_replication_failures",
                       "Snapshot pushes to peers that failed, by reason", "reason",
                       PUSH_FAILURE_REASONS, st.replication_failures_total)
        yield CounterMetricFamily("elasticd_replication_skipped",
                                  "Intermediate steps not pushed because a newer snapshot "
                                  "replaced them in a peer's lane (replication never queues "
                                  "without bound)", st.replication_skipped_total)
        yield CounterMetricFamily("elasticd_replication_commits",
                                  "Steps this node recorded as committed (every rank has m "
                                  "verified copies) as its job's commit coordinator",
                                  st.commits_total)
        yield GaugeMetricFamily("elasticd_commit_coordinator",
                                "1 while this node is its job's commit coordinator (summed "
                                "over a job's nodes: 1; 0 for longer than a lease TTL and the "
                                "job commits nothing)", st.commit_coordinator)
        yield GaugeMetricFamily("elasticd_committed_step",
                                "Newest committed step of this node's job (-1: none yet)",
                                st.committed_step)
        yield GaugeMetricFamily("elasticd_sync_lag_steps",
                                "Newest local snapshot step minus the committed step: the steps "
                                "a failure now would lose", st.sync_lag_steps)
        yield GaugeMetricFamily("elasticd_shards_unprotected",
                                "Ranks whose committed snapshot has fewer than m copies on "
                                "current members", st.under_replicated_shards)
        yield GaugeMetricFamily("elasticd_replica_bytes_held",
                                "Bytes of other nodes' snapshots (replicas) this node holds in "
                                "shared memory", st.replica_bytes_held)
        yield CounterMetricFamily("elasticd_rereplications",
                                  "Committed shards this node copied to a new holder after a "
                                  "membership change", st.rereplications_total)
        yield CounterMetricFamily("elasticd_replica_fetches",
                                  "Shards fetched for a restore (from a peer, or this node's own "
                                  "copy)", st.fetches_total)
        yield CounterMetricFamily("elasticd_replica_fetch_bytes",
                                  "Bytes of shards fetched for restores",
                                  st.fetch_bytes_total)
        yield CounterMetricFamily("elasticd_replica_fetch_seconds",
                                  "Seconds spent fetching shards for restores",
                                  st.fetch_seconds_total)
        yield CounterMetricFamily("elasticd_replication_commit_wait_timeouts",
                                  "Pushes that stopped waiting for the previous step's commit "
                                  "(its commit took longer than commit_wait)",
                                  st.replication_commit_wait_timeouts_total)
        yield CounterMetricFamily("elasticd_replication_etcd_errors",
                                  "etcd calls of the replicator that failed (placement, commit "
                                  "and holder records)", st.etcd_errors_total)
        yield by_label("elasticd_replica_fetch_failures",
                       "Holders that could not give a shard at restore, by reason (lost: no "
                       "holder had an intact copy; protocol: a holder that answered outside "
                       "the protocol or with an error)", "reason", FETCH_FAILURE_REASONS,
                       st.fetch_failures_total)
        yield by_label("elasticd_replica_pushes_received",
                       "Snapshot pushes this node's replica server received, by outcome "
                       "(aborted: torn, corrupt or interrupted, nothing stored)", "outcome",
                       RECEIVED_OUTCOMES,
                       {"committed": server.pushes_committed, "refused": server.pushes_refused,
                        "aborted": server.pushes_aborted})
        yield CounterMetricFamily("elasticd_replica_protocol_errors",
                                  "Connections from authenticated peers closed for breaking the "
                                  "protocol (malformed or corrupt frames; what they sent is not "
                                  "stored)", server.protocol_errors)
        yield CounterMetricFamily("elasticd_replica_bytes_received",
                                  "Bytes this node's replica server received from peers",
                                  server.bytes_received)
