"""Where each node's checkpoint shards are held: Gemini's placement and its failure odds.

Every node of a rendezvous round owns the shards of the ranks it hosts and must have them held by
``m`` daemons: itself plus ``m - 1`` peers. :func:`compute_placement` chooses the peers the way
Gemini (Wang et al., SOSP'23, Algorithm 1) does. The nodes, in membership order, are cut into
``g = N // m`` consecutive groups of ``m``; when ``m`` does not divide ``N`` the last group also
takes the ``N mod m`` leftover nodes. A group of exactly ``m`` uses *group* placement (every member
holds every other member's shards); the one larger group uses *ring* placement (each member's
shards go to the next ``m - 1`` members around that group's ring). With ``m | N`` this is pure
group placement, which the paper proves optimal; otherwise ("mixed") it is near-optimal and
keeps every node's replication traffic at ``m - 1`` copies.

The rest of the module answers questions about a placement without touching the network:
which owners lose every copy when given nodes die (:func:`lost_shards`), how likely ``k`` random
simultaneous failures are to lose something (:func:`loss_probability`, exact), and how a
placement is stored in etcd (:func:`encode_placement`, :func:`decode_placement`, record kind
``"placement"``). Which copies a membership change requires is
:func:`elasticd.recovery.plans.repair_plan`'s question, asked of the committed record.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from fractions import Fraction
from typing import Any, Iterable, Mapping, Sequence

from elasticd.coordination import records
from elasticd.errors import InputError

log = logging.getLogger(__name__)

RECORD_KIND = "placement"
GROUP = "group"
MIXED = "mixed"
#: Largest set of nodes whose failures :func:`loss_probability` enumerates exhaustively. Our own
#: placements never link more than ``2m - 1`` nodes, so this only stops a hand-made placement
#: from running for hours.
MAX_ENUMERATED_COMPONENT = 20


class PlacementError(InputError, ValueError):
    """A membership or replication factor from which no placement can be built."""


Copy = tuple[str, str]
"""One replica: (owner node, holder node)."""


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

    def copies(self) -> frozenset[Copy]:
        """Every (owner, holder) pair with holder != owner."""
        return frozenset((o, h) for o, hs in self.holders.items() for h in hs if h != o)

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


# -- failures ---------------------------------------------------------------------------------


def lost_shards(placement: Placement, dead_nodes: Iterable[str]) -> set[str]:
    """The owners whose every copy sits on a dead node (restore needs the persistent tier).

    Nodes in ``dead_nodes`` that are not part of the placement are ignored.
    """
    dead = set(dead_nodes)
    return {o for o, hs in placement.holders.items() if all(h in dead for h in hs)}


def lost_ranks(placement: Placement, dead_nodes: Iterable[str]) -> set[int]:
    """The ranks whose shard has no surviving copy."""
    return {r for o in lost_shards(placement, dead_nodes) for r in placement.ranks[o]}


def loss_probability(placement: Placement, k: int) -> Fraction:
    """Exact probability that ``k`` distinct nodes, chosen uniformly at random, dying at once
    leave some owner with no copy.

    Owners only lose copies within their own connected part of the holder graph (a group, or the
    ring), so each part's failure patterns are enumerated alone and combined by counting: exact,
    and fast for any number of nodes.

    Raises:
        ValueError: ``k`` outside ``0..N``.
        PlacementError: a connected part larger than :data:`MAX_ENUMERATED_COMPONENT` nodes.
    """
    n = len(placement.nodes)
    if not 0 <= k <= n:
        raise ValueError(f"k must be between 0 and the {n} nodes, got {k}")
    # safe[t] = number of t-node failure sets that lose nothing, built up part by part.
    safe = [1]
    for part in _components(placement):
        safe = _convolve(safe, _safe_counts(placement, part))
    survivable = safe[k] if k < len(safe) else 0
    return 1 - Fraction(survivable, math.comb(n, k))


def group_loss_probability(n: int, m: int, k: int) -> Fraction:
    """Closed form of :func:`loss_probability` for group placement (``m`` divides ``n``).

    Some shard is lost exactly when some group of ``m`` dies whole; inclusion–exclusion over the
    ``n / m`` groups gives ``sum_j (-1)^(j+1) C(n/m, j) C(n - jm, k - jm) / C(n, k)``. (The
    paper's Corollary 1 states the first term of this sum as a bound.)

    Raises:
        ValueError: ``m`` does not divide ``n``, or ``k`` outside ``0..n``.
    """
    if m < 1 or n < 1 or n % m:
        raise ValueError(f"group placement needs m to divide n, got n={n}, m={m}")
    if not 0 <= k <= n:
        raise ValueError(f"k must be between 0 and {n}, got {k}")
    g = n // m
    total = sum(
        (-1) ** (j + 1) * math.comb(g, j) * math.comb(n - j * m, k - j * m)
        for j in range(1, min(g, k // m) + 1)
    )
    return Fraction(total, math.comb(n, k))


def _components(placement: Placement) -> list[list[str]]:
    parent = {n: n for n in placement.nodes}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for owner, hs in placement.holders.items():
        for h in hs:
            parent[find(h)] = find(owner)
    parts: dict[str, list[str]] = {}
    for node in placement.nodes:
        parts.setdefault(find(node), []).append(node)
    return list(parts.values())


def _safe_counts(placement: Placement, part: list[str]) -> list[int]:
    if len(part) > MAX_ENUMERATED_COMPONENT:
        raise PlacementError(
            f"{len(part)} nodes share replicas; loss_probability enumerates at most "
            f"{MAX_ENUMERATED_COMPONENT}"
        )
    bit = {node: 1 << i for i, node in enumerate(part)}
    masks = [sum(bit[h] for h in placement.holders[o]) for o in part]
    counts = [0] * (len(part) + 1)
    for dead in range(1 << len(part)):
        if not any(dead & mask == mask for mask in masks):
            counts[dead.bit_count()] += 1
    return counts


def _convolve(a: list[int], b: list[int]) -> list[int]:
    out = [0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b):
                out[i + j] += x * y
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
