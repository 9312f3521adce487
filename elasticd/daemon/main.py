"""``elasticd``: the node daemon's command line.

Settings come from flags, ``ELASTICD_*`` variables and a TOML file (``--config``); every bad
value, an unreachable etcd, and a missing etcd binary end the process with one line on stderr
saying what to do, and exit status 2. Without ``--etcd`` the daemon starts a private etcd on
127.0.0.1 and stops it on exit (a single-node setup; several nodes need a shared etcd).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
from typing import Any, Sequence

from elasticd import config
from elasticd.clock import SYSTEM_CLOCK
from elasticd.coordination.api import AuthError, CoordinationError, Unavailable
from elasticd.coordination.embedded import EmbeddedEtcd, EtcdNotFound, EtcdStartError
from elasticd.coordination.etcd import EtcdCoordinator
from elasticd.coordination.keys import Keyspace
from elasticd.daemon.daemon import Daemon, NodeIdInUse
from elasticd.daemon.http import StatusServer
from elasticd.daemon.local_api import LocalApiError, LocalServer
from elasticd.daemon.local_binding import CallerBinding, JobScope
from elasticd.daemon.notify import Notifier

log = logging.getLogger("elasticd")

EXIT_USAGE = 2


class Fatal(Exception):
    """A start-up problem reported as one line and exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elasticd",
        description="Per-node daemon of an elasticd training cluster.",
        epilog="Every flag also reads from ELASTICD_<NAME> (e.g. ELASTICD_NODE_ID) and from the "
               "TOML file given with --config. Example: elasticd --node-id n1 "
               "--etcd 10.0.0.5:2379 --listen 0.0.0.0:9400",
    )
    p.add_argument("--config", help="TOML file with settings (keys named like the flags)")
    p.add_argument("--node-id", dest="node_id", help="this node's name (default: host name)")
    p.add_argument("--etcd", help="HOST:PORT[,HOST:PORT...] of etcd; omit to start a private one")
    p.add_argument("--prefix", help="etcd key prefix of the cluster (default /elasticd)")
    p.add_argument("--listen", help="HOST:PORT for /metrics, /healthz, /status (port 0: any)")
    p.add_argument("--lease-ttl", dest="lease_ttl", type=_number,
                   help="seconds after which a silent node is declared dead (default 5)")
    p.add_argument("--loop-interval", dest="loop_interval", type=_number,
                   help="seconds between main loop cycles (default 1)")
    p.add_argument("--heartbeat-interval", dest="heartbeat_interval", type=_number)
    p.add_argument("--etcd-timeout", dest="etcd_timeout", type=_number)
    p.add_argument("--outage-grace", dest="outage_grace", type=_number,
                   help="seconds to keep workers running while etcd is unreachable (default 30)")
    p.add_argument("--provisional-grace", dest="provisional_grace", type=_number)
    p.add_argument("--events-retention", dest="events_retention", type=_number)
    p.add_argument("--etcd-user", dest="etcd_user")
    p.add_argument("--etcd-password", dest="etcd_password",
                   help="prefer ELASTICD_ETCD_PASSWORD: flags are visible in ps")
    p.add_argument("--etcd-ca-cert", dest="etcd_ca_cert")
    p.add_argument("--etcd-cert", dest="etcd_cert")
    p.add_argument("--etcd-key", dest="etcd_key")
    p.add_argument("--state-dir", dest="state_dir",
                   help="job logs and the local socket (default /var/lib/elasticd/NODE as root)")
    p.add_argument("--agent-restarts", dest="agent_restarts", type=_number)
    p.add_argument("--stop-grace", dest="stop_grace", type=_number)
    p.add_argument("--rdzv-last-call", dest="rdzv_last_call", type=_number)
    p.add_argument("--rdzv-grow", dest="rdzv_grow", choices=config.GROW_POLICIES,
                   help="immediate: a returning or added node enters at once (every node "
                        "stops once; default); at-failure: it waits as a spare for the next "
                        "failure")
    p.add_argument("--worker-start", dest="worker_start", choices=("warm", "cold"),
                   help="warm: fork workers from a process that imported torch already "
                        "(default); cold: a new interpreter per worker")
    p.add_argument("--shm-dir", dest="shm_dir",
                   help="tmpfs directory of checkpoint slots (default /dev/shm/elasticd-NODE)")
    p.add_argument("--memory-cap-mib", dest="memory_cap_mib", type=_number)
    p.add_argument("--persist-dir", dest="persist_dir",
                   help="persistent checkpoint tier (shared filesystem); empty: none")
    p.add_argument("--persist-every-steps", dest="persist_every_steps", type=_number)
    p.add_argument("--persist-every-seconds", dest="persist_every_seconds", type=_number)
    p.add_argument("--persist-keep", dest="persist_keep", type=_number)
    p.add_argument("--cluster-secret-file", dest="cluster_secret_file",
                   help="file with the replication secret (or env ELASTICD_CLUSTER_SECRET)")
    p.add_argument("--replication-listen", dest="replication_listen",
                   help="HOST:PORT of the replication server (default 0.0.0.0:9401)")
    p.add_argument("--replicas", dest="replicas", type=_number,
                   help="copies of each snapshot, its own included (default 2)")
    p.add_argument("--unprotected-lag-steps", dest="unprotected_lag_steps", type=_number,
                   help="commit lag in steps past which a job shows UNPROTECTED (default 100)")
    p.add_argument("--log-level", dest="log_level")
    return p


def _number(text: str) -> str:
    # Types are checked by config.load so that flags, env and file give the same message.
    return text


def _settings(args: argparse.Namespace) -> config.Settings:
    cli = {k: v for k, v in vars(args).items() if k != "config"}
    return config.load(cli, args.config)


def _advertised(listen: str) -> str:
    host, port = listen.rsplit(":", 1)
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.getfqdn()
    return f"{host}:{port}"


def _job_scope(daemon: Daemon) -> JobScope | None:
    """The job running on this node now, as the local socket admits it (any thread)."""
    supervisor = daemon.jobs.supervisor
    return None if supervisor is None else supervisor.scope()


def _connect(settings: config.Settings) -> EtcdCoordinator:
    coord = EtcdCoordinator(settings.etcd_settings())
    deadline = SYSTEM_CLOCK.monotonic() + max(3.0, 3 * settings.etcd_timeout)
    while True:
        try:
            # Probe under our prefix: a role limited to it may read no other key.
            coord.revision(Keyspace(settings.prefix).cluster)
            return coord
        except AuthError as exc:
            coord.close()
            raise Fatal(str(exc)) from exc
        except Unavailable as exc:
            if SYSTEM_CLOCK.monotonic() > deadline:
                coord.close()
                raise Fatal(
                    f"{exc}: check --etcd (now {settings.etcd!r}) and that etcd is running "
                    f"(etcdctl --endpoints {settings.etcd} endpoint health)") from exc
            SYSTEM_CLOCK.sleep(0.2)
        except CoordinationError as exc:
            coord.close()
            raise Fatal(f"etcd at {settings.etcd}: {exc}") from exc


def _checkpoint_service(settings: config.Settings, daemon: Daemon) -> "Any":
    """The daemon-owned checkpoint slots, the persistent tier and the service workers call."""
    from elasticd.checkpoint.service import CheckpointService
    from elasticd.checkpoint.shm import SlotStore, SlotStoreError
    from elasticd.metrics import CheckpointSink
    from elasticd.persistence.persister import Persister

    cap = settings.memory_cap_mib * 2**20 or None
    try:
        store = SlotStore(settings.shm_path, cap_bytes=cap)
        kept = store.scan()
    except (OSError, SlotStoreError) as exc:
        raise Fatal(f"shm_dir: cannot use {settings.shm_path} for checkpoint slots: {exc}; "
                    "pick another --shm-dir on a tmpfs") from exc
    if kept.kept or kept.removed:
        log.info("checkpoint slots after restart: kept %d verified, removed %d",
                 len(kept.kept), len(kept.removed))
    persister = None
    if settings.persist_dir:
        persister = Persister(settings.persist_dir, keep=settings.persist_keep,
                              every_steps=settings.persist_every_steps or None,
                              every_seconds=settings.persist_every_seconds or None,
                              node_id=settings.node_id)
    replicator = _replicator(settings, daemon, store, cap)
    kwargs = {"replicator": replicator} if replicator is not None else {}
    service = CheckpointService(store, settings.node_id, persister,
                                metrics_sink=CheckpointSink(daemon.metrics),
                                lag_limit=settings.unprotected_lag_steps, **kwargs)
    daemon.attach_checkpoints(service)
    return service


def _replicator(settings: config.Settings, daemon: Daemon, store: "Any",
                cap: int | None) -> "Any":
    """Peer replication, when a cluster secret is configured (else None)."""
    secret = settings.secret
    if not secret or settings.replicas < 2:
        log.info("peer replication off (%s)", "no cluster secret" if not secret else "replicas=1")
        return None
    from elasticd.checkpoint.shm import SlotStore, SlotStoreError
    from elasticd.metrics import ReplicationSink
    from elasticd.replication.auth import AuthFailures
    from elasticd.replication.replicator import Replicator
    from elasticd.replication.server import ReplicaServer
    from elasticd.replication.shm_sink import ShmSink, replica_root

    try:
        replicas = SlotStore(replica_root(settings.shm_path))
        replicas.scan()
    except (OSError, SlotStoreError) as exc:
        raise Fatal(f"shm_dir: cannot use {replica_root(settings.shm_path)} for peer replicas: "
                    f"{exc}; pick another --shm-dir on a tmpfs") from exc
    sink = ShmSink(replicas, local=store, cap_bytes=cap)
    host, port = settings.replication_addr
    try:
        server = ReplicaServer(host, port, secret, settings.node_id, sink,
                               auth_failures=AuthFailures(ReplicationSink(daemon.metrics).rejected))
        server.start()
    except OSError as exc:
        raise Fatal(f"replication_listen: cannot listen on {settings.replication_listen}: "
                    f"{exc.strerror}; pick another --replication-listen") from exc
    # commit_wait=0: with the retention gate on, nodes that fell out of step pushed different
    # steps and never found a common one to commit (seen with 50 ms steps); pushing the newest
    # snapshot as soon as a lane is free keeps every node on the same recent steps.
    rep = Replicator(settings.node_id, daemon.coord, daemon.keys, store, secret,
                     m=settings.replicas, peers_address=daemon.peer_replication_address,
                     sink=sink, commit_wait=0.0)
    daemon.attach_replication(rep, server, replicas)
    log.info("replicating snapshots to %d peers; replication server on %s",
             settings.replicas - 1, server.address)
    return rep


def _reload(daemon: Daemon, args: argparse.Namespace) -> None:
    """SIGHUP: re-reads the settings from the same sources and applies what can change live."""
    try:
        new = _settings(args)
    except config.ConfigError as exc:
        log.error("reload refused, keeping the running settings: bad setting %s", exc)
        return
    if not new.etcd:
        new = config.Settings(**{**new.__dict__, "etcd": daemon.settings.etcd})
    logging.getLogger().setLevel(new.log_level.upper())
    needs_restart = daemon.apply_settings(new)
    log.info("reloaded settings%s", f"; restart needed for: {', '.join(needs_restart)}"
             if needs_restart else "")


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = _settings(args)
    except config.ConfigError as exc:
        raise Fatal(f"bad setting {exc}") from exc

    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {settings.node_id} %(name)s: %(message)s",
    )
    stop_requested = False

    def on_term(signum: int, _frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True
        if daemon is not None:
            daemon.request_stop()

    reload_requested = False

    def on_hup(signum: int, _frame: Any) -> None:
        nonlocal reload_requested
        reload_requested = True
        if daemon is not None:
            daemon.wake()

    daemon: Daemon | None = None
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, on_hup)
    # `kill -USR1 <pid>` writes every thread's stack to stderr (the journal under systemd):
    # how to see where a stuck daemon waits without stopping it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    embedded: EmbeddedEtcd | None = None
    if not settings.etcd:
        try:
            embedded = EmbeddedEtcd().start()
        except EtcdNotFound as exc:
            raise Fatal(str(exc)) from exc
        except EtcdStartError as exc:
            raise Fatal(f"could not start the private etcd: {exc}") from exc
        log.info("started a private etcd at %s (data in %s); it stops with this daemon",
                 embedded.endpoints, embedded.dir)
        settings = config.Settings(**{**settings.__dict__, "etcd": embedded.endpoints})

    notifier = Notifier()
    coord = None
    server = None
    local: LocalServer | None = None
    try:
        coord = _connect(settings)
        daemon = Daemon(settings, coord)
        try:
            server = StatusServer(settings.listen_addr, daemon.metrics.registry,
                                  daemon.status, daemon.healthy)
        except OSError as exc:
            raise Fatal(f"listen: cannot serve HTTP on {settings.listen}: {exc.strerror}; "
                        "pick another --listen address or port") from exc
        daemon.http_address = _advertised(server.address)
        server.start()
        checkpoints = _checkpoint_service(settings, daemon)
        try:
            os.makedirs(settings.state_path, mode=0o755, exist_ok=True)
            # The running job's processes may use the socket too, each bound to its job/rank.
            binding = CallerBinding(lambda: _job_scope(daemon))
            local = LocalServer(os.path.join(settings.state_path, "elasticd.sock"),
                                daemon.local_handlers(), binding=binding)
            local.start()
        except (OSError, ValueError, LocalApiError) as exc:
            raise Fatal(f"state_dir: cannot serve the workers' socket in "
                        f"{settings.state_path}: {exc}; pick another --state-dir") from exc
        daemon.local_socket = local.path
        try:
            daemon.join()
        except NodeIdInUse as exc:
            raise Fatal(str(exc)) from exc
        except Unavailable as exc:
            raise Fatal(f"{exc}: check --etcd and that etcd is running") from exc
        log.info("serving /metrics, /healthz and /status on http://%s", server.address)
        notifier.ready(daemon.sentence)
        if stop_requested:
            daemon.request_stop()

        def on_cycle(d: Daemon) -> None:
            nonlocal reload_requested
            if reload_requested:
                reload_requested = False
                usec = int(d.clock.monotonic() * 1e6)
                notifier.notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")
                _reload(d, args)
                notifier.ready(d.sentence)
            # Only after a completed cycle: a stalled loop stops the pings and systemd's
            # watchdog restarts the daemon.
            notifier.watchdog()

        daemon.run(on_cycle)
        notifier.notify("STOPPING=1")
        log.info("leaving the cluster")
        daemon.leave()
        return 0
    finally:
        if local is not None:
            local.stop()
        if daemon is not None and daemon.checkpoints is not None:
            # Slots stay in shared memory: a restarted daemon adopts those that verify.
            if daemon.checkpoints.persist is not None:
                daemon.checkpoints.persist.close()
            daemon.close_replication()
            daemon.checkpoints.store.close(unlink=False)
            for path in (settings.shm_path, settings.shm_path + "+replicas"):
                try:
                    os.rmdir(path)  # only when empty: kept slots wait for the next start
                except OSError:
                    pass
        if server is not None:
            server.stop()
        if coord is not None:
            coord.close()
        if embedded is not None:
            embedded.stop()
        notifier.close()


def main(argv: Sequence[str] | None = None) -> None:
    try:
        code = run(argv)
    except Fatal as exc:
        print(f"elasticd: error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    sys.exit(code)


if __name__ == "__main__":
    main()
