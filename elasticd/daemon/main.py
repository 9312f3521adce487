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
import signal
import sys
from typing import Sequence

from elasticd import config
from elasticd.daemon.daemon import Daemon
from elasticd.daemon.node import Fatal, Node
from elasticd.daemon.notify import Notifier
from elasticd.daemon.signals import SignalRelay
from elasticd.printable import PrintableFormatter, printable

log = logging.getLogger("elasticd")

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elasticd",
        description="Per-node daemon of an elasticd training cluster.",
        epilog="Every flag also reads from ELASTICD_<NAME> (e.g. ELASTICD_NODE_ID) and from the "
               "TOML file given with --config. Example: elasticd --node-id n1 "
               "--etcd 10.0.0.5:2379 --listen 0.0.0.0:9400",
    )
    p.add_argument("--config", help="TOML file with settings (keys named like the flags)")
    p.add_argument("--node-id", help="this node's name (default: host name)")
    p.add_argument("--etcd", help="HOST:PORT[,HOST:PORT...] of etcd; omit to start a private one")
    p.add_argument("--prefix", help="etcd key prefix of the cluster (default /elasticd)")
    p.add_argument("--listen", help="HOST:PORT for /metrics, /healthz, /status (port 0: any)")
    # Numbers stay text here: config.load checks them, so flags, env and file give one message.
    p.add_argument("--lease-ttl",
                   help="seconds after which a silent node is declared dead (default 5)")
    p.add_argument("--loop-interval", help="seconds between main loop cycles (default 1)")
    p.add_argument("--heartbeat-interval",
                   help="seconds between timed rewrites of the node record (default 0: none; "
                        "the lease carries liveness)")
    p.add_argument("--etcd-timeout")
    p.add_argument("--outage-grace",
                   help="seconds to keep workers running while etcd is unreachable (default 30)")
    p.add_argument("--provisional-grace")
    p.add_argument("--events-retention")
    p.add_argument("--etcd-user")
    p.add_argument("--etcd-password", help="prefer ELASTICD_ETCD_PASSWORD: flags are visible in ps")
    p.add_argument("--etcd-ca-cert")
    p.add_argument("--etcd-cert")
    p.add_argument("--etcd-key")
    p.add_argument("--state-dir",
                   help="job logs and the local socket (default /var/lib/elasticd/NODE as root)")
    p.add_argument("--agent-restarts")
    p.add_argument("--stop-grace")
    p.add_argument("--rdzv-last-call")
    # Checked by config.load (interval:MIN takes a number), as for the other settings.
    p.add_argument("--rdzv-grow", metavar="|".join(config.GROW_POLICIES),
                   help="immediate: a returning or added node enters at once (every node "
                        "stops once; default); at-failure: it waits as a spare for the next "
                        "failure; interval:MIN: as at-failure, and at most once every MIN "
                        "minutes, at a committed step, it enters at once")
    p.add_argument("--worker-start", choices=("warm", "cold"),
                   help="warm: fork workers from a process that imported torch already "
                        "(default); cold: a new interpreter per worker")
    p.add_argument("--shm-dir",
                   help="tmpfs directory of checkpoint slots (default /dev/shm/elasticd-NODE)")
    p.add_argument("--memory-cap-mib")
    p.add_argument("--scratch-cap-mib",
                   help="most MiB of restore scratch one job may hold on this node (default "
                        "0: half of its RAM)")
    p.add_argument("--persist-dir",
                   help="persistent checkpoint tier (shared filesystem); empty: none")
    p.add_argument("--persist-every-steps")
    p.add_argument("--persist-every-seconds")
    p.add_argument("--persist-keep")
    p.add_argument("--cluster-secret-file",
                   help="file with the replication secret (or env ELASTICD_CLUSTER_SECRET)")
    p.add_argument("--replication-listen",
                   help="HOST:PORT of the replication server (default 0.0.0.0:9401)")
    p.add_argument("--replicas", help="copies of each snapshot, its own included (default 2)")
    p.add_argument("--unprotected-lag-steps",
                   help="commit lag in steps past which a job shows UNPROTECTED (default 100)")
    p.add_argument("--log-level")
    return p


def _settings(args: argparse.Namespace) -> config.Settings:
    cli = {k: v for k, v in vars(args).items() if k != "config"}
    return config.load(cli, args.config)


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

    # Log lines quote what workers, peers and etcd writers sent: each is escaped on its way out.
    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter(
        f"%(asctime)s %(levelname)s {settings.node_id} %(name)s: %(message)s"))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler])
    stop_requested = False

    def on_term() -> None:
        nonlocal stop_requested
        stop_requested = True
        if daemon is not None:
            daemon.request_stop()

    reload_requested = False

    def on_hup() -> None:
        nonlocal reload_requested
        reload_requested = True
        if daemon is not None:
            daemon.wake()

    daemon: Daemon | None = None
    # Not signal.signal(..., on_term): see elasticd.daemon.signals for the deadlock that avoids.
    relay = SignalRelay({signal.SIGTERM: on_term, signal.SIGINT: on_term,
                         signal.SIGHUP: on_hup})
    # `kill -USR1 <pid>` writes every thread's stack to stderr (the journal under systemd):
    # how to see where a stuck daemon waits without stopping it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    notifier = Notifier()
    node = Node(settings)
    try:
        daemon = node.build()
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
        node.close()
        notifier.close()
        relay.close()


def main(argv: Sequence[str] | None = None) -> None:
    try:
        code = run(argv)
    except Fatal as exc:
        print(f"elasticd: error: {printable(str(exc))}", file=sys.stderr)
        code = EXIT_USAGE
    sys.exit(code)


if __name__ == "__main__":
    main()
