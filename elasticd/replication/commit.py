"""When a step is committed, and the records the replication layer keeps in etcd.

Each daemon records, for the ranks it owns, which snapshot versions reached ``m`` verified
copies (its own plus an acknowledgement from each of its ``m - 1`` placement peers), in one
record per node. A version is *committed* when every rank of the job has it: :func:`decide`
computes that from the records alone (a pure function), and :func:`commit_step` writes it with
a transaction that never moves the committed (generation, step) backwards, so any number of
daemons may race to record the same or different commits.

A version in a node's record may be *withdrawn* (:func:`withdraw`): a rank's two slots cannot
hold the committed step, an acknowledged newer one and the next snapshot, so an owner whose
acknowledged version waits too long for its commit takes it back before overwriting it. The
withdrawal bumps the node's fence key, and :func:`commit_step`'s transaction requires every
owner's fence to be unchanged since the records were read: a commit decided from a record that
still listed the withdrawn version cannot land after the withdrawal. (Without this a step could
be committed naming a holder that had already overwritten its copy.) Keys, under
``Keyspace.job_ckpt(job)``::

    replicated/<node>   record "ckpt_replicated": {node, round, ranks: {"<rank>":
                        {"versions": [[generation, step], ...] newest first (at most
                        KEEP_VERSIONS), "holders": [node, ...]}}, at, [skipped: versions
                        a local rank skipped or the node withdrew, so they can never commit;
                        newest first], [withdrawn: the versions the node withdrew, newest
                        first, kept apart so that skips do not push them out of the list]}
    committed           record "ckpt_committed": {generation, step, ranks: [rank, ...],
                        holders: {"<rank>": [node, ...]}, m, round, at}
    committed.grid      record "ckpt_grid": {grid, since: [generation, step]}: the snapshot
                        grid (:class:`Grid`)
    fence/<node>        record "ckpt_fence": {node, withdrawn: [[generation, step], ...], at};
                        only its mod_revision matters (changed by every withdrawal)

Both are overwritten in place, so etcd's footprint does not grow with the run's length. The
placement (``Keyspace.job_placement(job)``, record "placement") is published here too
(:func:`publish_placement`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterable, Mapping

from elasticd.coordination import records
from elasticd.coordination.api import Compare, Coordinator, Put
from elasticd.coordination.keys import Keyspace
from elasticd.replication.api import ReplicationError, Version
from elasticd.replication.placement import Placement, decode_placement, encode_placement

log = logging.getLogger(__name__)

#: Unreadable commit records are re-read every decision: each is logged once (shared with the
#: tracker's watch, which reads the same records).
complaints = records.Complaints(log)

COMMITTED_KIND = "ckpt_committed"
REPLICATED_KIND = "ckpt_replicated"
FENCE_KIND = "ckpt_fence"
#: Versions each node lists per rank: enough to find a common one among nodes a few steps apart.
KEEP_VERSIONS = 4
#: Skipped versions each node lists (the newest), for peers waiting on one of them.
KEEP_SKIPPED = 8
#: The snapshot grid (see :class:`Grid`): coarsest, in steps, and how many grid periods of
#: commits with no withdrawal before it halves.
MAX_GRID = 64
GRID_RELAX = 8
GRID_KIND = "ckpt_grid"
#: Withdrawn versions each node lists (the newest). Apart from the skipped ones: an owner
#: blocked by a pending commit skips a snapshot every step, and those skips pushed a withdrawal
#: out of the skipped list before a holder of the withdrawn copy asked about it; the holder then
#: refused every later copy of the rank (chaos run: no commit for 50 steps, then step 0).
KEEP_WITHDRAWN = 8


class CommitConflict(ReplicationError):
    """The committed record kept changing under a compare-and-set (too many racing writers)."""


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
    """One node's record: per owned rank, versions with ``m`` copies (newest first), holders;
    and the versions one of its ranks skipped or the node withdrew (newest first), which can
    never be committed."""

    node: str
    round: int
    versions: Mapping[int, tuple[Version, ...]]
    holders: Mapping[int, tuple[str, ...]]
    at: float = 0.0
    skipped: tuple[Version, ...] = ()
    withdrawn: tuple[Version, ...] = ()

    def never_committed(self) -> set[Version]:
        """The versions this record says can never be committed (skipped or withdrawn)."""
        return {*self.skipped, *self.withdrawn}


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
                         records.finite(body.get("at", 0.0), "at"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise records.CorruptRecord(f"{key!r}: invalid committed record ({exc})") from exc


def encode_replicated(r: Replicated) -> bytes:
    body: dict[str, Any] = {
        "node": r.node, "round": r.round, "at": r.at,
        "ranks": {str(k): {"versions": [list(v) for v in r.versions[k][:KEEP_VERSIONS]],
                           "holders": list(r.holders.get(k, ()))} for k in sorted(r.versions)}}
    if r.skipped:
        body["skipped"] = [list(v) for v in r.skipped[:KEEP_SKIPPED]]
    if r.withdrawn:
        body["withdrawn"] = [list(v) for v in r.withdrawn[:KEEP_WITHDRAWN]]
    return records.encode(REPLICATED_KIND, body)


def decode_replicated(raw: bytes, key: bytes | str = b"?") -> Replicated:
    """Raises: records.CorruptRecord, records.UnsupportedRecordVersion."""
    body = records.decode(raw, REPLICATED_KIND, key)
    try:
        versions, holders = {}, {}
        for rank, entry in body["ranks"].items():
            versions[int(rank)] = tuple((_int(g), _int(s)) for g, s in entry["versions"])
            holders[int(rank)] = tuple(_str(n) for n in entry.get("holders", ()))
        skipped = tuple((_int(g), _int(s)) for g, s in body.get("skipped", ()))
        withdrawn = tuple((_int(g), _int(s)) for g, s in body.get("withdrawn", ()))
        return Replicated(_str(body["node"]), _int(body.get("round", 0)), versions, holders,
                          records.finite(body.get("at", 0.0), "at"), skipped, withdrawn)
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


@dataclasses.dataclass(frozen=True)
class Grid:
    """The job's snapshot grid: local snapshots are taken only at steps that are multiples of
    ``grid`` (1: every step). ``since``: the version at which it last changed.

    Why: when commits take longer than a step, a node whose two slots hold the committed copy
    and an acknowledged one skips snapshots until it learns the commit or withdraws the
    acknowledged copy, and the nodes get there at different steps; each then snapshots the
    next step it reaches, their newest steps differ, nothing is common to commit, and each
    withdraws and unblocks again at another step (bench, 20 ms steps: 13 withdrawals per 23
    commits, 20-47 steps lost at a kill). Nodes a few steps apart take the same next grid step.
    The grid is one record for the job, so every node uses the same one: a withdrawal of a
    version newer than ``since`` doubles it (:func:`widen_grid`; once per divergence, since the
    first widening moves ``since`` past the others' withdrawn versions), and
    :data:`GRID_RELAX` grid periods of commits with no widening halve it (:func:`relax_grid`),
    so a job whose commits keep up snapshots every step.
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
        grid, (gen, step) = _int(body["grid"]), body["since"]
        if grid < 1 or grid > MAX_GRID or grid & (grid - 1):
            raise ValueError(f"grid {grid} is no power of two in 1..{MAX_GRID}")
        return Grid(grid, (_int(gen), _int(step)))
    except (KeyError, TypeError, ValueError) as exc:
        raise records.CorruptRecord(f"{key!r}: invalid grid record ({exc})") from exc


def _change_grid(coord: Coordinator, keys: Keyspace, job: str,
                 change: Callable[[Grid], Grid | None]) -> Grid | None:
    """Applies ``change`` to the stored grid (absent or unreadable: every step) with one
    compare-and-set; returns the grid written, or None (no change, or another node's write
    came first: its watch event brings that one)."""
    key = keys.job_commit_grid(job)
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
    ok, _ = coord.transaction([Compare(key, kv.mod_revision if kv is not None else 0)],
                              [Put(key, encode_grid(new))])
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
        record = progress.get(placement.owner_of(rank))
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
    kv = coord.get(keys.job_committed(job))
    if kv is None:
        return None
    try:
        return decode_committed(kv.value, kv.key)
    except records.RecordError as exc:
        complaints.warn(kv.key, kv.value, "ignoring the committed record of %s: %s", job, exc)
        return None


@dataclasses.dataclass(frozen=True)
class CommitState:
    """The job's commit records as one range read saw them.

    Attributes:
        committed_revision: mod_revision of the committed record (0: absent).
        fences: per node, the mod_revision of its fence key (absent: never withdrew).
    """

    progress: Mapping[str, Replicated]
    committed: Committed | None
    committed_revision: int
    fences: Mapping[str, int]


def read_state(coord: Coordinator, keys: Keyspace, job: str) -> CommitState:
    """Every commit record of ``job`` in one read (unreadable ones are logged and skipped)."""
    kvs, _ = coord.get_prefix(keys.job_ckpt(job))
    c_key, r_prefix = keys.job_committed(job), keys.job_replicated_prefix(job)
    f_prefix = keys.job_fence_prefix(job)
    progress: dict[str, Replicated] = {}
    fences: dict[str, int] = {}
    committed, revision = None, 0
    for kv in kvs:
        try:
            if kv.key == c_key:
                revision = kv.mod_revision
                committed = decode_committed(kv.value, kv.key)
            elif kv.key.startswith(r_prefix):
                rec = decode_replicated(kv.value, kv.key)
                if rec.node != kv.key[len(r_prefix):].decode(errors="replace"):
                    # One node's record may not speak for another.
                    raise records.CorruptRecord(f"{kv.key!r}: names node {rec.node[:70]!r}")
                progress[rec.node] = rec
            elif kv.key.startswith(f_prefix):
                fences[kv.key[len(f_prefix):].decode(errors="replace")] = kv.mod_revision
        except records.RecordError as exc:
            complaints.warn(kv.key, kv.value, "ignoring a commit record of %s: %s", job, exc)
    return CommitState(progress, committed, revision, fences)


def commit_step(coord: Coordinator, keys: Keyspace, job: str, placement: Placement, *,
                floor: int = 0, now: float = 0.0,
                attempts: int = 16) -> tuple[bool, Committed | None]:
    """Decides (:func:`decide`) and records the newest version every rank has with ``m``
    copies, unless the record already holds it or a newer one. The write is conditional on
    the committed record and every owner's fence being as read, so it never lands after a
    withdrawal it did not see; on a conflict the decision is made again from fresh records.

    Returns:
        (written, the record now in force or None).

    Raises:
        CommitConflict: the records changed under every one of ``attempts`` tries.
        coordination errors: etcd unreachable and such (the caller counts and retries later).
    """
    key = keys.job_committed(job)
    owners = sorted(n for n, rs in placement.ranks.items() if rs)
    for _ in range(attempts):
        state = read_state(coord, keys, job)
        current = state.committed
        new = decide(placement, state.progress, floor=floor, now=now)
        if new is None or (current is not None and new.version <= current.version):
            return False, current
        compares = [Compare(key, state.committed_revision)]
        compares += [Compare(keys.job_fence(job, n), state.fences.get(n, 0)) for n in owners]
        ok, _ = coord.transaction(compares, [Put(key, encode_committed(new))])
        if ok:
            return True, new
    raise CommitConflict(f"commit records of {job} changed under {attempts} attempts")


def withdraw(coord: Coordinator, keys: Keyspace, job: str, record: Replicated,
             withdrawn: Iterable[Version], now: float = 0.0) -> Committed | None:
    """Writes ``record`` (this node's, without the withdrawn versions) and bumps the node's
    fence in one transaction, then returns the committed record in force afterwards.

    From then on no commit decided from the earlier record can land (see
    :func:`commit_step`). A withdrawn version may have been committed just before: the caller
    compares it with the returned record and keeps its copy if so.

    Raises:
        coordination errors: nothing was withdrawn (the copy must then stay).
    """
    body = {"node": record.node, "withdrawn": sorted(list(v) for v in withdrawn), "at": now}
    coord.transaction([], [Put(keys.job_fence(job, record.node), records.encode(FENCE_KIND, body)),
                           Put(keys.job_replicated(job, record.node), encode_replicated(record))])
    return read_committed(coord, keys, job)


def record_commit(coord: Coordinator, keys: Keyspace, job: str, new: Committed,
                  attempts: int = 16) -> tuple[bool, Committed]:
    """Writes ``new`` unless the record already holds the same or a newer version (no fence
    check: for tools and tests that set a commit directly; daemons use :func:`commit_step`).

    Returns:
        (written, the record now in force).

    Raises:
        CommitConflict: the record changed under every one of ``attempts`` compare-and-sets.
        coordination errors: etcd unreachable and such.
    """
    key = keys.job_committed(job)
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
    key = keys.job_committed(job)
    for _ in range(attempts):
        kv = coord.get(key)
        if kv is None:
            return None
        current = decode_committed(kv.value, key)
        if current.version != tuple(version):
            return current
        holders = {**current.holders, **{int(r): tuple(hs) for r, hs in changes.items()}}
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
