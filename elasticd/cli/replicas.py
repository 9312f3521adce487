"""``elasticctl placement`` and ``elasticctl checkpoints``: where each rank's snapshot lives.

Both read the replication records in etcd (``jobs/<job>/placement``, ``ckpt/committed``, the
commit coordinator's election record ``ckpt/committed.coordinator``: docs/replication.md) and
the live node records, and ask each live node's ``/status`` (its HTTP address is in its node
record) for the versions its ranks have with ``m`` copies (no node writes them to etcd: it
reports them to the coordinator), its sync lag, and for ``checkpoints`` the bytes it holds and
its persisted step; they say ``null`` for a node they cannot reach.

A rank is *under-replicated* when fewer than ``m`` live nodes hold a copy of the committed step
(a holder died and re-replication has not finished, or there are fewer than ``m`` nodes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import urllib.request
from typing import Any, Iterator

from elasticd.cli.errors import CommandFailed, UsageError
from elasticd.cli.output import Table
from elasticd.clock import format_local
from elasticd.coordination import records
from elasticd.coordination.api import Coordinator
from elasticd.coordination.keys import Keyspace, check_name
from elasticd.replication import election
from elasticd.replication.commit import Committed, read_committed
from elasticd.replication.placement import Placement, decode_placement

PLACEMENT_EPILOG = """\
Examples:
  elasticctl placement                 # the only job, or name one
  elasticctl placement mnist --format json
  elasticctl placement --watch 2       # follow re-replication after a failure"""

CHECKPOINTS_EPILOG = """\
Examples:
  elasticctl checkpoints
  elasticctl checkpoints mnist --format json"""


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    for name, what, description, epilog in (
            ("placement", "who holds whose snapshot", "Per rank: owner node, holder nodes, "
             "newest versions held; flags ranks held by fewer than m live copies.",
             PLACEMENT_EPILOG),
            ("checkpoints", "committed and persisted steps", "The committed (generation, "
             "step), per-rank versions with m copies, the persisted step and the bytes each "
             "node holds.", CHECKPOINTS_EPILOG)):
        p = sub.add_parser(name, parents=[common], help=what, description=description,
                           epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("job", nargs="?", help="job name (default: the only job)")


def pick_job(coord: Coordinator, keys: Keyspace, job: str | None) -> str:
    """The job named, or the only one there is."""
    kvs, _ = coord.get_prefix(keys.jobs)
    names = []
    for kv in kvs:  # one with no valid job name is skipped: no daemon takes it for a job either
        with contextlib.suppress(ValueError):
            name, what, rest = keys.job_key(kv.key)
            if what == "spec" and not rest:
                names.append(name)
    names.sort()
    if job is not None:
        try:
            check_name("job", job)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        if job not in names:
            raise CommandFailed(f"no job named {job!r} (see: elasticctl jobs)")
        return job
    if not names:
        raise CommandFailed("no job submitted yet (see: elasticctl submit --help)")
    if len(names) > 1:
        raise UsageError(f"several jobs ({', '.join(names)}): name one")
    return names[0]


def live_nodes(coord: Coordinator, keys: Keyspace) -> dict[str, dict[str, Any]]:
    kvs, _ = coord.get_prefix(keys.nodes)
    out = {}
    for kv in kvs:
        try:
            node = keys.node_of(kv.key)
        except ValueError:
            continue
        try:
            out[node] = records.decode(kv.value, "node", kv.key)
        except records.RecordError:
            out[node] = {}
    return out


def _read(coord: Coordinator, keys: Keyspace, job: str) -> tuple[
        Placement | None, Committed | None, dict[str, Any] | None]:
    """The placement, the committed record (holders resolved) and the coordinator's
    election record (None: no coordinator, so no commit)."""
    try:
        kv = coord.get(keys.replication(job).placement)
        placement = decode_placement(kv.value, kv.key) if kv is not None else None
        committed = read_committed(coord, keys, job, [placement])
        kv = coord.get(keys.replication(job).coordinator)
        ship = election.decode(kv.value, kv.key) if kv is not None else None
    except records.RecordError as exc:
        raise CommandFailed(f"{job}: unreadable replication record: {exc}") from exc
    coordinator = None if ship is None else {"node": ship.node, "term": f"{ship.term:x}",
                                             "since": ship.at}
    return placement, committed, coordinator


def _statuses(coord: Coordinator, keys: Keyspace, timeout: float
              ) -> dict[str, dict[str, Any] | None]:
    """Each live node's /status (None: unreachable), asked in parallel."""
    live = live_nodes(coord, keys)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(32, len(live)))) as pool:
        answers = pool.map(lambda rec: _node_status(rec.get("address", ""), timeout),
                           live.values())
        return dict(zip(live, answers))


def _job_replication(status: dict[str, Any] | None, job: str) -> dict[str, Any]:
    return (((status or {}).get("replication") or {}).get("jobs") or {}).get(job) or {}


def _ver(v: Any) -> list[int] | None:
    return [int(v[0]), int(v[1])] if v is not None else None


def _ranks(placement: Placement | None, committed: Committed | None
           ) -> Iterator[tuple[int, str | None, list[str] | None]]:
    """Each rank committed or placed, its owner and holders (None: not placed)."""
    ranks = set(committed.ranks if committed else ()) | {
        r for rs in (placement.ranks.values() if placement else ()) for r in rs}
    for rank in sorted(ranks):
        owner = holders = None
        with contextlib.suppress(KeyError):
            owner = placement.owner_of(rank) if placement else None
            holders = list(placement.holders_of_rank(rank)) if placement else None
        yield rank, owner, holders


def cmd_placement(args: argparse.Namespace, coord: Coordinator, keys: Keyspace) -> Any:
    job = pick_job(coord, keys, args.job)
    placement, committed, coordinator = _read(coord, keys, job)
    statuses = _statuses(coord, keys, min(2.0, args.etcd_timeout))
    alive = set(statuses)
    m = placement.m if placement else (committed.m if committed else 0)
    rows = []
    for rank, owner, holders in _ranks(placement, committed):
        committed_holders = list(committed.holders.get(rank, ())) if committed else []
        live_copies = [h for h in committed_holders if h in alive]
        vs = _job_replication(statuses.get(owner or ""), job).get("replicated", {}).get(str(rank))
        newest = _ver(vs[0]) if vs else None
        rows.append({
            "rank": rank, "owner": owner, "holders": holders or [],
            "committed_holders": committed_holders, "live_copies": len(live_copies),
            "newest_replicated": newest,
            "under_replicated": committed is not None and len(live_copies) < m,
        })
    under = [r["rank"] for r in rows if r["under_replicated"]]
    return {
        "job": job, "m": m, "strategy": placement.strategy if placement else None,
        "round": placement.round if placement else None,
        "nodes": list(placement.nodes) if placement else [],
        "describe": placement.describe() if placement else "no placement published yet",
        "committed": _ver(committed.version) if committed else None,
        "coordinator": coordinator,
        "ranks": rows, "under_replicated_ranks": under,
    }


PLACEMENT_TABLE = Table([("RANK", "rank"), ("OWNER", "owner"), ("HOLDERS", "holders_text"),
                         ("COMMITTED COPIES ON", "committed_text"), ("LIVE", "live_copies"),
                         ("NEWEST", "newest_replicated"), ("UNDER-REPLICATED", "under_flag")])


def _placement_pretty(doc: dict[str, Any]) -> str:
    rows = [{**r, "under_flag": "YES" if r["under_replicated"] else "",
             "holders_text": ",".join(r["holders"]) or "-",
             "committed_text": ",".join(r["committed_holders"]) or "-"} for r in doc["ranks"]]
    head = f"job {doc['job']}: {doc['describe']}; committed step {doc['committed'] or '-'}"
    head += "; " + _coordinator_text(doc["coordinator"])
    tail = (f"\n{len(doc['under_replicated_ranks'])} ranks held by fewer than m={doc['m']} "
            f"live copies: {doc['under_replicated_ranks']}" if doc["under_replicated_ranks"]
            else f"\nevery rank of the committed step has m={doc['m']} live copies"
            if doc["committed"] else "\nnothing committed yet")
    return head + "\n\n" + PLACEMENT_TABLE.render(rows) + tail


def _node_status(address: str, timeout: float) -> dict[str, Any] | None:
    if not address:
        return None
    try:
        with urllib.request.urlopen(f"http://{address}/status", timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def _coordinator_text(c: dict[str, Any] | None) -> str:
    return (f"commits coordinated by {c['node']}" if c else
            "NO COMMIT COORDINATOR: nothing commits until a node of the job is elected")


def cmd_checkpoints(args: argparse.Namespace, coord: Coordinator, keys: Keyspace) -> Any:
    job = pick_job(coord, keys, args.job)
    placement, committed, coordinator = _read(coord, keys, job)
    statuses = _statuses(coord, keys, min(2.0, args.etcd_timeout))
    nodes = []
    persisted: list[int] | None = None
    for node, st in sorted(statuses.items()):
        if st is None:
            nodes.append({"node": node, "reachable": False, "snapshot_bytes": None,
                          "replica_bytes": None, "persisted": None, "latest_local": None,
                          "sync_lag": None})
            continue
        ck = (st.get("checkpoints") or {}).get(job) or {}
        rep = st.get("replication") or {}
        p = _ver(ck.get("persisted"))
        if p is not None and (persisted is None or p > persisted):
            persisted = p
        nodes.append({"node": node, "reachable": True, "snapshot_bytes": ck.get("bytes"),
                      "replica_bytes": rep.get("replica_bytes_held"), "persisted": p,
                      "latest_local": ck.get("progress"),
                      "sync_lag": _job_replication(st, job).get("sync_lag"),
                      "unprotected": ck.get("unprotected_reason") or None})
    ranks = []
    for rank, owner, holders in _ranks(placement, committed):
        if holders is None and committed is not None:
            holders = list(committed.holders.get(rank, ()))
        # Versions with m copies: the owner says (its /status); null when it cannot be asked.
        versions = _job_replication(statuses.get(owner or ""), job).get("replicated", {}).get(
            str(rank))
        ranks.append({"rank": rank, "owner": owner, "holders": holders or [],
                      "versions": [_ver(v) for v in versions] if versions is not None else None})
    return {
        "job": job,
        "committed": None if committed is None else {
            "generation": committed.generation, "step": committed.step, "m": committed.m,
            "at": committed.at, "ranks": list(committed.ranks)},
        "coordinator": coordinator,
        "placement": placement.describe() if placement else None,
        "ranks": ranks, "persisted": persisted, "nodes": nodes,
        "unprotected": {n["node"]: n["unprotected"] for n in nodes if n.get("unprotected")},
    }


RANKS_TABLE = Table([("RANK", "rank"), ("OWNER", "owner"), ("VERSIONS WITH m COPIES", "versions"),
                     ("HOLDERS", "holders")])
NODES_TABLE = Table([("NODE", "node"), ("SNAPSHOT BYTES", "snapshot_bytes"),
                     ("REPLICA BYTES", "replica_bytes"), ("LATEST LOCAL", "latest_local"),
                     ("SYNC LAG", "sync_lag"), ("PERSISTED", "persisted")])


def _checkpoints_pretty(doc: dict[str, Any]) -> str:
    c = doc["committed"]
    when = format_local(c["at"], "%H:%M:%S") if c else ""
    head = (f"job {doc['job']}: committed generation {c['generation']} step {c['step']} "
            f"(m={c['m']}, at {when})" if c else f"job {doc['job']}: nothing committed yet")
    head += f"; persisted step {doc['persisted'] or '-'}; " + _coordinator_text(
        doc["coordinator"])
    for node, why in sorted(doc["unprotected"].items()):
        head += f"\nUNPROTECTED on {node}: {why}"
    return head + "\n\n" + RANKS_TABLE.render(doc["ranks"]) + "\n\n" + NODES_TABLE.render(
        doc["nodes"])


COMMANDS = {
    "placement": (cmd_placement, _placement_pretty),
    "checkpoints": (cmd_checkpoints, _checkpoints_pretty),
}
