"""The node daemon's main loop.

Each cycle takes what happened since the last one (watch events on the node records, lease
losses found by the keep-alive thread, the clock), decides what it means
(:mod:`elasticd.cluster.membership`), acts on it (events in etcd, metrics, fencing), and returns
one sentence saying what the node is doing — logged when it changes, shown in ``/status``, and
asserted in tests ("no action: I am n1, 3 nodes alive").

When etcd is unreachable the loop keeps cycling: it says so, keeps the node's workers running
for ``outage_grace`` seconds, and fences itself (stops its workers) only after that. When etcd
returns it re-watches, re-lists, and re-registers under the same node id. These rules are pure
decisions in :mod:`elasticd.daemon.node_rules`; the loop gathers what they need and carries out
what they answer, through the parts it owns.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

import elasticd
from elasticd.agent.manager import JobManager
from elasticd.clock import Clock, SystemClock
from elasticd.cluster.events import Event, EventLog
from elasticd.cluster.incarnation import Incarnation
from elasticd.cluster.membership import (Membership, NodeState, Observation, ObservationKind,
                                         joined_sentence)
from elasticd.config import Settings
from elasticd.coordination.api import AuthError, CoordinationError, Coordinator, Unavailable
from elasticd.coordination.health import EtcdHealth
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.lease import LeaseKeeper
from elasticd.daemon import node_rules, rdzv_marks
from elasticd.daemon.agent_setup import agent_credentials, rdzv_conf
from elasticd.daemon.cycle_state import CycleState
from elasticd.daemon.data_loss import DataLossRecovery
from elasticd.daemon.drain_host import NodeDrainHost
from elasticd.daemon.fencing import Fence
from elasticd.daemon.node_rules import Recover, RecordWrite
from elasticd.daemon.peer_probe import PeerProbe, suspects
from elasticd.daemon.peer_watch import PeerWatch
from elasticd.daemon.recovery_timeline import TimelineRecorder
from elasticd.daemon.registration import NodeIdInUse, Registration
from elasticd.daemon.replica_view import ReplicaView
from elasticd.daemon.worker_channel import WorkerChannel
from elasticd.metrics import CheckpointSink, Metrics
from elasticd.recovery.drain import Drainer

if TYPE_CHECKING:
    from elasticd.recovery.replicator import Replicator
    from elasticd.store.huge_pages import SlotPages
    from elasticd.store.service import CheckpointService

log = logging.getLogger(__name__)


def _in_process(records: Any, job: str) -> bool:
    """Whether ``job``'s spec (as this node last read it) asks for in-process mode."""
    spec = records.specs.get(job)
    return spec is not None and spec[1].in_process


class Daemon:
    """One node's daemon: its cycle, carrying out what its parts (each with its own state)
    and rules decide.

    Args:
        membership: the cluster view (a fresh one by default; the node builder shares it
            with the replicator, which finds peers' replica servers in it).
        replicator: peer replication, if on (its server and slots are the node builder's,
            :mod:`elasticd.daemon.node`).
    """

    def __init__(self, settings: Settings, coord: Coordinator, clock: Clock | None = None,
                 metrics: Metrics | None = None, *,
                 membership: Membership | None = None,
                 checkpoints: CheckpointService | None = None,
                 replicator: Replicator | None = None, replication_address: str = "") -> None:
        self.settings = settings
        self.coord = coord
        self.clock = clock or SystemClock()
        self.metrics = metrics or Metrics()
        keys = Keyspace(settings.prefix)
        self.loop = CycleState(self.clock.monotonic())
        self.events = EventLog(coord, keys, settings.events_retention)
        self.membership = membership or Membership(settings.node_id,
                                                   settings.provisional_seconds,
                                                   settings.lease_ttl)
        self.checkpoints = checkpoints
        #: What backs the slot directory, set by the node builder; None without slots.
        self.slot_pages: SlotPages | None = None

        self.health = EtcdHealth(self.clock, self._outage_started, self._outage_ended,
                                 describe=f"etcd at {settings.etcd or 'embedded'}")
        self.peers = PeerWatch(settings.node_id, coord, keys, self.membership, self.clock,
                               wake=self.loop.wake)
        self.keeper = LeaseKeeper(coord, settings.lease_ttl, self.health,
                                  on_change=self.loop.wake, clock=self.clock,
                                  on_failure=self.metrics.etcd.keepalive_failures.inc)
        self.metrics.etcd.up.set(1)
        self.registration = Registration(
            settings.node_id, coord, keys, self.keeper, self.health, self.events,
            self.membership, self.clock, settings.lease_ttl,
            says=lambda: (self.state, self.loop.sentence), replication_address=replication_address)
        self.fence = Fence(settings.node_id, self.events, self.metrics, self.clock,
                           lease=lambda: self.registered_lease or self.keeper.lease)
        credentials = agent_credentials(settings, coord, keys)
        self.jobs = JobManager(
            settings.node_id, coord, keys, settings.etcd, settings.state_path, self.metrics,
            lease=lambda: self.registered_lease or 0, extra_env=lambda: self.channel.agent_env(),
            rdzv_conf=rdzv_conf(settings), agent_restarts=settings.agent_restarts,
            stop_grace=settings.stop_grace, warm_workers=settings.worker_start == "warm",
            clock=self.clock, before_resync=self._look_for_data_loss,
            policy=settings.job_policy(),
            credentials=credentials.issue if credentials else None)
        if credentials is not None:
            self.jobs.on_job_end.append(credentials.withdraw)
        self.fence.hooks.append(self.jobs.fence)
        self.replicas = ReplicaView(settings.node_id, replicator, self.jobs)
        self.jobs.committed = self.replicas.committed_step  # crash-loop detection
        self.jobs.record_event = self.record_event
        self.jobs.checks.wake = self.loop.wake  # a job's file check ended: act on it now
        self.data_loss = DataLossRecovery(
            Incarnation(coord, keys, settings.node_id, self.clock), self.metrics,
            republish_specs=self.jobs.republish,
            record_event=lambda loss, specs: self.record_event(
                "etcd_data_lost", f"etcd lost its data: {loss.reason}",
                {"specs_republished": specs}),
            steps={Recover.RESET_WATCHES: coord.reset_watches,
                   Recover.FORGET_SUSPECTS: self.fence.book.data_lost,
                   Recover.RELIST_NODES: self._relist_after_data_loss,
                   Recover.REWRITE_RECORD: lambda: self.registration.put(self.registered_lease),
                   Recover.REPUBLISH_REPLICAS: (replicator.republish if replicator is not None
                                                else lambda: None)},
            registered=lambda: self.registered_lease is not None,
            replicates=replicator is not None)
        self.timeline = TimelineRecorder(settings.node_id, coord, keys, self.events,
                                         self.metrics, self.clock,
                                         lambda: float(self.settings.lease_ttl),
                                         last_heard=self.replicas.last_heard)
        self.channel = WorkerChannel(settings.node_id, settings.prefix, self.jobs, self.timeline,
                                     checkpoints, self.record_event)
        # A worker's collective broke: a peer whose daemon's port refuses connections is dead
        # now, not a lease TTL later (daemon/peer_probe.py). Each round's close knocks once at
        # every peer's port it does not know: a refusal counts only from one that answered.
        probe = PeerProbe(
            settings.node_id,
            lambda: suspects(list(self.membership.nodes.values()), settings.node_id,
                             self.jobs.ran_workers),
            coord.revoke_lease, self.clock,
            revoking=lambda rec, why: self.membership.revoked(rec.lease, why))
        self.channel.on_group_broke = probe.suspect

        def round_closed(job: str) -> None:
            self.timeline.on_round_closed(job)
            probe.baseline(suspects(list(self.membership.nodes.values()), settings.node_id,
                                    lambda node: True))

        self.jobs.on_round_closed = round_closed
        if checkpoints is not None:
            checkpoints.on_restore.append(self.channel.on_restore)
            checkpoints.on_restore.append(self.timeline.on_restore)
            # A Checkpointer's register and slot requests are progress reports (ranks, hangs).
            checkpoints.on_progress.append(self.jobs.group.on_progress)
            checkpoints.on_progress.append(self.timeline.on_progress)
            self.jobs.on_job_end.append(checkpoints.remove_job)
            # In-process jobs keep each local rank's newest pair (store/shm.py): survivors
            # resume from the last step they completed, not the last one both commit slots
            # let them snapshot. The job spec opts in; its slots count against the node's cap.
            checkpoints.store.keeps_newest = functools.partial(_in_process, self.jobs.records)
        if replicator is not None:
            self.jobs.on_job_end.append(replicator.remove_job)
        self.drainer = Drainer(settings.node_id, coord, keys,
                               NodeDrainHost(settings.node_id, self.jobs, checkpoints,
                                             replicator, self.loop.wake, self.record_event),
                               stop_wait=settings.stop_grace + 10, clock=self.clock)

    @property
    def state(self) -> NodeState:
        """The node's state, as its record says: leaving, fenced, or up."""
        if self.registration.leaving:
            return NodeState.LEAVING
        return NodeState.FENCED if self.fence.book.fenced else NodeState.UP

    @property
    def registered_lease(self) -> int | None:  # None: not registered
        return self.registration.lease

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
        self.data_loss.incarnation.check()  # the first look: writes the key on a new cluster
        if keep_alive_thread:
            self.keeper.start()
        self._act(self.peers.start())
        self.jobs.records.start_watch()
        self._register(wait_for_id=True)  # last: once our record is visible, we are in
        etcd = self.coord.etcd()
        if etcd is not None:
            etcd.bound_refusals(self.settings.etcd_timeout)  # the loop reports them as an outage
        self.loop.sentence = joined_sentence(self.settings.node_id)
        log.info("%s", self.loop.sentence)

    def run(self, on_cycle: Callable[["Daemon"], None] = lambda _d: None) -> None:
        """Cycles until ``loop.stop()``; ``on_cycle`` runs after each completed cycle."""
        while not self.loop.stopping:
            self.cycle()
            on_cycle(self)
            self.loop.wait(self.settings.loop_interval, idle=self.peers.empty)

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
        self.jobs.rdzv_conf = rdzv_conf(self.settings)
        self.jobs.policy = self.settings.job_policy()  # for the next job start
        return restart

    def leave(self) -> None:
        """Leaves the cluster cleanly: record ``leaving``, a departure event, revoke the lease.

        Peers see the departure at once and do not wait for a lease expiry. If etcd is
        unreachable the lease simply expires and peers record a failure, which is the truth
        as far as they can tell.
        """
        self.registration.leaving = True
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
                self.registration.put(lease)
                self.events.record(Event("left", self.settings.node_id, lease, self.clock.wall(),
                                         self.settings.node_id, "left the cluster cleanly"))
            self.keeper.stop(revoke=True)
        except CoordinationError as exc:
            log.warning("could not leave cleanly (%s); peers will see the lease expire", exc)
            self.keeper.stop()
        self.peers.close()

    def close(self) -> None:
        self.keeper.stop()
        self.peers.close()
        self.jobs.records.close()

    # -- the parts' moments -----------------------------------------------------------------

    def _register(self, wait_for_id: bool) -> None:
        self.loop.note(self.registration.register(wait_for_id, lift_fence=self.fence.book.registered))

    def _handle_lost_leases(self) -> None:
        for old in self.keeper.take_lost():
            self.peers.stale = True  # a lease found gone: etcd may have lost its data
            if self.registered_lease == old:
                self.registration.lease = None
            self.loop.note(self.fence.lease_lost(old, self.settings.provisional_seconds))
        self.loop.note(self.fence.check(self.clock.monotonic()))

    def _outage_started(self) -> None:
        self.metrics.etcd.outages.inc()
        self.metrics.etcd.up.set(0)
        self.loop.wake()

    def _outage_ended(self, seconds: float) -> None:
        self.metrics.etcd.up.set(1)
        self.peers.stale = True
        # etcd that only refused requests (its users changing) kept every watch stream: at
        # scale, re-creating them all on every node after each big job's start is a storm.
        if self.health.last_outage_kinds != {"refuses our requests"}:
            self.coord.rewatch()
        self.loop.wake()

    def _look_for_data_loss(self, again: bool = False) -> bool:
        """Looks whether etcd lost its data (:class:`DataLossRecovery`) and recovers if so;
        True when it did."""
        note = self.data_loss.look(self.loop.cycles, again)
        self.loop.note(note)
        return note is not None

    def _relist_after_data_loss(self) -> None:
        """Re-lists the nodes of a cluster whose etcd lost its data: nobody failed for it."""
        recs, revision = self.peers.list()
        self.data_loss.incarnation.observe(revision)
        self._act(self.peers.reset(recs, self.clock.monotonic(), True))

    # -- events ---------------------------------------------------------------------------

    def record_event(self, kind: str, detail: str, data: dict[str, Any]) -> None:
        lease = self.registered_lease or self.keeper.lease or 0
        try:
            self.events.record(Event(kind, self.settings.node_id, lease, self.clock.wall(),
                                     self.settings.node_id, detail, data,
                                     instance=f"{self.clock.wall():.6f}"))
        except CoordinationError as exc:
            log.warning("could not record the %s event: %s", kind, exc)

    # -- one cycle ------------------------------------------------------------------------

    def cycle(self) -> str:
        """Runs one cycle and returns its sentence."""
        now = self.clock.monotonic()
        self.loop.notes = []
        try:
            self._handle_lost_leases()
            self._act(self.peers.take(now, self._cut_off(), self.registration.leaving))
            # No periodic re-list: the watch is trusted until it says otherwise (an error
            # batch), a lease is found lost, or an outage ends; each of these also comes with
            # an etcd data loss (a wiped etcd knows none of our leases), and _resync looks
            # for one first (a watch resumed from the old revision would deliver nothing).
            if self.peers.stale:
                self._resync(now)
            self._act(self.membership.tick(now))
            self.loop.note(self.fence.check(now))
            write = node_rules.record_write(
                self.registered_lease is not None, self.registration.leaving,
                self.peers.own_record_gone,
                self.settings.heartbeat_interval, now - self.registration.last_write)
            if write is RecordWrite.REGISTER:
                self._register(wait_for_id=False)
            elif write is RecordWrite.REWRITE:
                # Our record went while our lease lives (deleted by hand, or etcd restored
                # from a snapshot without it): write it again at once.
                self.peers.own_record_gone = False
                self.registration.put(self.registered_lease)
            if self.state is NodeState.UP and self.registered_lease is not None:
                self.loop.note(self.drainer.step() if self.health.up else None)
                if self.checkpoints is not None:
                    self.jobs.set_unprotected(self.checkpoints.book.unprotected(self.jobs.job))
                self.jobs.step()
                self.loop.notes += self.jobs.notes
                self.loop.note(self.timeline.step())
            self.metrics.jobs.running.set(1 if self.jobs.supervisor is not None else 0)
            if self.checkpoints is not None:
                CheckpointSink(self.metrics).update(self.checkpoints.stats())
            self.loop.note(self.replicas.follow_round())
            sentence = node_rules.cycle_sentence(
                self.settings.node_id, len(self.membership.nodes), self.loop.notes, self.jobs.job,
                self.membership.pending)
        except (Unavailable, AuthError) as exc:
            # Refused credentials are an outage too (after an etcd data loss the users are
            # gone until re-created): one line, the workers kept for the outage grace.
            self.health.failed(exc)
            sentence = self.fence.describe_outage(self.health.outage_seconds(),
                                                  self.settings.outage_grace, self.health.kind)
        except (CoordinationError, NodeIdInUse) as exc:
            log.warning("cycle failed: %s", exc)
            sentence = f"cycle failed ({exc}); retrying"
        except Exception as exc:  # noqa: BLE001 — one bad record must not end the daemon
            # Records are decoded with type checks; this is the net under a check missed:
            # the daemon keeps its node in the cluster (and /healthz answering) and says so.
            sentence = f"cycle failed ({exc.__class__.__name__}: {exc}); retrying"
            if self.peers.complaints.warn(b"cycle", repr(exc).encode(), "%s", sentence):
                log.exception("cycle failed")
        if not self.health.up:
            outage = self.health.outage_seconds()
            self.loop.note(self.fence.outage(outage, self.settings.outage_grace,
                                             self.health.kind))
            sentence = self.fence.describe_outage(outage, self.settings.outage_grace,
                                                  self.health.kind)
        self._finish_cycle(sentence)
        return sentence

    def _finish_cycle(self, sentence: str) -> None:
        changed = self.loop.finish(sentence, self.clock.monotonic())
        (log.info if changed else log.debug)("%s", sentence)
        reg = self.registration
        if node_rules.publish_sentence(sentence, reg.published_sentence, self.health.up,
                                       self.registered_lease is not None,
                                       self.clock.monotonic() - reg.last_write):
            # Publish what we are doing for elasticctl (no timed rewrite would publish it).
            try:
                reg.put(self.registered_lease)
            except CoordinationError as exc:
                self.health.failed(exc)
        self.metrics.loop.cycles.inc()
        self.metrics.loop.last_cycle.set(self.clock.wall())
        self.metrics.membership.nodes_alive.set(len(self.membership.nodes))
        self.metrics.etcd.up.set(1 if self.health.up else 0)

    def _cut_off(self) -> bool:
        """Whether this node was cut off from etcd long enough for a peer's record to expire
        unseen (a deletion seen now may then be our outage, not the peer's failure)."""
        return self.health.cut_off_within(
            self.settings.lease_ttl + 2 * self.settings.loop_interval + 1)

    # -- peers ----------------------------------------------------------------------------

    def _resync(self, now: float) -> None:
        if self._look_for_data_loss():
            return  # the recovery re-listed
        recs, revision = self.peers.list()
        if self.data_loss.incarnation.observe(revision) and self._look_for_data_loss(again=True):
            return
        self.health.ok()
        self._act(self.peers.reset(recs, now, self._cut_off()))

    def _act(self, observations: list[Observation]) -> None:
        for ob in observations:
            self.loop.notes.append(ob.describe())
            if ob.kind is ObservationKind.FAILED:
                self.metrics.membership.node_failures.inc()
                job, writer = self.jobs.job, self.jobs.recovery_writer(ob.node)
                in_group = self.jobs.ran_workers(ob.node)
                aborted = self.jobs.on_peer_failed(ob.node)
                if job is not None and aborted is not None:
                    self.timeline.on_failure(job, ob.node, ob.record.lease,
                                             writer == self.settings.node_id, aborted > 0,
                                             in_group)
                    self.loop.note(self.channel.prepare_restore(job))
                if ob.detection_seconds is not None:
                    self.metrics.membership.detection_seconds.observe(ob.detection_seconds)
                failed = Event(
                    "failed", ob.node, ob.record.lease, self.clock.wall(), self.settings.node_id,
                    ob.describe(), {"detection_seconds": round(ob.detection_seconds or 0.0, 3),
                                    "heartbeat_at": ob.record.heartbeat_at})
                # The rendezvous first: the event's write also trims the log (a listing).
                self._tell_rendezvous(job, ob.node, ob.record.lease)
                self.events.record(failed)
                if ob.was_provisional:
                    self.metrics.membership.provisional_expiries.labels("confirmed").inc()
            elif ob.kind is ObservationKind.DEPARTED:
                self.metrics.membership.node_departures.inc()
            elif ob.kind is ObservationKind.REJOINED:
                self.metrics.membership.provisional_expiries.labels("rejoined").inc()
            log.info("observed: %s", ob.describe())

    def _tell_rendezvous(self, job: str | None, node: str, lease: int) -> None:
        """The job's rendezvous drops ``node`` at once (:mod:`.rdzv_marks`); on an etcd
        error it drops it after ``liveness_confirm``, as before."""
        if job is None:
            return
        try:
            rdzv_marks.mark_failed(self.coord, self.peers.keys, job, node, lease,
                                   self.settings.node_id, self.registered_lease,
                                   self.clock.wall())
        except CoordinationError as exc:
            log.warning("could not tell job %s's rendezvous that %s failed: %s", job, node, exc)

    # -- waiting and status ---------------------------------------------------------------

    def healthy(self) -> bool:
        """Whether the loop completed a cycle recently (what /healthz and the watchdog use)."""
        limit = max(3 * self.settings.loop_interval, 2 * self.settings.etcd_timeout + 1)
        return self.clock.monotonic() - self.loop.last_cycle <= limit

    def status(self) -> dict[str, Any]:
        now = self.clock.wall()
        return {
            "node": self.settings.node_id,
            "state": self.state.value,
            "sentence": self.loop.sentence,
            "etcd_up": self.health.up,
            "etcd_outage_seconds": round(self.health.outage_seconds(), 3),
            "etcd_outage_kind": self.health.kind,
            "lease": f"{self.registered_lease:x}" if self.registered_lease else None,
            "fenced_for": self.fence.book.fenced_for or None,
            "cycles": self.loop.cycles,
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
            "replication": self.replicas.status(),
            # The last recovery's timeline as stored in etcd (elasticctl history shows the
            # same record): this node's own, or, 10 s after training again, the writer's.
            "last_recovery": (self.timeline.last.summary()
                              if self.timeline.last is not None else None),
        }
