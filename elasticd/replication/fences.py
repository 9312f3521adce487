"""Withdrawals: a node takes an acknowledged version back, behind a fence no commit passes.

A rank's two slots cannot hold the committed step, an acknowledged newer one and the next
snapshot, so an owner whose acknowledged version waits too long for its commit (or can never
commit) withdraws it before it reuses the slot (:mod:`elasticd.replication.tracker`). The
withdrawal is one transaction that rewrites the node's fence record (``ckpt/fence/<node>``: the
versions it withdrew, newest first) and bumps the job's fence epoch (``ckpt/fence.epoch``),
which every commit compares as its coordinator listed it with the fences (:func:`read_fences`;
why no commit then passes the fence: :mod:`elasticd.replication.tally`). Fences are rare (the
snapshot grid keeps nodes on the same steps) and are not counted among the per-step writes.

The fence record also tells a holder of two undecided copies of a rank which one the owner
withdrew (:func:`read_fence`; the sink lets go of no other).
"""

from __future__ import annotations

from typing import Iterable

from elasticd.coordination import records
from elasticd.coordination.api import Coordinator, Put
from elasticd.coordination.keys import Keyspace, check_name
from elasticd.replication.api import Version
from elasticd.replication.commit import KEEP_WITHDRAWN, Committed, complaints, read_committed
from elasticd.replication.placement import Placement
from elasticd.replication.report import version_list

FENCE_KIND = "ckpt_fence"
EPOCH_KIND = "ckpt_fence_epoch"


def encode_fence(node: str, withdrawn: Iterable[Version], now: float = 0.0) -> bytes:
    versions = sorted({tuple(v) for v in withdrawn}, reverse=True)[:KEEP_WITHDRAWN]
    return records.encode(FENCE_KIND, {"node": node, "withdrawn": [list(v) for v in versions],
                                       "at": now})


def decode_fence(raw: bytes, key: bytes | str = b"?") -> tuple[str, tuple[Version, ...]]:
    """(node, withdrawn versions). Raises: records.CorruptRecord."""
    body = records.decode(raw, FENCE_KIND, key)
    try:
        node = body["node"]
        if not isinstance(node, str):
            raise ValueError("node is no string")
        records.finite(body.get("at", 0.0), "at")
        return node, version_list(body.get("withdrawn", []), KEEP_WITHDRAWN, "withdrawn")
    except (KeyError, TypeError, ValueError) as exc:
        raise records.CorruptRecord(f"{key!r}: invalid fence record ({exc})") from exc


def withdraw(coord: Coordinator, keys: Keyspace, job: str, node: str,
             withdrawn: Iterable[Version], now: float = 0.0,
             placements: Iterable[Placement | None] = ()) -> tuple[int, Committed | None]:
    """Rewrites ``node``'s fence record (``withdrawn``: every version it withdrew that it
    still lists, newest first) and bumps the fence epoch, in one transaction; then reads the
    committed record in force.

    Returns:
        (the fence's new mod_revision: what the node's later reports carry, the committed
        record). A withdrawn version may have been committed just before: the caller compares
        and keeps its copy if so.

    Raises:
        coordination errors: whether the withdrawal landed is unknown (the copy must stay).
    """
    k = keys.replication(job)
    _, revision = coord.transaction([], [
        Put(k.fence(node), encode_fence(node, withdrawn, now)),
        Put(k.fence_epoch, records.encode(EPOCH_KIND, {"node": node, "at": now}))])
    return revision, read_committed(coord, keys, job, placements)


def read_fences(coord: Coordinator, keys: Keyspace, job: str) -> tuple[int, dict[str, int]]:
    """The fence epoch's mod_revision (0: absent) and each fenced node's fence mod_revision,
    read at one revision (one range read over both: the coordinator's only read that grows
    with the job, made when it is elected and after a withdrawal, never per step)."""
    kvs, _ = coord.get_prefix(keys.replication(job).fences)
    epoch, fences = 0, {}
    prefix = keys.replication(job).fence_prefix
    for kv in kvs:
        if kv.key == keys.replication(job).fence_epoch:
            epoch = kv.mod_revision
        elif kv.key.startswith(prefix):
            try:
                fences[check_name("node", kv.key[len(prefix):].decode(errors="replace"))] = \
                    kv.mod_revision
            except ValueError:
                continue  # no node writes there: not a fence anyone's report can name
    return epoch, fences


def read_fence(coord: Coordinator, keys: Keyspace, job: str,
               node: str) -> tuple[int, tuple[Version, ...]]:
    """``node``'s fence revision (0: never withdrew) and the versions it lists as withdrawn
    (an unreadable record lists none, which is logged)."""
    kv = coord.get(keys.replication(job).fence(node))
    if kv is None:
        return 0, ()
    try:
        named, withdrawn = decode_fence(kv.value, kv.key)
    except records.RecordError as exc:
        complaints.warn(kv.key, kv.value, "ignoring the fence record of %s: %s", job, exc)
        return kv.mod_revision, ()
    if named != node:  # one node's record may not speak for another
        complaints.warn(kv.key, kv.value, "ignoring %s's fence naming %.70r", node, named)
        return kv.mod_revision, ()
    return kv.mod_revision, withdrawn
