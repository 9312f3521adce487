"""``elasticctl``: look at and drive an elasticd cluster through etcd.

Every command shares ``--format pretty|json`` (one output function for both; JSON carries stable
keys and nothing decorative) and ``--watch SECONDS`` (refresh until interrupted; with JSON one
document per line). Exit status: 0 success, 1 the operation failed (etcd unreachable, not
found), 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Sequence

from elasticd.agent.spec import JobSpecError
from elasticd.cli import jobs as jobs_cli
from elasticd.cli.output import Table, emit
from elasticd.cluster.events import EventLog
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace, check_prefix
from elasticd.daemon.daemon import decode_node

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def _env(name: str, default: str = "") -> str:
    return os.environ.get("ELASTICD_" + name.upper(), default)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("cluster")
    g.add_argument("--etcd", default=_env("etcd"),
                   help="HOST:PORT[,HOST:PORT...] of etcd (env ELASTICD_ETCD)")
    g.add_argument("--prefix", default=_env("prefix", "/elasticd"),
                   help="cluster key prefix (env ELASTICD_PREFIX, default /elasticd)")
    g.add_argument("--etcd-user", default=_env("etcd_user"))
    g.add_argument("--etcd-password", default=_env("etcd_password"),
                   help="prefer the env ELASTICD_ETCD_PASSWORD")
    g.add_argument("--etcd-ca-cert", default=_env("etcd_ca_cert"))
    g.add_argument("--etcd-cert", default=_env("etcd_cert"))
    g.add_argument("--etcd-key", default=_env("etcd_key"))
    g.add_argument("--etcd-timeout", type=float, default=2.0)
    o = common.add_argument_group("output")
    o.add_argument("--format", choices=("pretty", "json"), default="pretty")
    o.add_argument("--watch", type=float, metavar="SECONDS",
                   help="refresh every SECONDS until interrupted")

    p = argparse.ArgumentParser(
        prog="elasticctl", description="Inspect and drive an elasticd cluster.",
        epilog="Examples:\n  elasticctl --etcd 10.0.0.5:2379 nodes\n"
               "  elasticctl status --format json\n  elasticctl history --watch 2",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("nodes", parents=[common], help="live nodes and their state",
                   description="List the live nodes (those holding a lease).")
    sub.add_parser("status", parents=[common], help="cluster summary",
                   description="Nodes, what each is doing, and recent events.")
    h = sub.add_parser("history", parents=[common], help="failures, departures, joins",
                       description="Cluster events, oldest first.")
    h.add_argument("--limit", type=int, default=50)
    jobs_cli.add_parsers(sub, common)
    return p


def _connect(args: argparse.Namespace) -> tuple[EtcdCoordinator, Keyspace]:
    if not args.etcd:
        raise UsageError("no etcd endpoint: pass --etcd HOST:PORT or set ELASTICD_ETCD")
    try:
        endpoints = parse_endpoints(args.etcd)
        keys = Keyspace(check_prefix(args.prefix))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if bool(args.etcd_user) != bool(args.etcd_password):
        raise UsageError("--etcd-user and --etcd-password go together")
    settings = EtcdSettings(endpoints, timeout=args.etcd_timeout,
                            user=args.etcd_user or None, password=args.etcd_password or None,
                            ca_cert=args.etcd_ca_cert or None, cert=args.etcd_cert or None,
                            key=args.etcd_key or None)
    return EtcdCoordinator(settings), keys


def _nodes(coord: EtcdCoordinator, keys: Keyspace) -> list[dict[str, Any]]:
    kvs, _ = coord.get_prefix(keys.nodes)
    now = time.time()
    out = []
    for kv in kvs:
        try:
            r = decode_node(kv.value, kv.key)
        except records.RecordError as exc:
            out.append({"node": keys.node_of(kv.key), "state": "unreadable", "address": "",
                        "error": str(exc)})
            continue
        out.append({
            "node": r.node, "state": r.state, "address": r.address, "hostname": r.hostname,
            "pid": r.pid, "lease": f"{r.lease:x}", "version": r.version,
            "heartbeat_age_seconds": round(max(0.0, now - r.heartbeat_at), 3),
            "up_seconds": round(max(0.0, now - r.started_at), 3),
            "sentence": r.sentence,
        })
    return out


NODE_TABLE = Table([("NODE", "node"), ("STATE", "state"), ("ADDRESS", "address"),
                    ("HEARTBEAT", "heartbeat_age_seconds"), ("DOING", "sentence")])
EVENT_TABLE = Table([("WHEN", "at_iso"), ("NODE", "node"), ("EVENT", "kind"), ("BY", "by"),
                     ("DETAIL", "detail")])


def _events(coord: EtcdCoordinator, keys: Keyspace, limit: int) -> list[dict[str, Any]]:
    out = []
    for e in EventLog(coord, keys).list()[-limit:]:
        out.append({"at": e.at, "at_iso": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(e.at)),
                    "node": e.node, "kind": e.kind, "lease": f"{e.lease:x}", "by": e.by,
                    "detail": e.detail, "data": e.data})
    return out


def _status_pretty(doc: dict[str, Any]) -> str:
    return (f"cluster {doc['prefix']} on etcd {doc['etcd']}: {doc['nodes_alive']} nodes alive\n\n"
            + NODE_TABLE.render(doc["nodes"]) + "\n\nrecent events:\n"
            + EVENT_TABLE.render(doc["recent_events"]))


def cmd_nodes(args: argparse.Namespace, coord: EtcdCoordinator, keys: Keyspace) -> Any:
    return _nodes(coord, keys)


def cmd_status(args: argparse.Namespace, coord: EtcdCoordinator, keys: Keyspace) -> Any:
    nodes = _nodes(coord, keys)
    return {"prefix": keys.prefix, "etcd": args.etcd, "nodes_alive": len(nodes),
            "nodes": nodes, "recent_events": _events(coord, keys, 10)}


def cmd_history(args: argparse.Namespace, coord: EtcdCoordinator, keys: Keyspace) -> Any:
    return _events(coord, keys, args.limit)


Command = Callable[[argparse.Namespace, EtcdCoordinator, Keyspace], Any]

#: command -> (what it computes, how it reads for people)
COMMANDS: dict[str, tuple[Command, Table | Callable[[Any], str]]] = {
    "nodes": (cmd_nodes, NODE_TABLE),
    "status": (cmd_status, _status_pretty),
    "history": (cmd_history, EVENT_TABLE),
    **jobs_cli.COMMANDS,
}


def run(argv: Sequence[str] | None = None, out: Any = None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    try:
        coord, keys = _connect(args)
    except UsageError as exc:
        print(f"elasticctl: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    compute, pretty = COMMANDS[args.command]
    try:
        while True:
            try:
                text = emit(compute(args, coord, keys), args.format, pretty,
                            one_line=bool(args.watch))
            except JobSpecError as exc:
                print(f"elasticctl: error: {exc}", file=sys.stderr)
                return EXIT_USAGE
            except jobs_cli.CommandFailed as exc:
                print(f"elasticctl: error: {exc}", file=sys.stderr)
                return EXIT_FAILED
            except CoordinationError as exc:
                print(f"elasticctl: error: {exc}", file=sys.stderr)
                if not args.watch:
                    return EXIT_FAILED
                text = ""
            if args.watch and args.format == "pretty" and out.isatty():
                out.write("\033[H\033[2J")
            if text:
                out.write(text + "\n")
                out.flush()
            if not args.watch:
                return EXIT_OK
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        coord.close()


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
