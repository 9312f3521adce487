"""``elasticctl``: look at and drive an elasticd cluster through etcd.

Every command shares the cluster options and ``--format pretty|json`` (one output function for
both; JSON carries stable keys and nothing decorative, documented in docs/elasticctl.md) and,
where re-reading makes sense, ``--watch SECONDS`` (refresh until interrupted; with JSON one
document per line); they go before or after the command (:mod:`elasticd.cli.options`).
Destructive commands (stop, drain) need ``--force`` in scripts and ask on a terminal. Exit
status: :data:`EPILOG` and :mod:`elasticd.cli.errors`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Any, Callable, Sequence

from elasticd.cli import drain as drain_cli
from elasticd.cli import jobs as jobs_cli
from elasticd.cli import options
from elasticd.cli import replicas as replicas_cli
from elasticd.cli.errors import (
    EXIT_ETCD,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CommandFailed,
    UsageError,
)
from elasticd.cli.options import Parser
from elasticd.cli.output import Table, emit
from elasticd.clock import SYSTEM_CLOCK, format_local
from elasticd.cluster import drain_record, timeline
from elasticd.cluster.events import EventLog
from elasticd.cluster.jobspec import JobSpecError
from elasticd.cluster.membership import decode_node
from elasticd.coordination import records
from elasticd.coordination.api import CoordinationError, Unavailable
from elasticd.coordination.etcd import EtcdCoordinator, EtcdSettings, parse_endpoints
from elasticd.coordination.keys import Keyspace, check_prefix
from elasticd.printable import PrintableFormatter, printable

log = logging.getLogger(__name__)

#: Commands that change something: ``--watch`` would repeat them, so it is refused.
NOT_WATCHABLE = ("submit", "stop", "drain")

EPILOG = """\
Examples:
  elasticctl --etcd 10.0.0.5:2379 nodes
  elasticctl status --format json
  elasticctl history --watch 2
  elasticctl placement mnist
  elasticctl drain n3 --force

The cluster and output options go before or after the command. Exit status: 0 ok, 1 the
operation failed, 2 bad usage or input (also: a destructive command without --force in a
script), 3 etcd unreachable. JSON keys: docs/elasticctl.md."""


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    options.add_shared(common, after_command=True)
    p = Parser(prog="elasticctl", description="Inspect and drive an elasticd cluster.",
               epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_shared(p, after_command=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter
    sub.add_parser("nodes", parents=[common], help="live nodes and their state",
                   description="List the live nodes (those holding a lease) and any drain.",
                   epilog="Example: elasticctl nodes --watch 1", formatter_class=raw)
    sub.add_parser("status", parents=[common], help="cluster summary",
                   description="Nodes, what each is doing, and recent events.",
                   epilog="Example: elasticctl status --format json", formatter_class=raw)
    h = sub.add_parser("history", parents=[common], help="failures, recoveries, departures",
                       description="Cluster events, oldest first: failures with their "
                                   "detection time, recoveries with their source, restore "
                                   "and recovery time and steps lost, each recovery's "
                                   "timeline (seconds per phase from the failure to the "
                                   "first step), joins, departures, drains, fencings.",
                       epilog="Examples:\n  elasticctl history --limit 20\n"
                              "  elasticctl history --kind failed,recovered --format json\n"
                              "  elasticctl history --kind timeline",
                       formatter_class=raw)
    h.add_argument("--limit", type=options.whole(1, 100_000, "events"), default=50,
                   help="newest N events (default 50)")
    h.add_argument("--kind", default="", help="only these kinds, comma-separated")
    jobs_cli.add_parsers(sub, common)
    replicas_cli.add_parsers(sub, common)
    drain_cli.add_parsers(sub, common)
    return p


def _connect(args: argparse.Namespace) -> tuple[EtcdCoordinator, Keyspace]:
    if not args.etcd:
        raise UsageError("no etcd endpoint: pass --etcd HOST:PORT or set ELASTICD_ETCD")
    where = args.sources.get
    try:
        endpoints = parse_endpoints(args.etcd)
    except ValueError as exc:
        raise UsageError(f"{where('etcd')}: {exc}: give HOST:PORT[,HOST:PORT...] of etcd, "
                         "e.g. 10.0.0.5:2379") from exc
    try:
        keys = Keyspace(check_prefix(args.prefix))
    except ValueError as exc:
        raise UsageError(f"{where('prefix')}: {exc}") from exc
    if bool(args.etcd_user) != bool(args.etcd_password):
        raise UsageError("--etcd-user and --etcd-password go together: give both (the "
                         "password best as ELASTICD_ETCD_PASSWORD) or neither")
    options.check_tls_files(args)
    return EtcdCoordinator(EtcdSettings.of(endpoints, args)), keys


def cmd_nodes(args: argparse.Namespace, coord: EtcdCoordinator, keys: Keyspace) -> Any:
    kvs, _ = coord.get_prefix(keys.nodes)
    drains = drain_record.read_all(coord, keys)
    now = SYSTEM_CLOCK.wall()
    out = []
    for kv in kvs:
        node = records.where_of(kv.key[len(keys.nodes):])
        d = drains.get(node)
        try:
            r = decode_node(kv.value, kv.key, keys)
        except records.RecordError as exc:
            out.append({"node": node, "state": "unreadable", "address": "", "hostname": "",
                        "pid": 0, "lease": "", "version": "", "heartbeat_age_seconds": None,
                        "up_seconds": None, "sentence": "", "drain": d.state if d else None,
                        "error": str(exc)})
            continue
        out.append({
            "node": r.node, "state": r.state, "address": r.address, "hostname": r.hostname,
            "pid": r.pid, "lease": f"{r.lease:x}", "version": r.version,
            "heartbeat_age_seconds": round(max(0.0, now - r.heartbeat_at), 3),
            "up_seconds": round(max(0.0, now - r.started_at), 3),
            "sentence": r.sentence, "drain": d.state if d else None,
        })
    return out


NODE_TABLE = Table([("NODE", "node"), ("STATE", "state"), ("DRAIN", "drain"),
                    ("ADDRESS", "address"), ("UPDATED", "heartbeat_age_seconds"),
                    ("DOING", "sentence")])
EVENT_TABLE = Table([("WHEN", "at_iso"), ("NODE", "node"), ("EVENT", "kind"),
                     ("DETECT S", "detection_seconds"), ("SOURCE", "source"),
                     ("RESTORE S", "restore_seconds"), ("RECOVERY S", "recovery_seconds"),
                     ("LOST", "steps_lost"), ("DETAIL", "detail")])

#: A recovery's timeline, one row per ``timeline`` event (``history`` prints it below the events).
TIMELINE_TABLE = Table([("WHEN", "at_iso"), ("JOB", "job"), ("FAILED", "failed"),
                        ("PATH", "path"),
                        *((p.upper().replace("_", " "), p) for p in timeline.PHASES),
                        ("TOTAL", "total"), ("SOURCE", "source"), ("BYTES", "bytes"),
                        ("STEP", "step")])
#: Unreadable timelines, each reported once (``--watch`` reads them again and again).
_complaints = records.Complaints(log)

#: Events after which a recovery counts as recovering from them.
_DISRUPTIONS = ("failed", "left", "drained", "fenced")
#: Events after which a restore is the job growing (recovery_seconds null).
_GROWTHS = ("joined", "rejoined")
#: A recovery further than this from the last disruption is not attributed to it.
_RECOVERY_WINDOW = 600.0


def event_rows(coord: EtcdCoordinator, keys: Keyspace, limit: int,
            kinds: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Events, oldest first, each with the same keys: docs/elasticctl.md (``history``) says
    what each kind's keys hold, and how a failure that has a timeline is measured."""
    listed = EventLog(coord, keys).list()
    placed = _failures_placed(listed)
    out = []
    last_disruption: float | None = None
    for e in listed:
        d = e.data or {}
        row = {"at": e.at, "at_iso": format_local(e.at, "%Y-%m-%dT%H:%M:%S"),
               "node": e.node, "kind": e.kind, "lease": f"{e.lease:x}", "by": e.by,
               "detail": e.detail, "data": d, "job": d.get("job"), "rank": d.get("rank"),
               "step": d.get("step"), "detection_seconds": d.get("detection_seconds"),
               "source": d.get("source"), "steps_lost": d.get("steps_lost"),
               "restore_seconds": d.get("seconds") if e.kind == "recovered" else None,
               "path": d.get("path") if e.kind == "recovered" else None,
               "recovery_seconds": None, "timeline": None}
        if e.kind == timeline.KIND:
            _add_timeline(row, e.data, f"the timeline of {e.node}'s failure ({e.instance})")
        if e.kind in _GROWTHS:
            last_disruption = None  # a restore after a node joined is a grow, no recovery
        if e.kind in _DISRUPTIONS:
            last_disruption = e.at
            t = placed.get((e.node, e.lease)) if e.kind == "failed" else None
            if t is not None and t.failure_at is not None:
                last_disruption = t.failure_at
                row["detection_seconds"] = round(max(0.0, e.at - t.failure_at), 3)
        elif e.kind == "recovered":
            # A restore its recovery's timeline counts (which may come before the failed
            # event: the survivors re-formed before the lease was seen expired), else one
            # after a disruption.
            t = next((t for t in placed.values() if _counts(t, d.get("job"), e.at)), None)
            since = t.failure_at if t is not None else last_disruption
            if since is not None and 0 <= e.at - since <= _RECOVERY_WINDOW:
                row["recovery_seconds"] = round(e.at - since, 3)
        if not kinds or e.kind in kinds:
            out.append(row)
    return out[-limit:] if limit > 0 else out


def _counts(t: timeline.Timeline, job: Any, at: float) -> bool:
    """Whether a restore of ``job`` ended at ``at`` is one of ``t``'s."""
    assert t.failure_at is not None
    return t.job == job and t.failure_at <= at <= (t.first_step_at or t.failure_at
                                                    + _RECOVERY_WINDOW)


def _failures_placed(listed: Sequence[Any]) -> dict[tuple[str, int], timeline.Timeline]:
    """The readable timelines by the failure they recovered from (node, lease), whose
    failure they place."""
    out = {}
    for e in listed:
        if e.kind == timeline.KIND:
            with contextlib.suppress(records.RecordError):
                t = timeline.decode(e.data)
                if t.failure_at is not None:
                    out[(e.node, e.lease)] = t
    return out


def _add_timeline(row: dict[str, Any], data: Any, where: str) -> None:
    """Fills a ``timeline`` event's row; one that does not read is left out, with a warning."""
    try:
        t = timeline.decode(data, where)
    except records.RecordError as exc:
        _complaints.warn(where, repr(data).encode(), "elasticctl: ignoring %s", exc)
        row.update(job=None, step=None, source=None)
        return
    summary = t.summary()
    row.update(timeline=summary, job=t.job, step=t.step, source=summary["restore_source"],
               detection_seconds=summary["phases"]["detect"],
               restore_seconds=summary["phases"]["restore"], steps_lost=t.steps_lost,
               recovery_seconds=summary["total_seconds"])


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def timeline_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of :data:`TIMELINE_TABLE` for the ``timeline`` events among ``rows``."""
    return [{"at_iso": r["at_iso"], "job": t["job"], "failed": ",".join(t["failed"]),
             "path": _PATH_WORDS.get(t.get("path") or "", "-"),
             **{p: _seconds(s) for p, s in t["phases"].items()},
             # The detect phase: a range when only the lease placed the failure.
             "detect": (f"{d[0]:.2f}-{d[1]:.2f}" if (d := t.get("detect_range"))
                        else _seconds(t["phases"]["detect"])),
             "total": _seconds(t["total_seconds"]),
             "source": t["restore_source"],
             "bytes": _size(t["restore_bytes"]) if t["ranks_restored"] else None,
             "step": t["step"]}
            for r in rows if (t := r.get("timeline"))]


#: How a recovery's path reads (``-``: a record written before paths were kept).
_PATH_WORDS = {"in_process": "in-process", "restart": "restart"}


def rank_sources(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Where each rank's state came from, for each ``timeline`` among ``rows``, and where its
    failure is placed, and the phases of the path its writer's workers took: one line each."""
    words = {"local": "local RAM (its own node's snapshot)",
             "peer": "a peer's RAM (a copy on another node)",
             "persistent": "the persistent tier (disk)"}
    out = []
    for r in rows:
        t = r.get("timeline")
        if not t:
            continue
        placed = timeline.EVIDENCE_WORDS.get(t.get("failure_evidence") or "",
                                             timeline.NO_EVIDENCE)
        out.append(f"{t['job']} after {','.join(t['failed'])}'s failure (placed at {placed}):")
        # The path's phases (an in-process recovery's: timeline.IN_PROCESS_PHASES).
        parts = ", ".join(f"{name.replace('_', ' ')} {'-' if v is None else f'{v:.3f}'}"
                          for name, v in t["path_phases"].items())
        out.append(f"  path {_PATH_WORDS.get(t.get('path') or '', 'not recorded')} (seconds): "
                   f"{parts}")
        for e in t["ranks"]:
            lost = "" if e["steps_lost"] is None else f", {e['steps_lost']} steps lost"
            # Said for an in-process recovery only, where ranks may differ (on the restart path
            # every rank's process was started), and last: the line's start is grepped.
            how = {"in_process": "; its process kept in-process",
                   "restart": "; its process started"}.get(e.get("path") or "", "")
            out.append(f"  rank {'?' if e['rank'] is None else e['rank']} on "
                       f"{e['node'] or '?'}: step {e['step']} from "
                       f"{words.get(e['source'], e['source'])} in {e['seconds']:.3f} s{lost}"
                       f"{how if t.get('path') == 'in_process' else ''}")
    return out


def history_pretty(rows: Sequence[dict[str, Any]]) -> str:
    """The events, then each recovery's phases (seconds; ``-``: not seen) and where each
    rank's state came from."""
    text = EVENT_TABLE.render(rows)
    recoveries = timeline_rows(rows)
    if recoveries:
        text += ("\n\nrecoveries (seconds per phase, from the failure to the first step):\n"
                 + TIMELINE_TABLE.render(recoveries) + "\n\n" + "\n".join(rank_sources(rows)))
    return text


def _status_pretty(doc: dict[str, Any]) -> str:
    return (f"cluster {doc['prefix']} on etcd {doc['etcd']}: {doc['nodes_alive']} nodes alive\n\n"
            + NODE_TABLE.render(doc["nodes"]) + "\n\nrecent events:\n"
            + EVENT_TABLE.render(doc["recent_events"]))


def cmd_status(args: argparse.Namespace, coord: EtcdCoordinator, keys: Keyspace) -> Any:
    nodes = cmd_nodes(args, coord, keys)
    return {"prefix": keys.prefix, "etcd": args.etcd, "nodes_alive": len(nodes),
            "nodes": nodes, "recent_events": event_rows(coord, keys, 10)}


def cmd_history(args: argparse.Namespace, coord: EtcdCoordinator, keys: Keyspace) -> Any:
    kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
    return event_rows(coord, keys, args.limit, kinds)


Command = Callable[[argparse.Namespace, EtcdCoordinator, Keyspace], Any]

#: command -> (what it computes, how it reads for people)
COMMANDS: dict[str, tuple[Command, Table | Callable[[Any], str]]] = {
    "nodes": (cmd_nodes, NODE_TABLE),
    "status": (cmd_status, _status_pretty),
    "history": (cmd_history, history_pretty),
    **jobs_cli.COMMANDS,
    **replicas_cli.COMMANDS,
    **drain_cli.COMMANDS,
}


def warnings_to(stream: Any) -> logging.Handler:
    """Where elasticctl's warnings go: a record it skips is quoted, so escaped like the
    output (:mod:`elasticd.printable`)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(PrintableFormatter("%(message)s"))
    return handler


def run(argv: Sequence[str] | None = None, out: Any = None) -> int:
    """Runs one command; returns its exit status. Every error is one line on stderr."""
    out = out or sys.stdout
    logging.basicConfig(level=logging.WARNING, handlers=[warnings_to(sys.stderr)])
    args = options.resolve(build_parser().parse_args(argv))
    if args.watch is not None and args.command in NOT_WATCHABLE:
        return _fail(EXIT_USAGE, f"--watch does not apply to {args.command} (it changes the "
                                 "cluster): drop --watch")
    try:
        coord, keys = _connect(args)
    except UsageError as exc:
        return _fail(EXIT_USAGE, exc)
    try:
        return _loop(args, coord, keys, out)
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:
        # The reader stopped reading (`elasticctl history --watch 2 | head`): as with ^C, no
        # error; stdout is pointed at /dev/null so the interpreter's last flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # a bug: still one line, and the command line to report
        return _fail(EXIT_FAILED, f"unexpected {type(exc).__name__}: {exc} (a bug in "
                                  f"elasticctl; please report it with the command line)")
    finally:
        coord.close()


def _fail(code: int, why: object) -> int:
    # The reason may quote a record or a node's answer: escaped like the output.
    print(f"elasticctl: error: {printable(str(why))}", file=sys.stderr)
    return code


def _loop(args: argparse.Namespace, coord: EtcdCoordinator, keys: Keyspace, out: Any) -> int:
    compute, pretty = COMMANDS[args.command]
    while True:
        try:
            text = emit(compute(args, coord, keys), args.format, pretty,
                        one_line=bool(args.watch))
        except (JobSpecError, UsageError) as exc:
            return _fail(EXIT_USAGE, exc)
        except CommandFailed as exc:
            return _fail(EXIT_FAILED, exc)
        except CoordinationError as exc:
            code, why = EXIT_FAILED, str(exc)
            if isinstance(exc, Unavailable):  # say what to check
                tls = (" and, with TLS, that etcd serves https with a certificate "
                       "--etcd-ca-cert signed" if args.etcd_ca_cert else "")
                code, why = EXIT_ETCD, (f"{exc}: check --etcd (now {args.etcd}) and that etcd "
                                        f"is running (etcdctl --endpoints {args.etcd} endpoint "
                                        f"health){tls}")
            if not args.watch:
                return _fail(code, why)
            _fail(code, why)  # --watch goes on: etcd may come back
            text = ""
        if args.watch and args.format == "pretty" and out.isatty():
            out.write("\033[H\033[2J")
        if text:
            out.write(text + "\n")
            out.flush()
        if not args.watch:
            return EXIT_OK
        SYSTEM_CLOCK.sleep(args.watch)


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
