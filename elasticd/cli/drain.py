"""``elasticctl drain NODE``: take a node out of its jobs without losing a committed step.

Writes the request (:mod:`elasticd.cluster.drain_record`), then polls the record the node's
daemon updates and prints each change of progress on stderr (stdout keeps the final document, so
``--format json`` stays one JSON value). Exit 0 once the node is drained; 1 when the drain
failed, the node died or left meanwhile, or it did not finish in time (the daemon goes on:
look again with ``elasticctl drain --status NODE``). A drained node runs no job until
``elasticctl drain --undo NODE``.
"""

from __future__ import annotations

import argparse
import getpass
import socket
import sys
from typing import Any

from elasticd.cli import options
from elasticd.cli.errors import CommandFailed, UsageError, confirm
from elasticd.clock import SYSTEM_CLOCK
from elasticd.cluster import drain_record
from elasticd.coordination import records
from elasticd.coordination.api import Coordinator
from elasticd.coordination.keys import Keyspace, check_name
from elasticd.printable import printable

EPILOG = """\
Examples:
  elasticctl drain n3 --force                 # hand off n3's replicas, stop its workers
  elasticctl drain n3 --force --timeout 300   # allow 5 minutes for the hand-off
  elasticctl drain n3 --status                # where a drain is
  elasticctl drain n3 --undo                  # n3 may run jobs again

Exit status: 0 drained (or undone), 1 failed or timed out, 2 bad usage (or no --force in a
script), 3 etcd unreachable."""

#: Seconds the CLI waits past the hand-off timeout: the workers' stop grace and a margin.
STOP_MARGIN = 40.0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    d = sub.add_parser("drain", parents=[common], help="move a node's replicas away, stop its "
                       "workers, keep it out of jobs",
                       description="Drain NODE: its daemon hands every committed step's "
                                   "copies to other nodes, waits for the snapshot in flight, "
                                   "then stops its workers; the job continues without it.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("node")
    d.add_argument("--force", action="store_true", help="do not ask")
    d.add_argument("--timeout", type=options.seconds(1, 86400, 120), default=120.0,
                   metavar="SECONDS",
                   help="seconds the node may spend handing off replicas (default 120)")
    what = d.add_mutually_exclusive_group()
    what.add_argument("--undo", action="store_true",
                      help="remove the drain: the node may run jobs again")
    what.add_argument("--status", action="store_true", help="show the drain record and exit")
    what.add_argument("--no-wait", action="store_true",
                      help="write the request and exit without following it")


def _doc(rec: drain_record.DrainRecord | None, node: str, now: float) -> dict[str, Any]:
    if rec is None:
        return {"node": node, "state": "none", "phase": "", "detail": "not drained",
                "seconds": 0.0, "copies_done": 0, "copies_failed": 0, "copies_planned": 0,
                "jobs": {}, "requested_at": None, "by": ""}
    end = rec.updated_at if rec.state in drain_record.FINAL else now
    return {"node": rec.node, "state": rec.state, "phase": rec.phase, "detail": rec.detail,
            "seconds": round(max(0.0, end - rec.requested_at), 3),
            "copies_done": rec.copies_done, "copies_failed": rec.copies_failed,
            "copies_planned": rec.copies_planned, "jobs": rec.jobs,
            "requested_at": rec.requested_at, "by": rec.by}


def cmd_drain(args: argparse.Namespace, coord: Coordinator, keys: Keyspace) -> Any:
    try:
        node = check_name("node", args.node)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    try:
        if args.status:
            return _doc(drain_record.read(coord, keys, node), node, SYSTEM_CLOCK.wall())
        if args.undo:
            old = drain_record.undo(coord, keys, node)
            return {**_doc(None, node, SYSTEM_CLOCK.wall()), "undone": old is not None,
                    "previous_state": old.state if old else "none"}
    except records.RecordError as exc:
        raise CommandFailed(f"unreadable drain record of {node}: {exc}") from exc
    if coord.get(keys.node(node)) is None:
        raise CommandFailed(f"node {node!r} is not alive (see: elasticctl nodes)")
    confirm(f"drain {node}: hand off its replicas and stop its workers?",
            f"draining {node!r} stops its workers", args.force)
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    rec = drain_record.request(coord, keys, node, args.timeout, by, SYSTEM_CLOCK.wall())
    if args.no_wait:
        return _doc(rec, node, SYSTEM_CLOCK.wall())
    return _follow(coord, keys, node, args.timeout + STOP_MARGIN)


def _follow(coord: Coordinator, keys: Keyspace, node: str, wait: float) -> dict[str, Any]:
    """Polls the drain record, printing each change on stderr, until a final state."""
    deadline = SYSTEM_CLOCK.monotonic() + wait
    shown: set[tuple[Any, ...]] = set()  # progress entries printed
    while True:
        rec = drain_record.read(coord, keys, node)
        if rec is None:
            raise CommandFailed(f"the drain record of {node} was removed (drain --undo?)")
        for at, state, phase, detail in rec.log:
            if (at, state, phase, detail) not in shown:
                shown.add((at, state, phase, detail))
                print(printable(f"[{max(0.0, at - rec.requested_at):6.1f} s] {node}: {state}"
                                f"{' / ' + phase if phase else ''}: {detail}"),
                      file=sys.stderr, flush=True)
        if rec.state == drain_record.DrainState.DRAINED:
            return _doc(rec, node, SYSTEM_CLOCK.wall())
        if rec.state == drain_record.DrainState.FAILED:
            raise CommandFailed(f"drain of {node} failed: {rec.detail}")
        if coord.get(keys.node(node)) is None:
            raise CommandFailed(f"node {node} left or died before its drain finished "
                                f"(last: {rec.state} / {rec.phase}: {rec.detail})")
        if SYSTEM_CLOCK.monotonic() > deadline:
            raise CommandFailed(f"drain of {node} not finished after {wait:g} s (now "
                                f"{rec.state} / {rec.phase}: {rec.detail}); it goes on: "
                                f"elasticctl drain {node} --status")
        SYSTEM_CLOCK.sleep(0.2)


def _pretty(doc: dict[str, Any]) -> str:
    if "undone" in doc:
        return (f"{doc['node']}: drain removed (was {doc['previous_state']}); it may run "
                "jobs again" if doc["undone"] else f"{doc['node']}: was not drained")
    if doc["state"] == "none":
        return f"{doc['node']}: not drained"
    return (f"{doc['node']}: {doc['state']} after {doc['seconds']:.1f} s; replica copies "
            f"handed off {doc['copies_done']}/{doc['copies_planned']}"
            f"{', failed ' + str(doc['copies_failed']) if doc['copies_failed'] else ''}"
            f" — {doc['detail']}")


COMMANDS = {"drain": (cmd_drain, _pretty)}
