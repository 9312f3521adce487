"""The node daemon's main loop.

Each cycle takes what happened since the last one (watch events on the node records, lease
losses found by the keep-alive thread, the clock), decides what it means
(:mod:`elasticd.cluster.membership`), acts on it (events in etcd, metrics, fencing), and returns
one sentence saying what the node is doing — logged when it changes, shown in ``/status``, and
asserted in tests ("no action: I am n1, 3 nodes alive").

When etcd is unreachable the loop keeps cycling: it says so, keeps the node's workers running
for ``outage_grace`` seconds, and fences itself (stops its workers) only after that. When etcd
returns it re-watches, re-lists, and re-registers under the same node id.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from typing import Any, Callable

import elasticd
from elasticd.agent.manager import JobManager
from elasticd.clock import Clock, SystemClock
from elasticd.cluster.events import Event, EventLog
from elasticd.cluster.incarnation import Incarnation
from elasticd.cluster.membership import (Membership, NodeRecord, NodeState, Observation,
                                         ObservationKind, decode_node, joined_sentence)
from elasticd.config import Settings
from elasticd.coordination import records
from elasticd.coordination.api import (AuthError, CoordinationError, Coordinator, EventType,
                                       Unavailable)
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.lease import LeaseKeeper
from elasticd.coordination.watch_feed import WatchFeed
from elasticd.daemon.data_loss import DataLossRecovery
from elasticd.daemon.drain_host import DrainHosting
from elasticd.daemon.fencing import FenceHook, Fencing
from elasticd.daemon.recovery_timeline import TimelineRecorder
from elasticd.daemon.registration import NodeIdInUse, Registration
from elasticd.metrics import CheckpointSink, Metrics
from elasticd.recovery.drain import Drainer

log = logging.getLogger(__name__)


class Daemon(Registration, Fencing, DataLossRecovery, DrainHosting):
    """One node's daemon.

    Args:
        settings: validated settings.
        coord: the coordinator (real etcd or the in-memory fake).
        clock: injected time.
        metrics: the metrics to update (a fresh registry by default).
        http_address: the address peers and tools reach this node's HTTP endpoint at.
        membership: the cluster view (a fresh one by default; the node builder shares it
            with the replicator, which finds peers' replica servers in it).
        checkpoints: the checkpoint service served to workers, if any.
        replicator: peer replication, if on (its server and slots are the node builder's,
            :mod:`elasticd.daemon.node`).
        replication_address: where peers reach this node's replica server.
    """

    def __init__(self, settings: Settings, coord: Coordinator, clock: Clock | None = None,
                 metrics: Metrics | None = None, http_address: str = "", *,
                 membership: Membership | None = None, checkpoints: Any = None,
                 replicator: Any = None, replication_address: str = "") -> None:
        self.settings = settings
        self.coord = coord
        self.clock = clock or SystemClock()
        self.metrics = metrics or Metrics()
        self.keys = Keyspace(settings.prefix)
        self.events = EventLog(coord, self.keys, settings.events_retention)
        self.membership = membership or Membership(settings.node_id,
                                                   settings.provisional_seconds,
                                                   settings.lease_ttl)
        self.http_address = http_address
        self.incarnation = uuid.uuid4().hex[:12]
        # The cluster's incarnation in etcd: how a daemon recognises that etcd lost its data.
        self.cluster_incarnation = Incarnation(coord, self.keys, settings.node_id, self.clock)
        self._looked_at_cycle = -1  # the cycle that last looked for an etcd data loss
        self.started_at = self.clock.wall()
        self.fence_hooks: list[FenceHook] = []
        self.local_socket = ""  # path of the workers' channel to this daemon, once serving
        self.checkpoints: Any = checkpoints  # elasticd.store.service.CheckpointService
        self.replicator: Any = replicator  # elasticd.recovery.replicator.Replicator
        self.replication_address = replication_address
        #: What backs the slot directory (elasticd.store.huge_pages.SlotPages), set by the
        #: node builder; None without checkpoint slots.
        self.slot_pages: Any = None
        self._membership_key: Any = None

        self.health = EtcdHealth(self.clock, self._outage_started, self._outage_ended,
                                 describe=f"etcd at {settings.etcd or 'embedded'}")
        self._wake = threading.Event()
        self._feed = WatchFeed(wake=self._wake.set)
        self.keeper = LeaseKeeper(coord, settings.lease_ttl, self.health,
                                  on_change=self._wake.set, clock=self.clock,
                                  on_failure=self.metrics.keepalive_failures.inc)
        self.metrics.etcd_up.set(1)
        self.agent_credentials = self._agent_credentials()
        self.jobs = JobManager(
            settings.node_id, coord, self.keys, settings.etcd, settings.state_path, self.metrics,
            lease=lambda: self.registered_lease or 0, extra_env=self.agent_env,
            rdzv_conf=self.rdzv_conf(), agent_restarts=settings.agent_restarts,
            stop_grace=settings.stop_grace, warm_workers=settings.worker_start == "warm",
            clock=self.clock, before_resync=self._look_for_data_loss,
            policy=settings.job_policy(),
            credentials=self.agent_credentials.issue if self.agent_credentials else None)
        if self.agent_credentials is not None:
            self.jobs.on_job_end.append(self.agent_credentials.withdraw)
        self.fence_hooks.append(self.jobs.fence)
        self.jobs.committed = self._committed_step  # crash-loop detection
        self.jobs.record_event = self.record_event
        self.jobs.checks.wake = self.wake  # a job's file check ended: act on it now
        # Each recovery's timeline, written by one node (daemon/recovery_timeline.py).
        self.timeline = TimelineRecorder(settings.node_id, coord, self.keys, self.events,
                                         self.metrics, self.clock,
                                         lambda: float(self.settings.lease_ttl),
                                         last_heard=self._last_heard)
        self.jobs.on_round_closed = self.timeline.on_round_closed
        if checkpoints is not None:
            self._ckpt_sink = CheckpointSink(self.metrics)
            checkpoints.on_restore.append(self._record_recovery)
            checkpoints.on_restore.append(self.timeline.on_restore)
            # A Checkpointer's register and slot requests are progress reports (ranks, hangs).
            checkpoints.on_progress.append(self.jobs.on_progress)
            checkpoints.on_progress.append(self.timeline.on_progress)
            self.jobs.on_job_end.append(checkpoints.remove_job)
        if self.replicator is not None:
            self.jobs.on_job_end.append(self.replicator.remove_job)
        # The daemon is the drain's host (recovery.drain.DrainHost): daemon/drain_host.py.
        self.drainer = Drainer(settings.node_id, coord, self.keys, self,
                               stop_wait=settings.stop_grace + 10, clock=self.clock)

        self.state = NodeState.UP
        self.registered_lease: int | None = None
        self.sentence = "starting"
        self._stop = threading.Event()
        self._need_resync = False
        self._last_heartbeat = 0.0
        self._rewrite_record = False
        self._published_sentence = ""
        self._last_cycle = self.clock.monotonic()
        self._suspect: dict[int, float] = {}  # old lease -> until when to look for our failure
        self._fenced_for = ""
        self._notes: list[str] = []
        self.cycles = 0
        self.complaints = records.Complaints(log)  # bad records, each logged once

    # -- lifecycle ------------------------------------------------------------------------

    def join(self, keep_alive_thread: bool = True) -> None:
        """Grants the lease, registers the node and starts watching its peers.

        Args:
            keep_alive_thread: start the keep-alive thread (tests on a fake clock drive
                ``keeper.step()`` themselves).

        Raises:
            Unavailable: etcd cannot be reached (at start this is fatal: check --etcd).
            NodeIdInUse: a live daemon elsewhere holds the same node id.
        """
        self.keeper.grant()
        self.cluster_incarnation.check()  # the first look: writes the key on a new cluster
        if keep_alive_thread:
            self.keeper.start()
        self._start_watch()
        self.jobs.start_watch()
        self._register(wait_for_id=True)  # last: once our record is visible, we are in
        self.sentence = joined_sentence(self.settings.node_id)
        log.info("%s", self.sentence)

    def run(self, on_cycle: Callable[["Daemon"], None] = lambda _d: None) -> None:
        """Cycles until :meth:`request_stop`; ``on_cycle`` runs after each completed cycle."""
        while not self._stop.is_set():
            self.cycle()
            on_cycle(self)
            self._wait(self.settings.loop_interval)

    #: Settings that take effect only when the daemon restarts.
    RESTART_SETTINGS = ("node_id", "etcd", "prefix", "listen", "lease_ttl", "state_dir",
                        "etcd_user", "etcd_password", "etcd_ca_cert", "etcd_cert", "etcd_key",
                        "etcd_timeout")

    def apply_settings(self, new: Settings) -> list[str]:
        """Applies reloadable settings (SIGHUP); returns the changed ones that need a restart."""
        restart = [n for n in self.RESTART_SETTINGS
                   if getattr(new, n) != getattr(self.settings, n)]
        keep = {n: getattr(self.settings, n) for n in self.RESTART_SETTINGS}
        self.settings = dataclasses.replace(new, **keep)
        self.membership.provisional_seconds = self.settings.provisional_seconds
        self.events.retention = self.settings.events_retention
        self.jobs.agent_restarts = self.settings.agent_restarts
        self.jobs.stop_grace = self.settings.stop_grace
        self.jobs.rdzv_conf = self.rdzv_conf()
        self.jobs.policy = self.settings.job_policy()  # for the next job start
        return restart

    def wake(self) -> None:
        self._wake.set()

    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def leave(self) -> None:
        """Leaves the cluster cleanly: record ``leaving``, a departure event, revoke the lease.

        Peers see the departure at once and do not wait for a lease expiry. If etcd is
        unreachable the lease simply expires and peers record a failure, which is the truth
        as far as they can tell.
        """
        self.state = NodeState.LEAVING
        lease = self.keeper.lease
        # Workers stop after their snapshot in flight (new ones refused), then our replicas
        # go to peers so the committed step keeps m copies without us (both bounded:
        # systemd's TimeoutStopSec must cover them plus the stop grace).
        self.drainer.before_leave()
        try:
            self.jobs.shutdown()  # while our lease still holds our job status
        except CoordinationError as exc:
            log.warning("could not publish the job's final status: %s", exc)
        self.drainer.handoff_before_leave()
        try:
            if lease is not None and self.registered_lease == lease:
                self._put_record(lease)
                self.events.record(Event("left", self.settings.node_id, lease, self.clock.wall(),
                                         self.settings.node_id, "left the cluster cleanly"))
            self.keeper.stop(revoke=True)
        except CoordinationError as exc:
            log.warning("could not leave cleanly (%s); peers will see the lease expire", exc)
            self.keeper.stop()
        self._feed.close()

    def close(self) -> None:
        self.keeper.stop()
        self._feed.close()
        self.jobs.close()

    def rdzv_conf(self) -> dict[str, str]:
        """torchrun rendezvous settings for this cluster's agents, tuned for fast recovery."""
        s = self.settings
        return {
            "last_call_timeout": f"{s.rdzv_last_call:g}",
            "etcd_grace_period": f"{s.outage_grace:g}",
            "etcd_timeout": f"{s.etcd_timeout:g}",
            "join_timeout": "900",
            "grow": s.rdzv_grow,
            # A dead node leaves the round when its agent's etcd lease expires (the node's
            # TTL): the join record is bound to that lease (rendezvous_handler.py).
            "liveness_ttl": str(max(2, s.lease_ttl)),
            "liveness_confirm": "0.5",
            # The daemon restarts an agent that died: its error must not close the
            # rendezvous for every node (rendezvous.py, "Restartable agents").
            "close_on_failure": "false",
        }

    def _agent_credentials(self) -> Any:
        """What gives agents their own etcd credentials and TLS files (None: nothing to give,
        e.g. the embedded etcd)."""
        s = self.settings
        if not (s.etcd and hasattr(self.coord, "auth_call")
                and (s.agent_users_on or s.etcd_ca_cert)):
            return None
        from elasticd.coordination.agent_credentials import AgentCredentials

        return AgentCredentials(self.coord, self.keys, s.node_id,
                                os.path.join(s.state_path, "agent-etcd"), ca_cert=s.etcd_ca_cert,
                                agent_cert=s.agent_etcd_cert, agent_key=s.agent_etcd_key,
                                users=s.agent_users_on)

    def agent_env(self) -> dict[str, str]:
        """Environment the daemon adds for a job's agent and workers."""
        env = {"ELASTICD_PREFIX": self.settings.prefix}
        if self.local_socket:
            env["ELASTICD_SOCKET"] = self.local_socket
        return env

    def _update_replication(self) -> None:
        """Tells the replicator the job's current round: the nodes that run it, in rank
        order, with their ranks (as each node publishes them in its job status)."""
        job = self.jobs.job
        if self.replicator is None or job is None:
            return
        ranks = self.jobs.round_ranks()
        if not ranks or self.settings.node_id not in ranks:
            return
        nodes = sorted(ranks, key=lambda n: min(ranks[n]))
        key = (job, tuple((n, tuple(ranks[n])) for n in nodes))
        if key != self._membership_key:
            self._membership_key = key
            self.replicator.set_membership(job, nodes, {n: list(ranks[n]) for n in nodes})
            self._notes.append(f"replica placement for {len(nodes)} nodes")

    # -- events and recoveries ------------------------------------------------------------

    def _committed_step(self, job: str) -> tuple[int, int] | None:
        """The job's newest committed (generation, step) as replication last saw it."""
        if self.replicator is None:
            return None
        c = (self.replicator.status()["jobs"].get(job) or {}).get("committed")
        return (int(c[0]), int(c[1])) if c else None

    def _last_heard(self, node: str) -> float | None:
        """When this node's replica server last heard from ``node`` (a sign of life)."""
        return self.replicator.last_heard(node) if self.replicator is not None else None

    def record_event(self, kind: str, detail: str, data: dict[str, Any]) -> None:
        lease = self.registered_lease or self.keeper.lease or 0
        try:
            self.events.record(Event(kind, self.settings.node_id, lease, self.clock.wall(),
                                     self.settings.node_id, detail, data,
                                     instance=f"{self.clock.wall():.6f}"))
        except CoordinationError as exc:
            log.warning("could not record the %s event: %s", kind, exc)

    def _record_recovery(self, report: dict[str, Any]) -> None:
        """A worker restored (``ckpt_report``): a ``recovered`` event for elasticctl history."""
        if report.get("source") in (None, "none"):
            return  # a first start with nothing to restore is no recovery
        r = report
        self.record_event(
            "recovered", f"{r['job']} rank {r['rank']} restored step {r['step']} from "
            f"{r['source']} in {r['seconds']:.3f} s, {r['steps_lost']} steps lost",
            {k: r.get(k) for k in ("job", "rank", "source", "seconds", "steps_lost", "bytes",
                                   "generation", "step")})

    def _on_progress(self, msg: dict[str, Any]) -> None:
        self.jobs.on_progress(msg)
        self.timeline.on_progress(msg)

    def _workers_aborted(self, msg: dict[str, Any]) -> dict[str, Any]:
        job = msg.get("job", self.jobs.job)
        if isinstance(job, str) and job == self.jobs.job:
            self.timeline.on_abort(job, "agent")
        return {}

    def local_handlers(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        """What workers may ask of this daemon over its local socket."""
        handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
            "progress": self._on_progress,
            # The agent's daemon watch asks whether this daemon still answers.
            "ping": lambda msg: {"node": self.settings.node_id},
            # The agent killed its workers (a member of its round is gone): a moment of the
            # recovery's timeline. The job is the connection's (local_binding.py).
            "workers_aborted": self._workers_aborted,
        }
        if self.checkpoints is not None:
            handlers.update(self.checkpoints.handlers())
        return handlers

    # -- one cycle ------------------------------------------------------------------------

    def cycle(self) -> str:
        """Runs one cycle and returns its sentence."""
        now = self.clock.monotonic()
        self._notes = []
        try:
            self._handle_lost_leases()
            self._drain_events(now)
            # No periodic re-list: the watch is trusted until it says otherwise (an error
            # batch), a lease is found lost, or an outage ends; each of these also comes with
            # an etcd data loss (a wiped etcd knows none of our leases), and _resync looks
            # for one first (a watch resumed from the old revision would deliver nothing).
            if self._need_resync:
                self._resync(now)
            self._act(self.membership.tick(now))
            self._check_suspects(now)
            if self.registered_lease is None and self.state is not NodeState.LEAVING:
                self._register(wait_for_id=False)
            elif self._rewrite_record or (
                    self.settings.heartbeat_interval
                    and now - self._last_heartbeat >= self.settings.heartbeat_interval):
                # Our record went while our lease lives (deleted by hand, or etcd restored
                # from a snapshot without it): write it again at once. Liveness is the lease;
                # no timed rewrite unless heartbeat_interval asks for one.
                self._rewrite_record = False
                self._put_record(self.registered_lease)
            if self.state is NodeState.UP and self.registered_lease is not None:
                note = self.drainer.step() if self.health.up else None
                if note:
                    self._notes.append(note)
                if self.checkpoints is not None:
                    self.jobs.set_unprotected(self.checkpoints.unprotected(self.jobs.job))
                self.jobs.step()
                self._notes += self.jobs.notes
                note = self.timeline.step()
                if note:
                    self._notes.append(note)
            self.metrics.job_running.set(1 if self.jobs.supervisor is not None else 0)
            if self.checkpoints is not None:
                self._ckpt_sink.update(self.checkpoints.stats())
            self._update_replication()
            sentence = self._describe()
        except (Unavailable, AuthError) as exc:
            # Refused credentials are an outage too (after an etcd data loss the users are
            # gone until re-created): one line, the workers kept for the outage grace.
            self.health.failed(exc)
            sentence = self._describe_outage()
        except (CoordinationError, NodeIdInUse) as exc:
            log.warning("cycle failed: %s", exc)
            sentence = f"cycle failed ({exc}); retrying"
        except Exception as exc:  # noqa: BLE001 — one bad record must not end the daemon
            # Records are decoded with type checks; this is the net under a check missed:
            # the daemon keeps its node in the cluster (and /healthz answering) and says so.
            sentence = f"cycle failed ({exc.__class__.__name__}: {exc}); retrying"
            if self.complaints.warn(b"cycle", repr(exc).encode(), "%s", sentence):
                log.exception("cycle failed")
        if not self.health.up:
            self._maybe_fence_for_outage()
            sentence = self._describe_outage()
        self._finish_cycle(sentence)
        return sentence

    def _finish_cycle(self, sentence: str) -> None:
        (log.info if sentence != self.sentence else log.debug)("%s", sentence)
        self.sentence = sentence
        if (sentence != self._published_sentence and self.health.up
                and self.registered_lease is not None
                and self.clock.monotonic() - self._last_heartbeat >= 1.0):
            # Publish what we are doing for elasticctl, at most once a second; a change that
            # came within that second goes out at the next cycle after it (no timed rewrite
            # would publish it later).
            try:
                self._put_record(self.registered_lease)
            except CoordinationError as exc:
                self.health.failed(exc)
        self.cycles += 1
        self._last_cycle = self.clock.monotonic()
        self.metrics.loop_cycles.inc()
        self.metrics.loop_last_cycle.set(self.clock.wall())
        self.metrics.nodes_alive.set(len(self.membership.nodes))
        self.metrics.etcd_up.set(1 if self.health.up else 0)

    def _describe(self) -> str:
        me = self.settings.node_id
        alive = len(self.membership.nodes)
        if self._notes:
            return "; ".join(self._notes) + f" ({alive} nodes alive)"
        if self.jobs.job is not None:
            return f"running job {self.jobs.job}: I am {me}, {alive} nodes alive"
        if self.membership.pending:
            waiting = ", ".join(sorted(self.membership.pending))
            return (f"waiting for {waiting} to re-register after an etcd outage "
                    f"before recording a failure; I am {me}, {alive} nodes alive")
        return f"no action: I am {me}, {alive} nodes alive"

    # -- peers ----------------------------------------------------------------------------

    def _start_watch(self) -> None:
        kvs, revision = self.coord.get_prefix(self.keys.nodes)
        now = self.clock.monotonic()
        self._act(self.membership.reset(self._decode_all(kvs), now, self.clock.wall(), False))
        # No prev_kv: a DELETE's previous record (which tells a departure from a failure) is
        # the membership's own copy, kept from the listing and every PUT since; etcd would read
        # it from its backend for every event to every daemon (N² reads at a cold start).
        self._feed.start(self.coord, self.keys.nodes, revision + 1)

    def _decode_all(self, kvs: list[Any]) -> list[NodeRecord]:
        return [rec for kv in kvs if (rec := self._decode_node(kv.key, kv.value)) is not None]

    def _decode_node(self, key: bytes, value: bytes) -> NodeRecord | None:
        """A peer's record, or None (a bad one is logged once and ignored)."""
        try:
            return decode_node(value, key, self.keys)
        except records.RecordError as exc:
            self.complaints.warn(key, value, "ignoring node record: %s", exc)
            return None

    def _drain_events(self, now: float) -> None:
        cut_off = self.health.cut_off_within(self.settings.lease_ttl + 2 * self.settings.loop_interval + 1)
        events, stale = self._feed.take()
        # A broken watch re-creates itself, from the revision after the last event; if etcd
        # came back empty that revision is in the old cluster's past and the stream stays
        # silent: re-list (which also looks for a data loss).
        self._need_resync |= stale
        for ev in events:
            if ev.type is EventType.PUT:
                rec = self._decode_node(ev.kv.key, ev.kv.value)
                if rec is not None:
                    self._act(self.membership.on_put(rec))
                continue
            try:
                node = self.keys.node_of(ev.kv.key)
            except ValueError:
                continue  # never a node: its record was ignored when it was written
            if node == self.settings.node_id and self.state is not NodeState.LEAVING:
                self._rewrite_record = True
            self._act(self.membership.on_delete(node, now, self.clock.wall(), cut_off))

    def _resync(self, now: float) -> None:
        if self._look_for_data_loss():
            return  # the recovery re-listed
        kvs, revision = self.coord.get_prefix(self.keys.nodes)
        if self.cluster_incarnation.observe(revision) and self._look_for_data_loss(again=True):
            return
        self.health.ok()
        cut_off = self.health.cut_off_within(self.settings.lease_ttl + 2 * self.settings.loop_interval + 1)
        self._act(self.membership.reset(self._decode_all(kvs), now, self.clock.wall(), cut_off))
        self._need_resync = False

    def _prepare_restore(self, job: str) -> None:
        """This node's workers of ``job`` restore once the new round forms: the checkpoint
        service sets the scratch of their partial copies aside now (in a thread of its own),
        touched while detection and the rendezvous run rather than during the restore."""
        if self.checkpoints is None:
            return
        try:
            nbytes = self.checkpoints.membership_changed(job)
        except Exception:  # noqa: BLE001 — an optimisation: the restore reserves what it needs
            log.exception("%s: setting restore scratch aside failed", job)
            return
        if nbytes:
            self._notes.append(f"{nbytes >> 20} MiB of restore scratch set aside")

    def _act(self, observations: list[Observation]) -> None:
        for ob in observations:
            self._notes.append(ob.describe())
            if ob.kind is ObservationKind.FAILED:
                self.metrics.node_failures.inc()
                job, writer = self.jobs.job, self.jobs.recovery_writer(ob.node)
                in_group = self.jobs.ran_workers(ob.node)
                aborted = self.jobs.on_peer_failed(ob.node)
                if job is not None and aborted is not None:
                    self.timeline.on_failure(job, ob.node, ob.record.lease,
                                             writer == self.settings.node_id, aborted > 0,
                                             in_group)
                    self._prepare_restore(job)
                if ob.detection_seconds is not None:
                    self.metrics.detection_seconds.observe(ob.detection_seconds)
                self.events.record(Event(
                    "failed", ob.node, ob.record.lease, self.clock.wall(), self.settings.node_id,
                    ob.describe(), {"detection_seconds": round(ob.detection_seconds or 0.0, 3),
                                    "heartbeat_at": ob.record.heartbeat_at}))
                if ob.was_provisional:
                    self.metrics.provisional_expiries.labels("confirmed").inc()
            elif ob.kind is ObservationKind.DEPARTED:
                self.metrics.node_departures.inc()
            elif ob.kind is ObservationKind.REJOINED:
                self.metrics.provisional_expiries.labels("rejoined").inc()
            log.info("observed: %s", ob.describe())

    # -- waiting and status ---------------------------------------------------------------

    def _wait(self, seconds: float) -> None:
        if self._feed.empty():
            self._wake.wait(seconds)
        self._wake.clear()

    def healthy(self) -> bool:
        """Whether the loop completed a cycle recently (what /healthz and the watchdog use)."""
        limit = max(3 * self.settings.loop_interval, 2 * self.settings.etcd_timeout + 1)
        return self.clock.monotonic() - self._last_cycle <= limit

    def status(self) -> dict[str, Any]:
        now = self.clock.wall()
        return {
            "node": self.settings.node_id,
            "state": self.state.value,
            "sentence": self.sentence,
            "etcd_up": self.health.up,
            "etcd_outage_seconds": round(self.health.outage_seconds(), 3),
            "lease": f"{self.registered_lease:x}" if self.registered_lease else None,
            "fenced_for": self._fenced_for or None,
            "cycles": self.cycles,
            "version": elasticd.__version__,
            "prefix": self.settings.prefix,
            "peers": [
                {"node": r.node, "state": r.state, "address": r.address,
                 "heartbeat_age_seconds": round(max(0.0, now - r.heartbeat_at), 3)}
                for r in sorted(self.membership.nodes.values(), key=lambda r: r.node)
                if r.node != self.settings.node_id
            ],
            "provisional": sorted(self.membership.pending),
            "job": self.jobs.describe(),
            "drain": self.drainer.state or None,
            "checkpoints": self.checkpoints.status() if self.checkpoints is not None else None,
            "shm": ({"dir": self.settings.shm_path, "huge_pages": self.slot_pages.huge_pages,
                     "detail": self.slot_pages.describe()}
                    if self.slot_pages is not None else None),
            "replication": ({**self.replicator.status(), "round_ranks": self.jobs.round_ranks()}
                            if self.replicator is not None else None),
            # The last recovery's timeline as stored in etcd (elasticctl history shows the
            # same record): this node's own, or, 10 s after training again, the writer's.
            "last_recovery": (self.timeline.last.summary()
                              if self.timeline.last is not None else None),
        }
