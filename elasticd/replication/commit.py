"""When a step is committed, and the records the replication layer keeps in etcd.

Each daemon records, for the ranks it owns, which snapshot versions reached ``m`` verified
copies (its own plus an acknowledgement from each of its ``m - 1`` placement peers), in one
record per node. A version is *committed* when every rank of the job has it: :func:`decide`
computes that from the records alone (a pure function), and :func:`record_commit` writes it with
a compare-and-set transaction that never moves the committed (generation, step) backwards, so
any number of daemons may race to record the same or different commits. Keys, under
``Keyspace.job_ckpt(job)``::

    replicated/<node>   record "ckpt_replicated": {node, round, ranks: {"<rank>":
                        {"versions": [[generation, step], ...] newest first (at most
                        KEEP_VERSIONS), "holders": [node, ...]}}, at}
    committed           record "ckpt_committed": {generation, step, ranks: [rank, ...],
                        holders: {"<rank>": [node, ...]}, m, round, at}

Both are overwritten in place, so etcd's footprint does not grow with the run's length. The
placement (``Keyspace.job_placement(job)``, record "placement") is published here too
(:func:`publish_placement`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Mapping

from elasticd.coordination import records
from elasticd.coordination.api import Compare, Coordinator, Put
from elasticd.coordination.keys import Keyspace
from elasticd.replication.api import ReplicationError, Version
from elasticd.replication.placement import Placement, decode_placement, encode_placement

log = logging.getLogger(__name__)

COMMITTED_KIND = "ckpt_committed"
REPLICATED_KIND = "ckpt_replicated"
#: Versions each node lists per rank: enough to find a common one among nodes a few steps apart.
KEEP_VERSIONS = 4


class CommitConflict(ReplicationError):
    """The committed record kept changing under a compare-and-set (too many racing writers)."""


def committed_key(keys: Keyspace, job: str) -> bytes:
    return keys.job_ckpt(job) + b"committed"


def replicated_prefix(keys: Keyspace, job: str) -> bytes:
    return keys.job_ckpt(job) + b"replicated/"


def replicated_key(keys: Keyspace, job: str, node: str) -> bytes:
    return replicated_prefix(keys, job) + node.encode()


@dataclasses.dataclass(frozen=True)
class Committed:
    """A committed step: every rank's shard of (generation, step) had ``m`` verified copies.

    Attributes:
        holders: for each rank, the nodes holding a copy, the owner first.
        at: wall-clock time of the commit (of the last holder change after a re-replication).
    """

    generation: int
    step: int
    ranks: tuple[int, ...]
    holders: Mapping[int, tuple[str, ...]]
    m: int = 2
    round: int = 0
    at: float = 0.0

    @property
    def version(self) -> Version:
        return (self.generation, self.step)


@dataclasses.dataclass(frozen=True)
class Replicated:
    """One node's record: per owned rank, versions with ``m`` copies (newest first), holders."""

    node: str
    round: int
    versions: Mapping[int, tuple[Version, ...]]
    holders: Mapping[int, tuple[str, ...]]
    at: float = 0.0


def encode_committed(c: Committed) -> bytes:
    return records.encode(COMMITTED_KIND, {
        "generation": c.generation, "step": c.step, "ranks": list(c.ranks),
        "holders": {str(r): list(c.holders[r]) for r in c.ranks if r in c.holders},
        "m": c.m, "round": c.round, "at": c.at})


def decode_committed(raw: bytes, key: bytes | str = b"?") -> Committed:
    """Raises: records.CorruptRecord, records.UnsupportedRecordVersion."""
    body = records.decode(raw, COMMITTED_KIND, key)
    try:
        ranks = tuple(_int(r) for r in body["ranks"])
        holders = {int(r): tuple(_str(n) for n in hs) for r, hs in body["holders"].items()}
        return Committed(_int(body["generation"]), _int(body["step"]), ranks, holders,
                         _int(body.get("m", 2)), _int(body.get("round", 0)),
                         float(body.get("at", 0.0)))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise records.CorruptRecord(f"{key!r}: invalid committed record ({exc})") from exc


def encode_replicated(r: Replicated) -> bytes:
    return records.encode(REPLICATED_KIND, {
        "node": r.node, "round": r.round, "at": r.at,
        "ranks": {str(k): {"versions": [list(v) for v in r.versions[k][:KEEP_VERSIONS]],
                           "holders": list(r.holders.get(k, ()))} for k in sorted(r.versions)}})


def decode_replicated(raw: bytes, key: bytes | str = b"?") -> Replicated:
    """Raises: records.CorruptRecord, records.UnsupportedRecordVersion."""
    body = records.decode(raw, REPLICATED_KIND, key)
    try:
        versions, holders = {}, {}
        for rank, entry in body["ranks"].items():
            versions[int(rank)] = tuple((_int(g), _int(s)) for g, s in entry["versions"])
            holders[int(rank)] = tuple(_str(n) for n in entry.get("holders", ()))
        return Replicated(_str(body["node"]), _int(body.get("round", 0)), versions, holders,
                          float(body.get("at", 0.0)))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise records.CorruptRecord(f"{key!r}: invalid replicated record ({exc})") from exc


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"expected an integer >= 0, got {value!r:.40}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r:.40}")
    return value


def decide(placement: Placement, progress: Mapping[str, Replicated], *, floor: int = 0,
           now: float = 0.0) -> Committed | None:
    """The newest version every rank of ``placement`` has with ``m`` copies, or None.

    Each rank's versions are taken from its owner's record (a node's record about ranks it no
    longer owns is ignored); versions of a generation below ``floor`` never count.
    """
    ranks = sorted(r for rs in placement.ranks.values() for r in rs)
    if not ranks:
        return None
    common: set[Version] | None = None
    holders: dict[int, tuple[str, ...]] = {}
    for rank in ranks:
        owner = placement.owner_of(rank)
        record = progress.get(owner)
        have = set(record.versions.get(rank, ())) if record else set()
        have = {v for v in have if v[0] >= floor}
        common = have if common is None else common & have
        if not common:
            return None
        holders[rank] = record.holders.get(rank, ()) if record else ()
    best = max(common)  # type: ignore[type-var]
    return Committed(best[0], best[1], tuple(ranks), holders, placement.m, placement.round, now)


def read_committed(coord: Coordinator, keys: Keyspace, job: str) -> Committed | None:
    """The job's committed record, or None (absent or unreadable, which is logged)."""
    kv = coord.get(committed_key(keys, job))
    if kv is None:
        return None
    try:
        return decode_committed(kv.value, kv.key)
    except records.RecordError as exc:
        log.error("ignoring the committed record of %s: %s", job, exc)
        return None


def read_progress(coord: Coordinator, keys: Keyspace, job: str) -> dict[str, Replicated]:
    """Every node's replicated record for ``job`` (unreadable ones are logged and skipped)."""
    kvs, _ = coord.get_prefix(replicated_prefix(keys, job))
    out = {}
    for kv in kvs:
        try:
            rec = decode_replicated(kv.value, kv.key)
        except records.RecordError as exc:
            log.error("ignoring a replicated record of %s: %s", job, exc)
            continue
        out[rec.node] = rec
    return out


def record_commit(coord: Coordinator, keys: Keyspace, job: str, new: Committed,
                  attempts: int = 16) -> tuple[bool, Committed]:
    """Writes ``new`` unless the record already holds the same or a newer version.

    Returns:
        (written, the record now in force).

    Raises:
        CommitConflict: the record changed under every one of ``attempts`` compare-and-sets.
        coordination errors: etcd unreachable and such (the caller counts and retries later).
    """
    key = committed_key(keys, job)
    for _ in range(attempts):
        kv = coord.get(key)
        current = None
        if kv is not None:
            try:
                current = decode_committed(kv.value, key)
            except records.RecordError as exc:
                log.error("overwriting the unreadable committed record of %s: %s", job, exc)
        if current is not None and current.version >= new.version:
            return False, current
        ok, _ = coord.transaction([Compare(key, kv.mod_revision if kv else 0)],
                                  [Put(key, encode_committed(new))])
        if ok:
            return True, new
    raise CommitConflict(f"committed record of {job} changed under {attempts} attempts")


def update_holders(coord: Coordinator, keys: Keyspace, job: str, version: Version,
                   changes: Mapping[int, Iterable[str]], now: float,
                   attempts: int = 16) -> Committed | None:
    """Replaces the holders of some ranks in the committed record, only while it still records
    ``version`` (after a re-replication or a drain); returns the record in force, or None when
    there is none.

    Raises:
        CommitConflict: the record kept changing.
    """
    key = committed_key(keys, job)
    for _ in range(attempts):
        kv = coord.get(key)
        if kv is None:
            return None
        current = decode_committed(kv.value, key)
        if current.version != tuple(version):
            return current
        holders = dict(current.holders)
        holders.update({int(r): tuple(hs) for r, hs in changes.items()})
        if holders == dict(current.holders):
            return current
        new = dataclasses.replace(current, holders=holders, at=now)
        ok, _ = coord.transaction([Compare(key, kv.mod_revision)], [Put(key, encode_committed(new))])
        if ok:
            return new
    raise CommitConflict(f"committed record of {job} changed under {attempts} attempts")


def publish_placement(coord: Coordinator, keys: Keyspace, job: str, placement: Placement,
                      attempts: int = 8) -> bool:
    """Records ``placement`` unless the record already holds it or a newer round's.

    Every daemon of a round computes the same placement and calls this; the compare-and-set
    makes exactly one of them write it (the others find it equal). Round 0 means "unknown":
    such a record is replaced by any different placement.

    Returns:
        True when this call wrote the record.

    Raises:
        coordination errors: etcd unreachable and such.
    """
    key, raw = keys.job_placement(job), encode_placement(placement)
    for _ in range(attempts):
        kv = coord.get(key)
        if kv is not None:
            if kv.value == raw:
                return False
            try:
                current = decode_placement(kv.value, key).round
            except records.RecordError:
                current = -1
            if current > placement.round or current == placement.round != 0:
                return False  # a newer round's, or this round's written by another node
        if coord.compare_and_set(key, raw, kv.mod_revision if kv else 0):
            return True
    return False
