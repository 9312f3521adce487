"""The rendezvous' records in etcd: JSON with a schema version, never a pickle.

Per run, under ``<prefix>/jobs/<run_id>/rdzv/native/`` (rendezvous protocol 2)::

    nodes/<node>     a node's join record, bound to its agent's lease; only the closer watches
    round            the last closed round: number, members in rank order, the workers' address
    round.closer     the closer's election key (value: its node id), bound to its lease
    round.waiting    the closer's summary of who waits, for ``num_nodes_waiting``
    round.closed     present once the rendezvous is closed

Every agent watches the ``round`` prefix (the last four keys: a few events per round); the
closer alone watches ``nodes/``. Protocol 1 (elasticd 0.1.0 up to this change) had every agent
watch ``nodes/`` too, and its records carry ``"v": 1``: each side refuses the other's records
with a one-line message that names the upgrade (:data:`UPGRADE`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from urllib.parse import quote, unquote

# One RecordError for every stored record (a stored record is hostile input).
from elasticd.coordination.records import RecordError

#: Schema version of every rendezvous record, which is also the protocol version.
SCHEMA = 2
#: What to do when a record of another protocol turns up (quoted in every refusal).
UPGRADE = ("run the same elasticd release on every node of the job: stop the job, upgrade "
           "every node, start it again (docs/operations.md, section 8)")


def node_id(addr: str, pid: int, local_id: int) -> str:
    """A node's id: its address, agent pid and handler count, percent-quoted into one key
    element (an IPv6 address or an odd host name stays one element)."""
    return quote(f"{addr}_{pid}_{local_id}", safe="")


def agent_pid(member: str) -> int | None:
    """The agent pid in a node id made by :func:`node_id` (None when ``member`` is not one)."""
    parts = unquote(member).rsplit("_", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    """One node's join record (value of ``native/nodes/<node>``).

    Attributes:
        node: the node id (also the key's last element).
        target: the round this node waits to join.
        addr: the node's address, for logs and the workers' ``MASTER_ADDR`` when rank 0.
        port: a port this node holds free for its workers' store, should it be rank 0.
        revision: the etcd revision that created the key (arrival order); 0 when not stored.
        daemon, daemon_lease: the elasticd node whose daemon runs this agent, and that
            daemon's lease when the record was written ("", 0: no daemon, plain torchrun).
            When the daemons record that lease ``failed``, the member is dead at once
            (:mod:`.failures`); absent from the JSON when unset.
        written: the etcd revision that last wrote the key (0: not stored); not in the JSON.
            A failure mark drops the records written before it.
    """

    node: str
    target: int
    addr: str = ""
    port: int = 0
    revision: int = 0
    daemon: str = ""
    daemon_lease: int = 0
    written: int = 0

    def encode(self) -> bytes:
        data = {"v": SCHEMA, "node": self.node, "target": self.target,
                "addr": self.addr, "port": self.port}
        if self.daemon:
            data.update(daemon=self.daemon, daemon_lease=self.daemon_lease)
        return _dump(data)

    @classmethod
    def decode(cls, raw: bytes, revision: int = 0, written: int = 0) -> "NodeRecord":
        """``revision`` and ``written``: the key's create and mod revisions."""
        data = _load(raw, "node record")
        try:
            return cls(node=str(data["node"]), target=int(data["target"]),
                       addr=str(data.get("addr", "")), port=int(data.get("port", 0)),
                       revision=revision, daemon=str(data.get("daemon", "")),
                       daemon_lease=int(data.get("daemon_lease", 0)), written=written)
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"node record {raw[:80]!r} lacks node/target: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class RoundRecord:
    """The last closed round (value of ``native/round``).

    Attributes:
        round: its number (0 for a job's first round).
        members: node ids in rank order.
        closed_by: the node that closed it (for logs).
        grew_at: wall-clock time the last round that grew the job closed (this one, or the
            job's first round, or a later one with more members than the round before it), by
            its closer's clock. The ``interval:MIN`` grow policy counts from it.
        master_addr, master_port: where rank 0's workers host their store (rank 0's address
            and the port it held free), so no agent asks the store for it.
    """

    round: int
    members: tuple[str, ...]
    closed_by: str = ""
    grew_at: float = 0.0
    master_addr: str = ""
    master_port: int = 0

    def encode(self) -> bytes:
        return _dump({"v": SCHEMA, "round": self.round, "members": list(self.members),
                      "closed_by": self.closed_by, "grew_at": self.grew_at,
                      "master_addr": self.master_addr, "master_port": self.master_port})

    @classmethod
    def decode(cls, raw: bytes) -> "RoundRecord":
        data = _load(raw, "round record")
        try:
            # map, not a generator: ~1,000 members are read by every agent at each close
            members = tuple(map(str, data["members"]))
            grew_at = float(data.get("grew_at", 0.0))
            if not math.isfinite(grew_at):
                raise ValueError(f"grew_at {grew_at!r} is not finite")
            return cls(round=int(data["round"]), members=members,
                       closed_by=str(data.get("closed_by", "")), grew_at=grew_at,
                       master_addr=str(data.get("master_addr", "")),
                       master_port=int(data.get("master_port", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"round record {raw[:80]!r} lacks round/members: {exc}") from exc

    def rank_of(self, node: str) -> int | None:
        try:
            return self.members.index(node)
        except ValueError:
            return None


@dataclasses.dataclass(frozen=True)
class Waiting:
    """The closer's summary of who waits (value of ``native/round.waiting``).

    Attributes:
        round: the round it describes (-1: before the job's first round).
        rejoining: live members asking for a later round.
        outsiders: live nodes that are not members (newcomers and spares).
        dead: members the closer counts as dead (:mod:`.rounds`' Dead rule).
    """

    round: int
    rejoining: int = 0
    outsiders: int = 0
    dead: tuple[str, ...] = ()

    def encode(self) -> bytes:
        return _dump({"v": SCHEMA, "round": self.round, "rejoining": self.rejoining,
                      "outsiders": self.outsiders, "dead": list(self.dead)})

    @classmethod
    def decode(cls, raw: bytes) -> "Waiting":
        data = _load(raw, "waiting summary")
        try:
            return cls(round=int(data["round"]), rejoining=max(0, int(data["rejoining"])),
                       outsiders=max(0, int(data["outsiders"])),
                       dead=tuple(str(m) for m in data.get("dead", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"waiting summary {raw[:80]!r} is incomplete: {exc}") from exc


def _dump(data: dict) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _load(raw: bytes, what: str) -> dict:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{what} {raw[:80]!r} is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise RecordError(f"{what} {raw[:80]!r} is not a JSON object")
    if data.get("v") != SCHEMA:
        raise RecordError(f"{what} speaks rendezvous protocol {data.get('v')!r}, this elasticd "
                          f"speaks {SCHEMA}: {UPGRADE}")
    return data
