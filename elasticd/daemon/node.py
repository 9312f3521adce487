"""Builds one node's daemon and the parts around it in order, and tears them down in reverse.

The parts depend on each other in one direction: etcd (a private one when none is given), the
coordinator, the checkpoint slots and the persistent tier, peer replication (its slots, its
server, the replicator), the checkpoint service, the daemon (membership, job manager, drainer),
the HTTP server and the workers' local socket. :class:`Node` builds them in that order, each
setting it uses named here or in :class:`~elasticd.config.Settings`, and :meth:`Node.close`
undoes what was built, last first, whether the start-up finished or stopped half way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import socket
from typing import Any, Callable

from elasticd import config
from elasticd.clock import SYSTEM_CLOCK
from elasticd.cluster.membership import Membership
from elasticd.coordination.api import AuthError, CoordinationError, Refused, Unavailable
from elasticd.coordination.embedded import EmbeddedEtcd, EtcdNotFound, EtcdStartError
from elasticd.coordination.etcd import EtcdCoordinator
from elasticd.coordination.keys import Keyspace
from elasticd.daemon.daemon import Daemon
from elasticd.daemon.http import StatusServer
from elasticd.daemon.local_api import LocalApiError, LocalServer
from elasticd.daemon.local_binding import CallerBinding, JobScope
from elasticd.daemon.registration import NodeIdInUse
from elasticd.errors import NodeError
from elasticd.metrics import CheckpointSink, Metrics, ReplicationSink

log = logging.getLogger("elasticd")

#: Seconds the replicator waits for a newer snapshot before pushing one (its default is 2).
#: 0: with the retention gate on, nodes that fell out of step pushed different steps and never
#: found a common one to commit (seen with 50 ms steps); pushing the newest snapshot as soon as
#: a lane is free keeps every node on the same recent steps.
COMMIT_WAIT = 0.0


class Fatal(NodeError):
    """A start-up problem reported as one line and exit status 2."""


def advertised(host: str, port: int | str) -> str:
    """``host:port`` as peers reach it: a wildcard host becomes this machine's name."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.getfqdn()
    return f"{host}:{port}"


def peer_address(membership: Membership, node: str) -> tuple[str, int] | None:
    """Where ``node``'s replica server listens, from its node record."""
    rec = membership.nodes.get(node)
    if rec is None or not rec.replication:
        return None
    host, _, port = rec.replication.rpartition(":")
    return host, int(port)


class Node:
    """One node's parts, built by :meth:`build` and torn down by :meth:`close`."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self.http: StatusServer | None = None
        self._teardown: list[Callable[[], None]] = []  # what close() undoes, last first

    def build(self) -> Daemon:
        """Starts every part but the daemon's loop, then joins the cluster.

        Raises:
            Fatal: a part cannot start; the message says which setting to change.
        """
        self._start_etcd()
        coord = self._connect()
        metrics = Metrics()
        membership = Membership(self.settings.node_id, self.settings.provisional_seconds,
                                self.settings.lease_ttl)
        service, replicator, address = self._checkpoints(coord, metrics, membership)
        daemon = Daemon(self.settings, coord, metrics=metrics, membership=membership,
                        checkpoints=service, replicator=replicator, replication_address=address)
        daemon.slot_pages = self._slot_pages()
        self._serve_http(daemon)
        self._serve_local(daemon)
        try:
            daemon.join()
        except NodeIdInUse as exc:
            raise Fatal(str(exc)) from exc
        except Refused as exc:
            raise Fatal(f"{exc}: etcd's users or roles kept changing; start again once they "
                        "settle") from exc
        except Unavailable as exc:
            raise Fatal(f"{exc}: check --etcd and that etcd is running") from exc
        log.info("serving /metrics, /healthz and /status on http://%s", self.http.address)
        return daemon

    def close(self) -> None:
        """Stops what :meth:`build` started, in reverse order (the loop has ended)."""
        while self._teardown:
            self._teardown.pop()()

    # -- the parts, in build order ----------------------------------------------------------

    def _start_etcd(self) -> None:
        if self.settings.etcd:
            return
        try:
            embedded = EmbeddedEtcd().start()
        except EtcdNotFound as exc:
            raise Fatal(str(exc)) from exc
        except EtcdStartError as exc:
            raise Fatal(f"could not start the private etcd: {exc}") from exc
        self._teardown.append(embedded.stop)
        log.info("started a private etcd at %s (data in %s); it stops with this daemon",
                 embedded.endpoints, embedded.dir)
        self.settings = dataclasses.replace(self.settings, etcd=embedded.endpoints)

    def _connect(self) -> EtcdCoordinator:
        settings = self.settings
        coord = EtcdCoordinator(settings.etcd_settings())
        self._teardown.append(coord.close)
        deadline = SYSTEM_CLOCK.monotonic() + max(3.0, 3 * settings.etcd_timeout)
        while True:
            try:
                # Probe under our prefix: a role limited to it may read no other key.
                coord.revision(Keyspace(settings.prefix).cluster)
                return coord
            except AuthError as exc:
                raise Fatal(str(exc)) from exc
            except Refused as exc:
                raise Fatal(f"etcd at {settings.etcd}: {exc}: its users or roles kept changing; "
                            "start again once they settle") from exc
            except Unavailable as exc:
                if SYSTEM_CLOCK.monotonic() > deadline:
                    raise Fatal(
                        f"{exc}: check --etcd (now {settings.etcd!r}) and that etcd is running "
                        f"(etcdctl --endpoints {settings.etcd} endpoint health)") from exc
                SYSTEM_CLOCK.sleep(0.2)
            except CoordinationError as exc:
                raise Fatal(f"etcd at {settings.etcd}: {exc}") from exc

    def _checkpoints(self, coord: EtcdCoordinator, metrics: Metrics,
                     membership: Membership) -> tuple[Any, Any, str]:
        """The daemon-owned checkpoint slots, the persistent tier, peer replication and the
        service workers call."""
        from elasticd.store.service import CheckpointService
        from elasticd.store.shm import SlotStore, SlotStoreError
        from elasticd.persistence.persister import Persister

        settings = self.settings
        cap = settings.memory_cap_mib * 2**20 or None
        try:
            store = SlotStore(settings.shm_path, cap_bytes=cap,
                              job_scratch_cap=settings.scratch_cap_bytes)
            kept = store.scan()
        except (OSError, SlotStoreError) as exc:
            raise Fatal(f"shm_dir: cannot use {settings.shm_path} for checkpoint slots: {exc}; "
                        "pick another --shm-dir on a tmpfs") from exc
        # Slots stay in shared memory: a restarted daemon adopts those that verify.
        self._teardown.append(self._remove_empty_shm_dirs)
        self._teardown.append(functools.partial(store.close, unlink=False))
        if kept.kept or kept.removed:
            log.info("checkpoint slots after restart: kept %d verified, removed %d",
                     len(kept.kept), len(kept.removed))
        persister = None
        if settings.persist_dir:
            persister = Persister(settings.persist_dir, keep=settings.persist_keep,
                                  every_steps=settings.persist_every_steps or None,
                                  every_seconds=settings.persist_every_seconds or None,
                                  node_id=settings.node_id)
        replicator, address = self._replication(coord, metrics, membership, store, cap)
        if persister is not None:
            # Stopped before replication, as the service that feeds it is done.
            self._teardown.append(persister.close)
        service = CheckpointService(store, settings.node_id, persister,
                                    metrics_sink=CheckpointSink(metrics), replicator=replicator,
                                    lag_limit=settings.unprotected_lag_steps)
        return service, replicator, address

    def _slot_pages(self) -> Any:
        """What backs the slot directory; a warning when it is small pages."""
        from elasticd.store.huge_pages import probe

        pages = probe(self.settings.shm_path)
        if pages.huge_pages:
            log.info("checkpoint slots in %s: %s", self.settings.shm_path, pages.describe())
        else:
            log.warning("checkpoint slots in %s are on %s: reserving and mapping a slot costs "
                        "up to seven times what it does on a tmpfs mounted with "
                        "huge=within_size (systemd/run-elasticd-shm.mount; "
                        "docs/operations.md, 'Huge pages')", self.settings.shm_path,
                        pages.describe())
        return pages

    def _replication(self, coord: EtcdCoordinator, metrics: Metrics, membership: Membership,
                     store: Any, cap: int | None) -> tuple[Any, str]:
        """Peer replication and its address, when a cluster secret is configured (else None,
        "")."""
        settings = self.settings
        secret = settings.secret
        if not secret or settings.replicas < 2:
            log.info("peer replication off (%s)",
                     "no cluster secret" if not secret else "replicas=1")
            return None, ""
        from elasticd.store.shm import SlotStore, SlotStoreError
        from elasticd.recovery.replicator import Replicator
        from elasticd.replication.seal import BlockTagger
        from elasticd.replication.server import ReplicaServer
        from elasticd.replication.shm_sink import ShmSink, replica_root

        try:
            replicas = SlotStore(replica_root(settings.shm_path))
            replicas.scan()
        except (OSError, SlotStoreError) as exc:
            raise Fatal(f"shm_dir: cannot use {replica_root(settings.shm_path)} for peer "
                        f"replicas: {exc}; pick another --shm-dir on a tmpfs") from exc
        self._teardown.append(functools.partial(replicas.close, unlink=False))
        sink = ShmSink(replicas, local=store, cap_bytes=cap)
        host, port = settings.replication_addr
        try:
            server = ReplicaServer(host, port, secret, settings.node_id, sink,
                                   auth_failures=ReplicationSink(metrics).rejected)
            server.start()
        except OSError as exc:
            raise Fatal(f"replication_listen: cannot listen on {settings.replication_listen}: "
                        f"{exc.strerror}; pick another --replication-listen") from exc
        self._teardown.append(server.stop)
        rep = Replicator(settings.node_id, coord, Keyspace(settings.prefix), store, secret,
                         m=settings.replicas,
                         peers_address=functools.partial(peer_address, membership),
                         sink=sink, commit_wait=COMMIT_WAIT, lease_ttl=settings.lease_ttl)
        server.on_report = rep.tracker.reporter.on_report  # to the job's coordinator here
        self._teardown.append(rep.close)
        # Local snapshots get their block tags as they are sealed, so a push only sends.
        store.tagger = BlockTagger(secret).tag
        rep.pusher.on_push = ReplicationSink(metrics).pushed
        rep.serving = server.serving
        rep.last_heard = server.last_heard
        metrics.replication.collector.attach(rep.stats, server.snapshot_stats)
        log.info("replicating snapshots to %d peers; replication server on %s",
                 settings.replicas - 1, server.address)
        return rep, advertised(*server.address)

    def _serve_http(self, daemon: Daemon) -> None:
        settings = self.settings
        try:
            server = StatusServer(settings.listen_addr, daemon.metrics.registry,
                                  daemon.status, daemon.healthy)
        except OSError as exc:
            raise Fatal(f"listen: cannot serve HTTP on {settings.listen}: {exc.strerror}; "
                        "pick another --listen address or port") from exc
        self._teardown.append(server.stop)
        daemon.registration.http_address = advertised(*server.address.rsplit(":", 1))
        server.start()
        self.http = server

    def _serve_local(self, daemon: Daemon) -> None:
        settings = self.settings

        def job_scope() -> JobScope | None:
            """The job running on this node now, as the local socket admits it."""
            supervisor = daemon.jobs.supervisor
            return None if supervisor is None else supervisor.scope()

        try:
            os.makedirs(settings.state_path, mode=0o755, exist_ok=True)
            # The running job's processes may use the socket too, each bound to its job/rank.
            local = LocalServer(os.path.join(settings.state_path, "elasticd.sock"),
                                daemon.channel.handlers(), binding=CallerBinding(job_scope))
            local.on_close.append(daemon.timeline.on_connection_closed)
            if daemon.checkpoints is not None:
                local.on_undelivered.append(daemon.checkpoints.restores.undelivered)
            self._teardown.append(local.stop)
            local.start()
        except (OSError, ValueError, LocalApiError) as exc:
            raise Fatal(f"state_dir: cannot serve the workers' socket in "
                        f"{settings.state_path}: {exc}; pick another --state-dir") from exc
        daemon.channel.socket = local.path

    def _remove_empty_shm_dirs(self) -> None:
        for path in (self.settings.shm_path, self.settings.shm_path + "+replicas"):
            with contextlib.suppress(OSError):
                os.rmdir(path)  # only when empty: kept slots wait for the next start
