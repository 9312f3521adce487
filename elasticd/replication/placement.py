"""Where each node's checkpoint shards are held: Gemini's placement.

Every node of a rendezvous round owns the shards of the ranks it hosts and must have them held by
``m`` daemons: itself plus ``m - 1`` peers. :func:`compute_placement` chooses the peers the way
Gemini (Wang et al., SOSP'23, Algorithm 1) does. The nodes, in membership order, are cut into
``g = N // m`` consecutive groups of ``m``; when ``m`` does not divide ``N`` the last group also
takes the ``N mod m`` leftover nodes. A group of exactly ``m`` uses *group* placement (every member
holds every other member's shards); the one larger group uses *ring* placement (each member's
shards go to the next ``m - 1`` members around that group's ring). With ``m | N`` this is pure
group placement, which the paper proves optimal; otherwise ("mixed") it is near-optimal and
keeps every node's replication traffic at ``m - 1`` copies.

A placement is stored in etcd by :func:`encode_placement` and :func:`decode_placement` (record
kind ``"placement"``). Which copies a membership change requires is
:func:`elasticd.recovery.plans.repair_plan`'s question, asked of the committed record.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Mapping, Sequence

from elasticd.coordination import records
from elasticd.errors import InputError

log = logging.getLogger(__name__)

RECORD_KIND = "placement"
GROUP = "group"
MIXED = "mixed"


class PlacementError(InputError, ValueError):
    """A membership or replication factor from which no placement can be built."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Who holds whose shards in one rendezvous round.

    Attributes:
        nodes: node ids in membership order (the order placement was computed from).
        ranks: ranks hosted by each node (empty tuples when not known).
        m: replication factor in effect (``requested_m`` clamped to the number of nodes).
        requested_m: replication factor asked for.
        strategy: ``"group"`` (m divides N) or ``"mixed"`` (groups plus one ring).
        groups: the groups, in order; only the last one can be larger than ``m`` (the ring).
        holders: for each owner, its ``m`` distinct holders, the owner first.
        round: the rendezvous round this placement belongs to (0 when unknown).
    """

    nodes: tuple[str, ...]
    ranks: Mapping[str, tuple[int, ...]]
    m: int
    requested_m: int
    strategy: str
    groups: tuple[tuple[str, ...], ...]
    holders: Mapping[str, tuple[str, ...]]
    round: int = 0

    @property
    def clamped(self) -> bool:
        """True when fewer nodes than the requested replication factor were available."""
        return self.m < self.requested_m

    def owner_of(self, rank: int) -> str:
        """The node hosting ``rank``.

        Raises:
            KeyError: no node hosts that rank.
        """
        for node in self.nodes:
            if rank in self.ranks[node]:
                return node
        raise KeyError(f"rank {rank} is hosted by no node of this placement")

    def holders_of_rank(self, rank: int) -> tuple[str, ...]:
        """The nodes that hold ``rank``'s shard, its owner first."""
        return self.holders[self.owner_of(rank)]

    def peers_of(self, owner: str) -> tuple[str, ...]:
        """The nodes ``owner`` pushes its snapshots to (its holders except itself)."""
        return self.holders[owner][1:]

    def held_by(self, node: str) -> tuple[str, ...]:
        """The owners, other than ``node`` itself, whose shards ``node`` holds."""
        return tuple(o for o in self.nodes if o != node and node in self.holders[o])

    def describe(self) -> str:
        """One sentence for logs and ``elasticctl placement``."""
        shape = " ".join("[" + ",".join(g) + "]" for g in self.groups)
        clamp = f" (m={self.requested_m} clamped to {self.m})" if self.clamped else ""
        return f"{self.strategy} placement of {len(self.nodes)} nodes, m={self.m}{clamp}: {shape}"


def compute_placement(
    nodes: Sequence[str],
    ranks: Mapping[str, Iterable[int]] | None = None,
    m: int = 2,
    round: int = 0,
) -> Placement:
    """Builds Gemini's placement for an ordered membership.

    Pure and deterministic: the same arguments always give the same placement, so every daemon
    computes it alone and etcd only records it.

    Args:
        nodes: node ids in the rendezvous round's order.
        ranks: ranks hosted by each node; nodes missing from it host none recorded.
        m: replication factor, counting the owner's own copy. More than ``len(nodes)`` is
            clamped (logged, and visible as :attr:`Placement.clamped`).
        round: rendezvous round, stored alongside.

    Raises:
        PlacementError: no nodes, duplicate nodes, ``m < 1``, or a rank hosted twice.
    """
    order = tuple(nodes)
    if not order:
        raise PlacementError("cannot place replicas on an empty membership")
    if len(set(order)) != len(order):
        dupes = sorted({n for n in order if order.count(n) > 1})
        raise PlacementError(f"membership lists nodes more than once: {dupes}")
    if any(not isinstance(n, str) or not n for n in order):
        raise PlacementError(f"node ids must be non-empty strings, got {list(order)!r}")
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise PlacementError(f"replication factor must be an integer >= 1, got {m!r}")
    node_ranks = _normalise_ranks(order, ranks or {})

    n = len(order)
    effective = min(m, n)
    if effective < m:
        log.warning("replication factor %d > %d nodes: clamped to %d", m, n, effective)
    g = n // effective
    groups = [order[i * effective : (i + 1) * effective] for i in range(g - 1)]
    groups.append(order[(g - 1) * effective :])  # the last group absorbs the N mod m leftovers
    holders: dict[str, tuple[str, ...]] = {}
    for group in groups:
        # Within a group of exactly m this is group placement; within the larger last group it
        # is Gemini's ring: the owner and the next m-1 members, wrapping around.
        size = len(group)
        for j, owner in enumerate(group):
            holders[owner] = tuple(group[(j + i) % size] for i in range(effective))
    return Placement(
        nodes=order,
        ranks=node_ranks,
        m=effective,
        requested_m=m,
        strategy=GROUP if n % effective == 0 else MIXED,
        groups=tuple(groups),
        holders={o: holders[o] for o in order},
        round=round,
    )


def _normalise_ranks(
    order: tuple[str, ...], ranks: Mapping[str, Iterable[int]]
) -> dict[str, tuple[int, ...]]:
    unknown = sorted(set(ranks) - set(order))
    if unknown:
        raise PlacementError(f"ranks given for nodes outside the membership: {unknown}")
    out: dict[str, tuple[int, ...]] = {}
    seen: dict[int, str] = {}
    for node in order:
        rs = tuple(sorted(ranks.get(node, ())))
        for r in rs:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise PlacementError(f"node {node!r}: ranks must be integers >= 0, got {r!r}")
            if r in seen:
                raise PlacementError(f"rank {r} is hosted by both {seen[r]!r} and {node!r}")
            seen[r] = node
        out[node] = rs
    return out


# -- etcd record ------------------------------------------------------------------------------


def encode_placement(placement: Placement) -> bytes:
    """The versioned JSON record stored at ``<prefix>/jobs/<job>/placement``."""
    return records.encode(
        RECORD_KIND,
        {
            "nodes": list(placement.nodes),
            "ranks": {n: list(placement.ranks[n]) for n in placement.nodes},
            "m": placement.m,
            "requested_m": placement.requested_m,
            "strategy": placement.strategy,
            "groups": [list(g) for g in placement.groups],
            "holders": {o: list(placement.holders[o]) for o in placement.nodes},
            "round": placement.round,
        },
    )


def decode_placement(raw: bytes, key: bytes | str = b"?") -> Placement:
    """Reads a record written by :func:`encode_placement`, checking that it is self-consistent.

    Raises:
        records.CorruptRecord: malformed, or holders that do not form a valid placement.
        records.UnsupportedRecordVersion: written by a newer elasticd.
    """
    body = records.decode(raw, RECORD_KIND, key)
    try:
        return _placement_from(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise records.CorruptRecord(f"{records.where_of(key)}: invalid placement record "
                                    f"({exc})") from exc


def _placement_from(body: dict[str, Any]) -> Placement:
    nodes = tuple(_list_of(body["nodes"], str, "strings"))
    m, requested_m, rnd = body["m"], body["requested_m"], body.get("round", 0)
    for name, value in (("m", m), ("requested_m", requested_m), ("round", rnd)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if body["strategy"] not in (GROUP, MIXED):
        raise ValueError(f"unknown strategy {body['strategy']!r}")
    if not isinstance(body["ranks"], dict) or not isinstance(body["holders"], dict):
        raise TypeError("ranks and holders must be objects")
    ranks = _normalise_ranks(
        nodes, {n: _list_of(rs, int, "integers") for n, rs in body["ranks"].items()})
    holders = {o: tuple(_list_of(hs, str, "strings")) for o, hs in body["holders"].items()}
    if set(holders) != set(nodes) or len(set(nodes)) != len(nodes) or not 1 <= m <= len(nodes):
        raise ValueError("holders must list every node once, with 1 <= m <= N")
    for owner, hs in holders.items():
        if len(hs) != m or hs[0] != owner or len(set(hs)) != m or not set(hs) <= set(nodes):
            raise ValueError(f"owner {owner!r} needs {m} distinct member holders, itself first")
    if not isinstance(body["groups"], list):
        raise TypeError(f"groups must be a list, got {body['groups']!r:.40}")
    groups = tuple(tuple(_list_of(g, str, "strings")) for g in body["groups"])
    return Placement(nodes, ranks, m, requested_m, body["strategy"], groups,
                     {o: holders[o] for o in nodes}, rnd)


def _list_of(value: Any, kind: type, what: str) -> list[Any]:
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise TypeError(f"expected a list of {what}, got {value!r}")
    return value
