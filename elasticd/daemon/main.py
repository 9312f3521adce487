"""``elasticd``: the node daemon's command line.

Settings come from flags, ``ELASTICD_*`` variables and a TOML file (``--config``); every bad
value, an unreachable etcd, and a missing etcd binary end the process with one line on stderr
saying what to do, and exit status 2. Without ``--etcd`` the daemon starts a private etcd on
127.0.0.1 and stops it on exit (a single-node setup; several nodes need a shared etcd).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import logging
import os
import signal
import socket
import sys
from typing import Any, Sequence

from elasticd import config
from elasticd.agent.signals import SignalRelay
from elasticd.daemon.daemon import Daemon
from elasticd.daemon.node import Fatal, Node
from elasticd.printable import PrintableFormatter, printable
from elasticd.rendezvous.rounds import GROW_POLICIES

log = logging.getLogger("elasticd")

EXIT_USAGE = 2


#: Settings with no flag, and why: a secret on the command line is readable by every local
#: user (``ps``); it comes from ``--cluster-secret-file`` or ``ELASTICD_CLUSTER_SECRET``.
NO_FLAG = ("cluster_secret",)


class Notifier:
    """systemd's notify protocol (sd_notify), without libsystemd: datagrams to
    ``$NOTIFY_SOCKET`` if it is set.

    With ``Type=notify`` systemd passes ``NOTIFY_SOCKET``; :func:`main` sends ``READY=1`` once the
    node has joined, ``WATCHDOG=1`` after each completed main-loop cycle (so a stalled loop stops
    the pings and systemd restarts the daemon), ``RELOADING=1`` on SIGHUP and ``STOPPING=1`` on
    shutdown. Without ``NOTIFY_SOCKET`` (no systemd, e.g. inside a Slurm allocation) every call
    is a no-op.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path if path is not None else os.environ.get("NOTIFY_SOCKET", "")
        self._sock: socket.socket | None = None
        if self.path:
            # Non-blocking: a full queue at systemd drops one ping rather than stall the loop.
            self._sock = socket.socket(
                socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)

    def notify(self, message: str) -> None:
        if self._sock is None:
            return
        addr = self.path
        if addr.startswith("@"):  # abstract namespace socket
            addr = "\0" + addr[1:]
        with contextlib.suppress(OSError):  # systemd went away; nothing useful to do about it
            self._sock.sendto(message.encode(), addr)

    def ready(self, status: str = "") -> None:
        # One line: a newline in the status (it may name a job's script) would add fields.
        self.notify("READY=1" + (f"\nSTATUS={printable(status)}" if status else ""))

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


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
        "rdzv_grow": {"metavar": "|".join(GROW_POLICIES)},
        "worker_start": {"choices": ("warm", "cold")},
    }
    for field in dataclasses.fields(config.Settings):
        if field.name not in NO_FLAG:
            p.add_argument(flag(field.name), help=field.metadata["help"],
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
            daemon.loop.stop()

    reload_requested = False

    def on_hup() -> None:
        nonlocal reload_requested
        reload_requested = True
        if daemon is not None:
            daemon.loop.wake()

    daemon: Daemon | None = None
    # Not signal.signal(..., on_term): see elasticd.agent.signals for the deadlock that avoids.
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
            daemon.loop.stop()

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
