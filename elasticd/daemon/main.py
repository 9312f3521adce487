"""``elasticd``: the node daemon's command line.

Settings come from flags, ``ELASTICD_*`` variables and a TOML file (``--config``); every bad
value, an unreachable etcd, and a missing etcd binary end the process with one line on stderr
saying what to do, and exit status 2. Without ``--etcd`` the daemon starts a private etcd on
127.0.0.1 and stops it on exit (a single-node setup; several nodes need a shared etcd).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import signal
import sys
from typing import Any, Sequence

from elasticd import config
from elasticd.daemon.daemon import Daemon
from elasticd.daemon.node import Fatal, Node
from elasticd.daemon.notify import Notifier
from elasticd.daemon.signals import SignalRelay
from elasticd.printable import PrintableFormatter, printable

log = logging.getLogger("elasticd")

EXIT_USAGE = 2


#: Each setting's help; ``build_parser`` gives every setting of :class:`config.Settings` a flag
#: (``node_id`` → ``--node-id``) with this text, so no setting is left without one.
_HELP = {
    "node_id": "this node's name (default: host name)",
    "etcd": "HOST:PORT[,HOST:PORT...] of etcd; omit to start a private one",
    "prefix": "etcd key prefix of the cluster (default /elasticd)",
    "listen": "HOST:PORT for /metrics, /healthz, /status (port 0: any)",
    "lease_ttl": "seconds after which a silent node is declared dead (default 5)",
    "loop_interval": "seconds between main loop cycles (default 1)",
    "heartbeat_interval": "seconds between timed rewrites of the node record (default 0: "
                          "none; the lease carries liveness)",
    "etcd_timeout": "seconds one etcd request may take (default 1, at most --lease-ttl)",
    "outage_grace": "seconds to keep workers running while etcd is unreachable (default 30)",
    "provisional_grace": "seconds a peer's expiry seen during this node's own outage stays "
                         "provisional (default 0: 2 x lease TTL + 2)",
    "events_retention": "cluster events kept in etcd (default 1000)",
    "etcd_user": "etcd user (with --etcd-password)",
    "etcd_password": "prefer ELASTICD_ETCD_PASSWORD: flags are visible in ps",
    "etcd_ca_cert": "CA certificate of etcd's TLS",
    "etcd_cert": "client certificate for etcd (with --etcd-key and --etcd-ca-cert)",
    "etcd_key": "client key for etcd",
    "state_dir": "job logs and the local socket (default /var/lib/elasticd/NODE as root)",
    "agent_restarts": "restarts of a job's dead agent, with backoff (default 10)",
    "stop_grace": "seconds between SIGTERM and SIGKILL when stopping a job (default 10)",
    "rdzv_last_call": "torchrun's last_call_timeout for the job's rendezvous (default 1)",
    "rdzv_grow": "immediate: a returning or added node enters at once (every node stops once; "
                 "default); at-failure: it waits as a spare for the next failure; "
                 "interval:MIN: as at-failure, and at most once every MIN minutes, at a "
                 "committed step, it enters at once",
    "worker_start": "warm: fork workers from a process that imported torch already "
                    "(default); cold: a new interpreter per worker",
    "shm_dir": "tmpfs directory of checkpoint slots (default /dev/shm/elasticd-NODE)",
    "memory_cap_mib": "cap on checkpoint RAM (snapshots and peer replicas), MiB (default 0: "
                      "none)",
    "scratch_cap_mib": "most MiB of restore scratch one job may hold on this node (default "
                       "0: half of its RAM)",
    "persist_dir": "persistent checkpoint tier (shared filesystem); empty: none",
    "persist_every_steps": "flush a complete step to the persistent tier every N steps "
                           "(default 0: not by steps)",
    "persist_every_seconds": "flush a complete step to the persistent tier every N seconds "
                             "(default 0: not by time)",
    "persist_keep": "complete steps kept on the persistent tier per job (default 3)",
    "cluster_secret_file": "file with the replication secret (or env ELASTICD_CLUSTER_SECRET); "
                           "without a secret, peer replication is off",
    "replication_listen": "HOST:PORT of the replication server (default 0.0.0.0:9401; port 0: "
                          "any)",
    "replicas": "copies of each snapshot, its own included (default 2)",
    "unprotected_lag_steps": "commit lag in steps past which a job shows UNPROTECTED "
                             "(default 100)",
    "log_level": "DEBUG, INFO, WARNING or ERROR (default INFO)",
    "job_users": "users jobs may run as here, comma-separated (default: any but root; *: any, "
                 "root too)",
    "job_python": "the only interpreter a job may name (default: the daemon's own)",
    "job_env_allow": "variables a job may set although refused by default (LD_*, PYTHON*, "
                     "BASH_ENV, ENV): names or patterns, comma-separated",
    "agent_etcd_users": "auto (default: on when the daemon authenticates to etcd), on or off: "
                        "an etcd user per job for its agents, allowed only its rendezvous",
    "agent_etcd_cert": "client certificate for agents, when etcd asks for one (with "
                       "--agent-etcd-key)",
    "agent_etcd_key": "client key for agents",
}
#: Settings with no flag, and why: a secret on the command line is readable by every local
#: user (``ps``); it comes from ``--cluster-secret-file`` or ``ELASTICD_CLUSTER_SECRET``.
NO_FLAG = ("cluster_secret",)


def flag(setting: str) -> str:
    """The flag of a setting: ``node_id`` → ``--node-id``."""
    return "--" + setting.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elasticd",
        description="Per-node daemon of an elasticd training cluster.",
        epilog="Every flag also reads from ELASTICD_<NAME> (e.g. ELASTICD_NODE_ID) and from the "
               "TOML file given with --config; the cluster secret only from "
               "ELASTICD_CLUSTER_SECRET or --cluster-secret-file (a flag would show in ps). "
               "Example: elasticd --node-id n1 --etcd 10.0.0.5:2379 --listen 0.0.0.0:9400",
    )
    p.add_argument("--config", help="TOML file with settings (keys named like the flags)")
    # Numbers and words stay text here: config.load checks them, so flags, environment and
    # file give one message.
    special: dict[str, dict[str, Any]] = {
        "rdzv_grow": {"metavar": "|".join(config.GROW_POLICIES)},
        "worker_start": {"choices": ("warm", "cold")},
    }
    for field in dataclasses.fields(config.Settings):
        if field.name not in NO_FLAG:
            p.add_argument(flag(field.name), help=_HELP.get(field.name),
                           **special.get(field.name, {}))
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
        notifier.ready(daemon.loop.sentence)
        if stop_requested:
            daemon.request_stop()

        def on_cycle(d: Daemon) -> None:
            nonlocal reload_requested
            if reload_requested:
                reload_requested = False
                usec = int(d.clock.monotonic() * 1e6)
                notifier.notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")
                _reload(d, args)
                notifier.ready(d.loop.sentence)
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
