"""A node's drain record: the request ``elasticctl drain NODE`` writes to
``<prefix>/drain/<node>``, and the progress the node's daemon writes into it
(:class:`elasticd.recovery.drain.Drainer`).

States (``DrainRecord.state``, a :class:`DrainState`): requested → draining → drained |
failed. A drained node stays out of every job until the record is deleted (``elasticctl drain
--undo NODE``). The CLI and the daemon both use this module: it imports neither.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from elasticd.coordination import records
from elasticd.coordination.api import Compare, CoordinationError, Coordinator, Put
from elasticd.coordination.keys import Keyspace, check_name

log = logging.getLogger(__name__)

KIND = "drain"


class DrainState(records.ValueEnum):
    """REQUESTED → DRAINING → DRAINED | FAILED; a new request replaces a FAILED record. A
    member is its string (JSON, comparisons, formatting)."""

    REQUESTED = "requested"
    DRAINING = "draining"
    DRAINED = "drained"
    FAILED = "failed"


class DrainPhase(records.ValueEnum):
    """The step a drain is at: NONE (not started) → SNAPSHOT → REPLICAS → STOPPING → DONE
    (DONE for a drained and a failed drain alike). A member is its string."""

    NONE = ""
    SNAPSHOT = "snapshot"
    REPLICAS = "replicas"
    STOPPING = "stopping"
    DONE = "done"


FINAL = (DrainState.DRAINED, DrainState.FAILED)
#: Progress entries kept in a drain record.
LOG_LIMIT = 40


@dataclasses.dataclass(frozen=True)
class DrainRecord:
    """A drain request and its progress, as stored in etcd.

    Attributes:
        requested_at: wall time of the request.
        by: who asked (``elasticctl@host``).
        timeout: seconds the daemon may spend handing off replicas.
        phase: the step running now, a :class:`DrainPhase`.
        detail: one human sentence about where the drain is.
        copies_done, copies_failed, copies_planned: replica hand-off progress.
        updated_at: wall time of the last progress write.
        jobs: what the hand-off did per job (version, complete, pushed/failed counts).
        log: the progress so far, ``[at, state, phase, detail]`` oldest first (bounded), so a
            reader polling slower than the drain moves still sees every step.
    """

    node: str
    state: DrainState = DrainState.REQUESTED
    requested_at: float = 0.0
    by: str = ""
    timeout: float = 120.0
    phase: DrainPhase = DrainPhase.NONE
    detail: str = ""
    copies_done: int = 0
    copies_failed: int = 0
    copies_planned: int = 0
    updated_at: float = 0.0
    jobs: dict[str, Any] = dataclasses.field(default_factory=dict)
    log: list[list[Any]] = dataclasses.field(default_factory=list)

    def encode(self) -> bytes:
        return records.encode_dataclass(KIND, self)

    @staticmethod
    def decode(raw: bytes, key: bytes | str = b"?", node: str | None = None) -> "DrainRecord":
        """Reads a drain record (about ``node``, the node its key names, when given)."""
        rec = records.decode_dataclass(DrainRecord, raw, KIND, key)
        where = records.where_of(key)
        if rec.state not in list(DrainState):
            raise records.CorruptRecord(f"{where}: unknown drain state {rec.state[:40]!r}")
        if rec.phase not in list(DrainPhase):
            raise records.CorruptRecord(f"{where}: unknown drain phase {rec.phase[:40]!r}")
        if node is not None and rec.node != node:
            raise records.CorruptRecord(f"{where}: the record names node {rec.node[:70]!r}, "
                                        f"its key {node!r}")
        if not 0 <= rec.timeout <= 86_400:
            raise records.CorruptRecord(f"{where}: timeout {rec.timeout} out of range "
                                        "(0 to 86400 s)")
        return dataclasses.replace(rec, state=DrainState(rec.state), phase=DrainPhase(rec.phase))


def read(coord: Coordinator, keys: Keyspace, node: str) -> DrainRecord | None:
    """The node's drain record, or None. Raises: CoordinationError, records.RecordError."""
    kv = coord.get(keys.drain(node))
    return None if kv is None else DrainRecord.decode(kv.value, kv.key, node)


def read_all(coord: Coordinator, keys: Keyspace) -> dict[str, DrainRecord]:
    """Every readable drain record by node (unreadable ones are skipped with a warning)."""
    kvs, _ = coord.get_prefix(keys.drains)
    out = {}
    for kv in kvs:
        try:
            node = check_name("node id in key", kv.key[len(keys.drains):].decode(errors="replace"))
            rec = DrainRecord.decode(kv.value, kv.key, node)
        except (ValueError, records.RecordError) as exc:
            log.warning("skipping drain record: %s", exc)
            continue
        out[rec.node] = rec
    return out


def request(coord: Coordinator, keys: Keyspace, node: str, timeout: float, by: str,
            now: float) -> DrainRecord:
    """Writes a drain request unless one is under way or done; returns the record in force.

    A failed drain is replaced by the new request (a retry).
    """
    waiting = "waiting for the daemon"
    new = DrainRecord(node, DrainState.REQUESTED, now, by, timeout, "", waiting, updated_at=now,
                      log=[[round(now, 3), DrainState.REQUESTED, "", waiting]])
    key = keys.drain(node)
    for _ in range(5):
        kv = coord.get(key)
        if kv is None:
            if coord.create(key, new.encode()):
                return new
            continue
        old = DrainRecord.decode(kv.value, kv.key)
        if old.state != DrainState.FAILED:
            return old
        ok, _ = coord.transaction([Compare(key, kv.mod_revision)], [Put(key, new.encode())])
        if ok:
            return new
    raise CoordinationError(f"{key.decode()}: the drain record kept changing; retry")


def undo(coord: Coordinator, keys: Keyspace, node: str) -> DrainRecord | None:
    """Deletes the node's drain record (it may run jobs again); returns what was there."""
    kv = coord.get(keys.drain(node))
    if kv is None:
        return None
    coord.delete(keys.drain(node))
    try:
        return DrainRecord.decode(kv.value, kv.key)
    except records.RecordError:
        return None
