"""Getting shards back: fetching from whichever holder has an intact copy, and planning the
pushes that restore ``m`` copies after a membership change or before a drain.

:func:`fetch_shard` tries a shard's holders in order and checks every copy end to end (snapshot
header plus every payload block's xxh3) before returning it: a copy that is missing, corrupt in
the holder's memory or unreachable sends it to the next holder, and when none is left it raises
:class:`ShardLost`, which tells the caller to use the persistent tier. :func:`repair_plan` is
pure: from the committed record and the placement it says which (rank, target) copies this node
must push. Daemon side: no torch.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterable, Sequence

from elasticd.checkpoint.format import SnapshotError
from elasticd.checkpoint.reader import parse_header, verify_payload
from elasticd.checkpoint.shm import SlotStore
from elasticd.clock import Clock
from elasticd.replication.api import (
    NOT_FOUND,
    ConnectionLost,
    Descriptor,
    Refused,
    RemoteError,
    ReplicationError,
    Version,
)
from elasticd.replication.commit import Committed
from elasticd.replication.lanes import Connections, NoAddress
from elasticd.replication.placement import Placement
from elasticd.replication.shm_sink import descriptor_of, pinned_view

log = logging.getLogger(__name__)

#: Reads a shard from this node's own memory into ``into``; returns its descriptor or None.
LocalRead = Callable[[str, int, "Version | None", Any], "Descriptor | None"]


class ShardLost(ReplicationError):
    """No holder could provide an intact copy: restore this shard from the persistent tier.

    Attributes:
        attempts: (holder, reason) for every holder tried, in order.
    """

    def __init__(self, job: str, rank: int, version: Version | None,
                 attempts: Sequence[tuple[str, str]]) -> None:
        tried = "; ".join(f"{h}: {r}" for h, r in attempts) or "no holder known"
        super().__init__(f"{job} rank {rank} {version or 'newest'}: no intact copy ({tried})")
        self.job, self.rank, self.version, self.attempts = job, rank, version, list(attempts)


@dataclasses.dataclass(frozen=True)
class FetchResult:
    """A shard now in the caller's buffer.

    Attributes:
        holder: the node whose copy was used (this node for its own memory).
        descriptor: sizes and version; the bytes are ``into[:descriptor.total_bytes]``.
        wire_bytes: bytes received over the replication transport (0 from this node's memory).
        seconds: time spent, failed attempts included.
        attempts: (holder, reason) of each holder that failed before.
    """

    holder: str
    descriptor: Descriptor
    wire_bytes: int
    seconds: float
    attempts: tuple[tuple[str, str], ...] = ()


def holder_order(job: str, rank: int, version: Version | None, me: str,
                 committed: Committed | None,
                 placements: Iterable[Placement | None]) -> list[str]:
    """Holders to try, in order: this node first (no network), then the committed record's
    holders of the rank (when it records ``version``), then each placement's holders."""
    order: list[str] = []
    if committed is not None and (version is None or committed.version == tuple(version)):
        order.extend(committed.holders.get(rank, ()))
    for p in placements:
        if p is not None and any(rank in rs for rs in p.ranks.values()):
            order.extend(p.holders_of_rank(rank))
    unique = list(dict.fromkeys(order))
    return [me] + [h for h in unique if h != me]


def verify_copy(buf: Any, d: Descriptor, where: str) -> None:
    """Checks a copy end to end. Raises: SnapshotError."""
    view = memoryview(buf).cast("B")[: d.total_bytes]
    header = parse_header(view, job=d.job, rank=d.owner_rank, where=where)
    if header.version() != d.version or header.layout.total_size != d.total_bytes:
        raise SnapshotError(f"{where}: holds {header.version()} of "
                            f"{header.layout.total_size} bytes, announced {d.version} of "
                            f"{d.total_bytes}")
    verify_payload(view, header)


def fetch_shard(job: str, rank: int, version: Version | None, into: Any, *, me: str,
                holders: Sequence[str], connections: Connections, local: LocalRead,
                clock: Clock) -> FetchResult:
    """Fetches and verifies one shard from the first holder that has an intact copy.

    Args:
        into: a writable buffer, or a function given the descriptor that returns one.
        holders: in the order to try (see :func:`holder_order`); ``me`` reads ``local``.

    Raises:
        ShardLost: every holder failed; ``attempts`` says why each one did.
    """
    started = clock.monotonic()
    attempts: list[tuple[str, str]] = []
    chosen: list[Any] = []

    def sized(d: Descriptor) -> Any:
        # ``into`` may allocate: call it once per attempt and remember what it gave.
        buf = into(d) if callable(into) else into
        chosen.append(buf)
        return buf

    for holder in holders:
        wire = 0
        try:
            if holder == me:
                d = local(job, rank, version, sized)
                if d is None:
                    continue  # not an attempt: this node simply is not a holder
            else:
                client, _ = connections.get(holder)
                before = client.channel.bytes_received
                try:
                    d = client.fetch(job, rank, sized, version)
                finally:
                    wire = client.channel.bytes_received - before
            verify_copy(chosen[-1], d, f"copy of {job} rank {rank} from {holder}")
        except Refused as exc:
            reason = "missing" if exc.reason == NOT_FOUND else exc.reason
            attempts.append((holder, reason))
            continue
        except SnapshotError as exc:
            log.error("REFUSED the copy of %s rank %d held by %s: %s", job, rank, holder, exc)
            attempts.append((holder, f"corrupt: {exc}"))
            continue
        except NoAddress:
            attempts.append((holder, "no address"))
            continue
        except (ConnectionLost, RemoteError, ReplicationError, OSError) as exc:
            connections.discard(holder)
            attempts.append((holder, f"unreachable: {exc}"))
            continue
        except BaseException:
            # ``into`` failed (e.g. no room): the connection is unusable mid-stream.
            if holder != me:
                connections.discard(holder)
            raise
        if attempts:
            log.warning("%s rank %d %s fetched from %s after: %s", job, rank, d.version,
                        holder, "; ".join(f"{h}: {r}" for h, r in attempts))
        return FetchResult(holder, d, wire, clock.monotonic() - started, tuple(attempts))
    raise ShardLost(job, rank, version, attempts)


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


def copy_own(stores: Sequence[SlotStore], job: str, rank: int, version: Version | None,
             sized: Callable[[Descriptor], Any]) -> Descriptor | None:
    """Copies a shard this node holds (in the first of ``stores`` that has it) into the buffer
    ``sized`` returns; None when no store has it. A :data:`LocalRead` for :func:`fetch_shard`."""
    for store in stores:
        view = pinned_view(store, job, rank, version)
        if view is None:
            continue
        try:
            d = descriptor_of(view)
            memoryview(sized(d)).cast("B")[: d.total_bytes] = view.buffer
            return d
        finally:
            view.release()
    return None


def fetch_into_store(fetch: Callable[..., FetchResult], store: SlotStore, job: str, rank: int,
                     version: Version | None) -> FetchResult:
    """Runs ``fetch`` (:meth:`Replicator.fetch`) into a slot reserved in ``store`` and completes
    it, so the shard becomes that store's latest snapshot of (job, rank).

    Raises:
        ShardLost: from ``fetch``. OverBudget, SlotBusy: the store has no room.
    """
    slots: list[Any] = []

    def into(d: Descriptor) -> memoryview:
        slots.append(store.reserve(job, rank, d.total_bytes))
        return slots[-1].buffer

    result = fetch(job, rank, version, into)
    slot = slots[-1]
    header = parse_header(slot.buffer, job=job, rank=rank, where=f"{job} rank {rank} fetched")
    store.complete(slot, header)  # verified once more as it becomes a local snapshot
    return result
