"""Plans that keep ``m`` copies of a committed step: which copies to push after a membership
change or before a drain (:func:`repair_plan`), how many ranks are short of copies (``/status``,
the metric) and which replicas a node may free. Pure: records in, lists out; the
:class:`~elasticd.recovery.replicator.Replicator` runs them.
"""

from __future__ import annotations

from typing import Iterable

from elasticd.replication.commit import Committed
from elasticd.replication.placement import Placement


def repair_plan(committed: Committed, placement: Placement, me: str, *,
                leaving: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """The (rank, target) pushes *this* node must make so that every rank of the committed step
    is held by ``placement.m`` members of ``placement`` other than the ``leaving`` nodes.

    Each under-replicated rank is repaired by one node only: a leaving holder repairs what it
    holds (it is about to take its copy away); otherwise the first surviving holder in the
    record's order does. Targets are the rank's holders in the new placement (when some member
    hosts that rank), then the other members in membership order.
    """
    members = set(placement.nodes)
    plan: list[tuple[int, str]] = []
    for rank in committed.ranks:
        holders = [h for h in committed.holders.get(rank, ()) if h in members]
        kept = [h for h in holders if h not in leaving]
        need = placement.m - len(kept)
        if need <= 0 or not holders:
            continue
        leavers = [h for h in holders if h in leaving]
        repairer = leavers[0] if leavers else kept[0]
        if repairer != me:
            continue
        candidates: list[str] = []
        if any(rank in rs for rs in placement.ranks.values()):
            candidates.extend(placement.holders_of_rank(rank))
        candidates.extend(placement.nodes)
        targets = [c for c in dict.fromkeys(candidates)
                   if c not in kept and c not in leaving and c != me]
        plan.extend((rank, t) for t in targets[:need])
    return plan


def under_replicated(committed: Committed | None, placement: Placement | None) -> int:
    """Ranks of the committed step held by fewer than ``m`` current members."""
    if committed is None or placement is None:
        return 0
    members = set(placement.nodes)
    return sum(1 for r in committed.ranks
               if len([h for h in committed.holders.get(r, ()) if h in members]) < placement.m)


def unwanted_replicas(committed: Committed, placement: Placement, me: str,
                      held: Iterable[int]) -> list[int]:
    """Ranks among ``held`` (replicas this node holds) that it may free: neither the current
    placement nor the committed record asks this node to hold them. Nothing is unwanted while
    the placement's ranks are unknown. Replicas of ranks this node now owns are unwanted: its
    local store holds those."""
    if not any(placement.ranks.values()):
        return []
    wanted = {r for o in placement.held_by(me) for r in placement.ranks[o]}
    mine = set(placement.ranks.get(me, ()))
    wanted |= {r for r, hs in committed.holders.items() if me in hs and r not in mine}
    return sorted(set(held) - wanted)
