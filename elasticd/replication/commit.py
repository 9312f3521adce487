"""The job's commit records in etcd and the transactions that write them.

A step is *committed* when every rank of the job has ``m`` verified copies of it. Which step
that is, is decided by the job's commit coordinator from the nodes' reports
(:mod:`elasticd.replication.tally`, :mod:`elasticd.replication.coordinator`) and written here,
by :func:`commit_txn`: one transaction that compares the coordinator's election key (a
deposed coordinator cannot write), the job's fence epoch (no withdrawal since the coordinator
listed the fences) and the committed record (never backwards, no concurrent writer).

The records under ``Keyspace.replication(job).ckpt`` (committed, committed.grid,
committed.coordinator, committed.ahead, placement, the fences), their fields and who writes
each: docs/replication.md ("etcd records"). Every node watches ``committed`` (a prefix: its four
keys); ``placement`` and the fences are read on demand; every key is overwritten in place. The
job's current placement (``Keyspace.replication(job).placement``) is published here too
(:func:`publish_placement`). The fences are :mod:`elasticd.replication.fences`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Iterable, Mapping

from elasticd.coordination import records
from elasticd.coordination.api import Compare, Coordinator, Put
from elasticd.coordination.keys import Keyspace
from elasticd.replication.api import ReplicationError, Version
from elasticd.replication.placement import Placement, decode_placement, encode_placement
from elasticd.replication.report import count_field, placement_digest, version_list

log = logging.getLogger(__name__)

#: Unreadable commit records are re-read every decision: each is logged once.
complaints = records.Complaints(log)

COMMITTED_KIND = "ckpt_committed"
#: Schema 2 of the committed record: holders derived from a placement (schema 1 listed every
#: rank's holders, and elasticd before the commit coordinator cannot read schema 2: the old
#: commit protocol is refused with "upgrade elasticd on this node").
COMMITTED_SCHEMA = 2
AHEAD_KIND = "ckpt_ahead"
GRID_KIND = "ckpt_grid"
#: Versions each node reports per rank: enough to find a common one among nodes a few steps
#: apart.
KEEP_VERSIONS = 4
#: Skipped versions each node reports (the newest), for peers waiting on one of them.
KEEP_SKIPPED = 8
#: Withdrawn versions each node reports and keeps in its fence record (the newest). Apart from
#: the skipped ones: an owner blocked by a pending commit skips a snapshot every step, and those
#: skips once pushed a withdrawal out of the skipped list before a holder of the withdrawn copy
#: asked about it; the holder then refused every later copy of the rank.
KEEP_WITHDRAWN = 8
#: The snapshot grid (see :class:`Grid`): coarsest, in steps, and how many grid periods of
#: commits with no withdrawal before it halves.
MAX_GRID = 64
GRID_RELAX = 8


class CommitConflict(ReplicationError):
    """The committed record kept changing under a compare-and-set (too many racing writers)."""


@dataclasses.dataclass(frozen=True)
class Committed:
    """A committed step: every rank's shard of (generation, step) had ``m`` verified copies.

    Attributes:
        holders: for each rank, the nodes holding a copy, the owner first (when ``resolved``;
            otherwise only ``overrides``: the placement they derive from was not at hand).
        placement: digest of the placement the holders derive from ("" when the record lists
            every rank's holders, as schema 1 did).
        overrides: the holders that differ from the placement's (after a re-replication or a
            drain).
        by: the coordinator that wrote it.
        at: wall-clock time of the commit (of the last holder change after a re-replication).
    """

    generation: int
    step: int
    ranks: tuple[int, ...]
    holders: Mapping[int, tuple[str, ...]]
    m: int = 2
    round: int = 0
    at: float = 0.0
    placement: str = ""
    overrides: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    by: str = ""
    resolved: bool = True

    @property
    def version(self) -> Version:
        return (self.generation, self.step)


_HOLDERS_CACHE: dict[str, Mapping[int, tuple[str, ...]]] = {}
_HOLDERS_LOCK = threading.Lock()


def placement_holders(placement: Placement,
                      digest: str | None = None) -> Mapping[int, tuple[str, ...]]:
    """Every rank's holders under ``placement`` (one shared mapping per placement, so that a
    job of thousands of ranks does not rebuild it per commit); ``digest``: its digest, when
    the caller has it."""
    digest = digest or placement_digest(placement)
    with _HOLDERS_LOCK:
        holders = _HOLDERS_CACHE.get(digest)
        if holders is None:
            holders = {r: placement.holders[o] for o, rs in placement.ranks.items() for r in rs}
            if len(_HOLDERS_CACHE) >= 8:
                _HOLDERS_CACHE.pop(next(iter(_HOLDERS_CACHE)))
            _HOLDERS_CACHE[digest] = holders
    return holders


def resolve(c: Committed, placements: Iterable[Placement | None]) -> Committed:
    """``c`` with every rank's holders, from the placement among ``placements`` whose digest
    it names (``c`` unchanged when none does)."""
    if c.resolved:
        return c
    for placement in placements:
        if placement is not None and placement_digest(placement) == c.placement:
            base = placement_holders(placement, c.placement)
            holders = {**base, **c.overrides} if c.overrides else base
            # Built field by field, not by dataclasses.replace (which looks the fields up at
            # each call): every node resolves the committed record at every commit.
            return Committed(c.generation, c.step, c.ranks, holders, c.m, c.round, c.at,
                             c.placement, c.overrides, c.by, True)
    return c


def commit_of(version: Version, placement: Placement, by: str, now: float) -> Committed:
    """The committed record of ``version`` under ``placement``, its holders the placement's."""
    ranks = tuple(sorted(r for rs in placement.ranks.values() for r in rs))
    return Committed(version[0], version[1], ranks, placement_holders(placement), placement.m,
                     placement.round, now, placement_digest(placement), {}, by)


def encode_committed(c: Committed) -> bytes:
    body: dict[str, Any] = {"generation": c.generation, "step": c.step, "m": c.m,
                            "round": c.round, "at": c.at}
    if c.ranks == tuple(range(len(c.ranks))):
        body["world"] = len(c.ranks)
    else:
        body["ranks"] = list(c.ranks)
    shown = c.overrides if c.placement else c.holders
    body["holders"] = {str(r): list(hs) for r, hs in sorted(shown.items())}
    if c.placement:
        body["placement"] = c.placement
    if c.by:
        body["by"] = c.by
    return records.encode(COMMITTED_KIND, body, schema=COMMITTED_SCHEMA)


def decode_committed(raw: bytes, key: bytes | str = b"?",
                     placements: Iterable[Placement | None] = ()) -> Committed:
    """Reads schema 1 and 2 records; holders are resolved from the one of ``placements`` the
    record names, when given.

    Raises: records.CorruptRecord, records.UnsupportedRecordVersion.
    """
    body = records.decode(raw, COMMITTED_KIND, key, schema=COMMITTED_SCHEMA)
    try:
        if "world" in body:
            ranks = _world(count_field(body["world"], "world"))
        elif isinstance(body["ranks"], list):
            ranks = tuple(count_field(r, "rank") for r in body["ranks"])
        else:
            raise ValueError("ranks is no list")
        listed = {int(r): tuple(_str(n) for n in hs) for r, hs in body["holders"].items()}
        digest = _str(body.get("placement", ""))
        c = Committed(count_field(body["generation"], "generation"),
                      count_field(body["step"], "step"), ranks, listed,
                      count_field(body.get("m", 2), "m"),
                      count_field(body.get("round", 0), "round"),
                      records.finite(body.get("at", 0.0), "at"), digest,
                      listed if digest else {}, _str(body.get("by", "")), not digest)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise records.CorruptRecord(f"{key!r}: invalid committed record ({exc})") from exc
    return resolve(c, placements)


@functools.lru_cache(maxsize=4)
def _world(size: int) -> tuple[int, ...]:
    """Ranks 0 .. size-1, one shared tuple per world size: every node decodes the committed
    record once per step (its watch event), and building 8,000 ranks anew cost ~70 us of the
    ~100 us a decode took at 1,000 nodes."""
    return tuple(range(size))


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r:.40}")
    return value


def encode_ahead(version: Version, now: float = 0.0) -> bytes:
    return records.encode(AHEAD_KIND, {"version": list(version), "at": now})


def decode_ahead(raw: bytes, key: bytes | str = b"?") -> Version:
    """Raises: records.CorruptRecord."""
    body = records.decode(raw, AHEAD_KIND, key)
    try:
        records.finite(body.get("at", 0.0), "at")
        return version_list([body["version"]], 1, "version")[0]
    except (KeyError, TypeError, ValueError) as exc:
        raise records.CorruptRecord(f"{key!r}: invalid ahead record ({exc})") from exc


def read_committed(coord: Coordinator, keys: Keyspace, job: str,
                   placements: Iterable[Placement | None] = ()) -> Committed | None:
    """The job's committed record with its holders, or None (absent or unreadable, which is
    logged). The placement its holders derive from is read beside it when none of
    ``placements`` is that one."""
    return committed_from(coord, keys, job, coord.get(keys.replication(job).committed), placements)


def committed_from(coord: Coordinator, keys: Keyspace, job: str, kv: Any,
                   placements: Iterable[Placement | None] = ()) -> Committed | None:
    """:func:`read_committed` of a record already read (``kv``; None: absent)."""
    if kv is None:
        return None
    try:
        c = decode_committed(kv.value, kv.key, placements)
    except records.RecordError as exc:
        complaints.warn(kv.key, kv.value, "ignoring the committed record of %s: %s", job, exc)
        return None
    if not c.resolved:
        c = resolve(c, [read_commit_placement(coord, keys, job)])
    return c


def read_commit_placement(coord: Coordinator, keys: Keyspace, job: str) -> Placement | None:
    """The placement stored beside the committed record (None: absent or unreadable)."""
    kv = coord.get(keys.replication(job).commit_placement)
    if kv is None:
        return None
    try:
        return decode_placement(kv.value, kv.key)
    except records.RecordError as exc:
        complaints.warn(kv.key, kv.value, "ignoring the commit placement of %s: %s", job, exc)
        return None


def commit_txn(keys: Keyspace, job: str, c: Committed, guards: tuple[int, int, int],
               placement: Placement | None = None,
               ahead: Version | None = None) -> tuple[list[Compare], list[Put]]:
    """The coordinator's commit: ``c``, conditional on its election key, the fence epoch and
    the committed record being at ``guards`` (their mod_revisions); with ``placement`` the
    placement its holders derive from, with ``ahead`` the ahead record, in the same
    transaction."""
    term, epoch, committed = guards
    compares = [Compare(keys.replication(job).coordinator, term),
                Compare(keys.replication(job).fence_epoch, epoch),
                Compare(keys.replication(job).committed, committed)]
    ops = [Put(keys.replication(job).committed, encode_committed(c))]
    if placement is not None:
        ops.append(Put(keys.replication(job).commit_placement, encode_placement(placement)))
    if ahead is not None:
        ops.append(Put(keys.replication(job).commit_ahead, encode_ahead(ahead, c.at)))
    return compares, ops


def record_commit(coord: Coordinator, keys: Keyspace, job: str, new: Committed,
                  attempts: int = 16) -> tuple[bool, Committed]:
    """Writes ``new`` unless the record already holds the same or a newer version (no fence
    check: for an etcd that lost its data, tools and tests; the coordinator uses
    :func:`commit_txn`). A record whose holders derive from a placement needs that placement
    stored beside it: the caller writes it (:func:`store_commit_placement`).

    Returns:
        (written, the record now in force).

    Raises:
        CommitConflict: the record changed under every one of ``attempts`` compare-and-sets.
    """
    key = keys.replication(job).committed
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
        if coord.compare_and_set(key, encode_committed(new), kv.mod_revision if kv else 0):
            return True, new
    raise CommitConflict(f"committed record of {job} changed under {attempts} attempts")


def update_holders(coord: Coordinator, keys: Keyspace, job: str, version: Version,
                   changes: Mapping[int, Iterable[str]], now: float,
                   attempts: int = 16) -> Committed | None:
    """Replaces the holders of some ranks in the committed record, only while it still records
    ``version`` (after a re-replication or a drain); returns the record in force (its holders
    resolved as :func:`read_committed` does), or None when there is none.

    Raises:
        CommitConflict: the record kept changing.
    """
    key = keys.replication(job).committed
    for _ in range(attempts):
        kv = coord.get(key)
        if kv is None:
            return None
        current = decode_committed(kv.value, key)
        if current.version != tuple(version):
            return read_committed(coord, keys, job)
        changed = {int(r): tuple(hs) for r, hs in changes.items()}
        if current.placement:
            new = dataclasses.replace(current, overrides={**current.overrides, **changed},
                                      at=now)
            same = dict(new.overrides) == dict(current.overrides)
        else:
            new = dataclasses.replace(current, holders={**current.holders, **changed}, at=now)
            same = dict(new.holders) == dict(current.holders)
        if not same and not coord.compare_and_set(key, encode_committed(new), kv.mod_revision):
            continue
        return read_committed(coord, keys, job)
    raise CommitConflict(f"committed record of {job} changed under {attempts} attempts")


@dataclasses.dataclass(frozen=True)
class Grid:
    """The job's snapshot grid: local snapshots are taken only at steps that are multiples of
    ``grid`` (1: every step). ``since``: the version at which it last changed.

    Why one grid for the job, and how it widens and relaxes: docs/replication.md ("The
    snapshot grid"). A withdrawal of a version newer than ``since`` doubles it
    (:func:`widen_grid`), :data:`GRID_RELAX` grid periods of commits with no widening halve it
    (:func:`relax_grid`, by the coordinator).
    """

    grid: int = 1
    since: Version = (0, 0)

    def relaxed(self, committed: Version) -> "Grid | None":
        """The halved grid once ``committed`` is :data:`GRID_RELAX` grid periods past
        ``since`` (or in a newer generation), else None."""
        if self.grid == 1 or tuple(committed) <= self.since:
            return None
        if committed[0] == self.since[0] and committed[1] - self.since[1] < GRID_RELAX * self.grid:
            return None
        return Grid(self.grid // 2, tuple(committed))  # type: ignore[arg-type]


def encode_grid(g: Grid) -> bytes:
    return records.encode(GRID_KIND, {"grid": g.grid, "since": list(g.since)})


def decode_grid(raw: bytes, key: bytes | str = b"?") -> Grid:
    """Raises: records.CorruptRecord (a grid that is no power of two in 1..MAX_GRID too)."""
    body = records.decode(raw, GRID_KIND, key)
    try:
        grid = count_field(body["grid"], "grid")
        if grid < 1 or grid > MAX_GRID or grid & (grid - 1):
            raise ValueError(f"grid {grid} is no power of two in 1..{MAX_GRID}")
        return Grid(grid, version_list([body["since"]], 1, "since")[0])
    except (KeyError, TypeError, ValueError) as exc:
        raise records.CorruptRecord(f"{key!r}: invalid grid record ({exc})") from exc


def _change_grid(coord: Coordinator, keys: Keyspace, job: str,
                 change: Callable[[Grid], Grid | None]) -> Grid | None:
    """Applies ``change`` to the stored grid (absent or unreadable: every step) with one
    compare-and-set; returns the grid written, or None (no change, or another node's write
    came first: its watch event brings that one)."""
    key = keys.replication(job).commit_grid
    kv = coord.get(key)
    current = Grid()
    if kv is not None:
        try:
            current = decode_grid(kv.value, key)
        except records.RecordError as exc:
            complaints.warn(kv.key, kv.value, "replacing the grid record of %s: %s", job, exc)
    new = change(current)
    if new is None or new == current:
        return None
    ok = coord.compare_and_set(key, encode_grid(new), kv.mod_revision if kv is not None else 0)
    return new if ok else None


def widen_grid(coord: Coordinator, keys: Keyspace, job: str, withdrawn: Version) -> Grid | None:
    """This node withdrew ``withdrawn`` (the nodes snapshot different steps): doubles the grid,
    unless it changed at or after that version (another node's withdrawal of the same
    divergence did it). Raises coordination errors."""
    def change(g: Grid) -> Grid | None:
        if tuple(withdrawn) <= g.since or g.grid >= MAX_GRID:
            return None
        return Grid(g.grid * 2, tuple(withdrawn))  # type: ignore[arg-type]

    return _change_grid(coord, keys, job, change)


def relax_grid(coord: Coordinator, keys: Keyspace, job: str, committed: Version) -> Grid | None:
    """``committed`` was committed: halves the grid once it has held for :data:`GRID_RELAX`
    grid periods with no widening. Raises coordination errors."""
    return _change_grid(coord, keys, job, lambda g: g.relaxed(committed))


def publish_placement(coord: Coordinator, keys: Keyspace, job: str, placement: Placement,
                      attempts: int = 8) -> bool:
    """Records ``placement`` unless the record already holds it or a newer round's.

    Every daemon of a round computes the same placement and calls this; the compare-and-set
    makes exactly one of them write it (the others find it equal). Round 0 means "unknown":
    such a record is replaced by any different placement.

    Returns:
        True when this call wrote the record.
    """
    key, raw = keys.replication(job).placement, encode_placement(placement)
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
