"""Who coordinates a job's commits: one node, elected under a lease of its own.

The election key (``ckpt/committed.coordinator``, record "ckpt_coordinator": node, term, at) is
created only if absent (:func:`campaign`) and bound to the winner's election lease, so it goes
when the winner dies or freezes (one lease TTL), or resigns (:func:`resign`: a clean stop, or the
winner left the job's placement). Its ``term`` is a random number the winner drew: reports name
it, so a report meant for an earlier coordinator (even one elected before an etcd data loss,
when revisions restart) never counts for a later one. Its mod_revision is what every write of
the coordinator compares (:func:`elasticd.replication.commit.commit_txn`): a deposed coordinator
cannot write.

Every node of the job watches the key (it shares the committed record's prefix) and, when it
is absent, campaigns after :func:`campaign_delay`: the placement's first node at once, the
next ones a little later, so that one create usually settles it (no herd of N creates unless
the first few nodes are all gone).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from elasticd.coordination import records
from elasticd.coordination.api import Compare, Coordinator, Delete, Put
from elasticd.coordination.keys import Keyspace

KIND = "ckpt_coordinator"
#: Seconds between two candidates' campaigns, and the most a candidate waits.
CAMPAIGN_STEP = 0.05
CAMPAIGN_MAX = 0.4


@dataclasses.dataclass(frozen=True)
class Coordinatorship:
    """The election record as read: who coordinates, in which term, and the key's
    mod_revision (0 when not read from etcd)."""

    node: str
    term: int
    revision: int = 0
    at: float = 0.0


def encode(node: str, term: int, now: float) -> bytes:
    return records.encode(KIND, {"node": node, "term": term, "at": now})


def decode(raw: bytes, key: bytes | str = b"?", revision: int = 0) -> Coordinatorship:
    """Raises: records.CorruptRecord."""
    body = records.decode(raw, KIND, key)
    node, term = body.get("node"), body.get("term")
    try:
        if not isinstance(node, str) or type(term) is not int or term < 0:
            raise ValueError("node must be a string and term an integer >= 0")
        return Coordinatorship(node, term, revision, records.finite(body.get("at", 0.0), "at"))
    except ValueError as exc:
        raise records.CorruptRecord(f"{records.where_of(key)}: invalid coordinator record "
                                    f"({exc})") from exc


def campaign_delay(node: str, candidates: Sequence[str]) -> float:
    """Seconds ``node`` waits, after seeing no coordinator, before it campaigns."""
    try:
        return min(candidates.index(node) * CAMPAIGN_STEP, CAMPAIGN_MAX)
    except ValueError:
        return CAMPAIGN_MAX


def campaign(coord: Coordinator, keys: Keyspace, job: str, node: str, term: int, lease: int,
             now: float) -> int | None:
    """Creates the election key, bound to ``lease``, unless one exists; returns its
    mod_revision when this call won. Raises coordination errors (LeaseLost: ``lease`` gone)."""
    key = keys.replication(job).coordinator
    ok, revision = coord.transaction([Compare(key, 0)],
                                     [Put(key, encode(node, term, now), lease)])
    return revision if ok else None


def resign(coord: Coordinator, keys: Keyspace, job: str, revision: int) -> bool:
    """Deletes the election key if it is still the one written at ``revision``."""
    key = keys.replication(job).coordinator
    ok, _ = coord.transaction([Compare(key, revision)], [Delete(key)])
    return ok
