"""A recovery's timeline: where the seconds from a node's failure to training again went.

One record per failure (per job): the moments the recovery passed through (:data:`MARKS`; an
in-process recovery's: :data:`IN_PROCESS_MARKS`), each measured where it happens, and the
phases between them. What each moment is, where the unobservable failure is placed
(:data:`EVIDENCE`) and how an in-process recovery's phases differ: docs/recovery.md.

A moment that was not seen is missing (None), and so are the two phases beside it: nothing is
invented. A moment that came before the one preceding it is moved up to it and named in
``overlapped``: its phase took no time of its own. So the phases, when none is missing, add up
to ``total``.

:func:`assemble` is the pure assembly, :func:`decode` reads a stored one back with type checks
(a record anyone who may write to etcd could have forged). The daemon that writes it is
:mod:`elasticd.daemon.recovery_timeline`; it is stored as an event of kind ``timeline``
(:mod:`elasticd.cluster.events`), so the event log's retention bounds it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

from elasticd.coordination import records

#: The event kind a timeline is stored as.
KIND = "timeline"

#: The moments, in order (attributes ``<mark>_at`` of :class:`Timeline`).
MARKS = ("failure", "detected", "aborted", "round_closed", "restore_started",
         "restore_finished", "first_step")
#: The phases, in order: phase i runs from ``MARKS[i]`` to ``MARKS[i + 1]``. These are the
#: values of the ``phase`` label of ``elasticd_recovery_phase_seconds``.
PHASES = ("detect", "abort", "rendezvous", "start", "restore", "first_step")
#: The paths a recovery's writer's workers can take (:attr:`Timeline.path`).
PATHS = ("restart", "in_process")
#: An in-process recovery's moments, in order (``group_made`` is its own; the others are
#: :data:`MARKS`').
IN_PROCESS_MARKS = ("failure", "detected", "round_closed", "group_made", "restore_finished",
                    "first_step")
#: An in-process recovery's phases: phase i runs from ``IN_PROCESS_MARKS[i]`` to the next.
IN_PROCESS_PHASES = ("detect", "round_closed", "group", "restore", "first_step")
#: The reported moments of an in-process re-formation a timeline keeps (``Timeline.reform``).
REFORM_MOMENTS = ("learned", "reform_started", "rendezvous_returned", "round_closed",
                  "all_left", "left", "assigned", "group_made")


@dataclasses.dataclass(frozen=True)
class RankRestore:
    """One rank's restore, as its node recorded it (a ``recovered`` event).

    Attributes:
        at: wall time the restore ended (its node's clock).
        seconds: how long it took (the worker's own measure).
        source: local | peer | persistent.
        step: the step restored, if known.
        node: the node that restored it (the event's writer), if known.
        steps_lost: steps trained after ``step`` that were lost, if known.
        path: ``in_process`` (a survivor kept through the re-formation) or ``restart`` (a
            started worker); "" from a worker before ranks reported it.
    """

    job: str
    at: float
    seconds: float
    source: str
    nbytes: int = 0
    step: int | None = None
    rank: int | None = None
    node: str = ""
    steps_lost: int | None = None
    path: str = ""

    def entry(self) -> dict[str, Any]:
        """This rank's entry in a timeline's ``ranks`` (its stored and shown form)."""
        return {"rank": self.rank, "node": self.node, "source": self.source,
                "seconds": round(self.seconds, 3), "bytes": self.nbytes, "step": self.step,
                "steps_lost": self.steps_lost}


#: The kinds of a failed node's last sign of life (docs/recovery.md, where the failure is placed).
EVIDENCE = ("frame", "step", "record", "keepalive")
#: Each kind in words (where a recovery's failure is placed), and the words without a sign.
EVIDENCE_WORDS = {"frame": "its last replication frame received",
                  "step": "its last step trained with the others",
                  "record": "its node record's last write",
                  "keepalive": "its last keep-alive"}
NO_EVIDENCE = "a lease TTL before its detection"
#: Of those, the ones a survivor saw itself: the newest places the failure, to about a step.
MEASURED = ("frame", "step")
#: How much later than its last keep-alive plus the TTL a lease can be seen gone: etcd looks
#: for expired leases every 0.5 s, and the watch brings the deletion a moment later. The lease
#: alone thus places a failure between ``detected - TTL - EXPIRY_SLACK`` and the next
#: keep-alive's due time.
EXPIRY_SLACK = 0.75


@dataclasses.dataclass(frozen=True)
class Timeline:
    """One recovery (all times are wall-clock seconds; None: not seen). The fields mean what
    docs/elasticctl.md says of ``elasticctl history``'s ``timeline`` (a moment ``<mark>_at``
    there is ``marks[<mark>]``); besides them:

    Attributes:
        failure_latest_at: the latest the failure can have come when only the lease placed it
            (the next keep-alive was due then), else None.
        group_made_at: in-process: the moment its workers' new group was made, else None.
        failure_evidence, path: "" in a record written before they were kept.
        reform: of each moment, the slowest local worker's.
        rank_paths: the path each restored rank took (its rank, as text, to :data:`PATHS`):
            in a mixed round survivors are kept and newcomers start. Beside ``ranks``, not in
            its entries, so that a daemon of the release before still reads the record.
    """

    job: str
    failed: list[str]
    failure_at: float | None
    detected_at: float
    aborted_at: float | None = None
    round_closed_at: float | None = None
    restore_started_at: float | None = None
    restore_finished_at: float | None = None
    first_step_at: float | None = None
    restore_source: str = ""
    restore_bytes: int = 0
    ranks_restored: int = 0
    step: int | None = None
    overlapped: list[str] = dataclasses.field(default_factory=list)
    failure_evidence: str = ""
    failure_latest_at: float | None = None
    ranks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    path: str = ""
    group_made_at: float | None = None
    reform: dict[str, float] = dataclasses.field(default_factory=dict)
    rank_paths: dict[str, str] = dataclasses.field(default_factory=dict)

    def marks(self) -> list[float | None]:
        return [getattr(self, f"{m}_at") for m in MARKS]

    def path_phases(self) -> dict[str, float | None]:
        """Seconds per phase of the path taken: :data:`IN_PROCESS_PHASES` for an in-process
        recovery, :meth:`phases` for a restart (None: a moment at either end missing)."""
        if self.path != "in_process":
            return self.phases()
        m = [getattr(self, f"{name}_at") for name in IN_PROCESS_MARKS]
        return {name: (None if m[i] is None or m[i + 1] is None else round(m[i + 1] - m[i], 3))
                for i, name in enumerate(IN_PROCESS_PHASES)}

    def phases(self) -> dict[str, float | None]:
        """Seconds per phase (None when a moment at either end is missing)."""
        m = self.marks()
        return {name: (None if m[i] is None or m[i + 1] is None else round(m[i + 1] - m[i], 3))
                for i, name in enumerate(PHASES)}

    def detect_range(self) -> tuple[float, float] | None:
        """(shortest, longest) seconds the detection can have taken when only the lease placed
        the failure, else None (the detect phase is then measured from a sign of life)."""
        if self.failure_latest_at is None or self.failure_at is None:
            return None
        slack = EXPIRY_SLACK if self.failure_evidence == "keepalive" else 0.0
        return (round(max(0.0, self.detected_at - self.failure_latest_at), 3),
                round(self.detected_at - self.failure_at + slack, 3))

    @property
    def steps_lost(self) -> int | None:
        """The most steps any rank lost (None: not known)."""
        lost = [r["steps_lost"] for r in self.ranks if isinstance(r.get("steps_lost"), int)]
        return max(lost, default=None)

    @property
    def total(self) -> float | None:
        """Failure to first step (None until both are known)."""
        if self.failure_at is None or self.first_step_at is None:
            return None
        return round(self.first_step_at - self.failure_at, 3)

    def as_dict(self) -> dict[str, Any]:
        """The stored form (an event's ``data``)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One sentence for the event log."""
        parts = [f"{n} {'-' if s is None else f'{s:.2f}'}"
                 for n, s in self.path_phases().items()]
        total = "unfinished" if self.total is None else f"{self.total:.2f} s"
        how = " in-process" if self.path == "in_process" else ""
        kept = sum(p == "in_process" for p in self.rank_paths.values())
        if kept and kept < len(self.rank_paths):  # a mixed round: say who took which path
            how += f" ({kept} ranks kept, {len(self.rank_paths) - kept} started)"
        r = self.detect_range()
        placed = EVIDENCE_WORDS.get(self.failure_evidence, NO_EVIDENCE) + (
            "" if r is None else f"; detected {r[0]:.2f}-{r[1]:.2f} s after it")
        return (f"{self.job} recovered{how} from {', '.join(self.failed)}'s failure: {total} "
                f"({', '.join(parts)}; failure placed at {placed})")

    def summary(self) -> dict[str, Any]:
        """What ``elasticctl history`` shows of it (JSON)."""
        return {"job": self.job, "failed": list(self.failed), "phases": self.phases(),
                "total_seconds": self.total,
                "marks": {m: v for m, v in zip(MARKS, self.marks())},
                "restore_source": self.restore_source or None,
                "restore_bytes": self.restore_bytes, "ranks_restored": self.ranks_restored,
                "step": self.step, "overlapped": list(self.overlapped),
                "failure_evidence": self.failure_evidence or None,
                "detect_range": None if (r := self.detect_range()) is None else list(r),
                "steps_lost": self.steps_lost,
                "ranks": [dict(e, path=self.rank_paths.get(str(e["rank"])))
                          for e in self.ranks],
                "path": self.path or None, "path_phases": self.path_phases(),
                "reform": dict(self.reform)}


def assemble(*, job: str, failed: Iterable[str], detected_at: float,
             detection_seconds: float | None, lease_ttl: float | None,
             signs: Mapping[str, float | None] | None = None,
             aborted: Iterable[float] = (), round_closed: Iterable[float] = (),
             restores: Iterable[RankRestore] = (),
             first_steps: Iterable[float] = (), path: str = "restart",
             reform: Mapping[str, float] | None = None) -> Timeline:
    """Builds one recovery's timeline from what was seen (pure).

    Args:
        failed: the failed node(s), the record's key first.
        detected_at: the ``failed`` event's time.
        detection_seconds: the ``failed`` event's age of the dead node's last heartbeat record
            (at most the lease TTL).
        lease_ttl: the lease TTL (the dead node's last keep-alive came this long before its
            lease expired).
        signs: the failed node's last signs of life the writer saw, by kind (``frame``,
            ``step``: :data:`EVIDENCE`); None or later than ``detected_at``: not counted.
        aborted: every time the writer's workers were killed or died (its daemon's or its
            agent's abort, a worker's exit); these count from a lease TTL before the failure,
            as the failure's place is an estimate and a peer's death can kill them at once.
        round_closed: every time the writer saw a round of the job close.
        first_steps: every time a new group of the writer's workers made its first step.
        restores: rank restores (``recovered`` events) of any job and time.
        path: the path the writer's workers took (:data:`PATHS`).
        reform: in-process: the re-formation's moments its agent and workers reported
            (:data:`REFORM_MOMENTS`); their ``round_closed`` counts as a round close, their
            ``group_made`` is the group's moment (kept between the round close and the
            restore's start).

    Of each, the first at or after the failure counts (earlier ones belong to the recoveries
    before it), and of the first steps the first after the round closed (or the abort); restores
    count when they are ``job``'s, started at or after the failure and ended by the first step.
    """
    failure_at, evidence, latest = place_failure(detected_at, detection_seconds, lease_ttl,
                                                 signs or {})
    since = failure_at if failure_at is not None else detected_at

    reform = {k: float(v) for k, v in (reform or {}).items()
              if k in REFORM_MOMENTS and math.isfinite(v)}
    aborted_at = first_after(aborted, since - (lease_ttl or 0.0))
    closes = [*round_closed, *([reform["round_closed"]] if "round_closed" in reform else [])]
    closed_at = first_after(closes, since)
    # A new group steps after its round closed: an older step is the group before's.
    first_step_at = first_after(first_steps, closed_at or aborted_at or since)
    mine = [r for r in restores if r.job == job and r.at - r.seconds >= since
            and (first_step_at is None or r.at <= first_step_at)]
    steps = [r.step for r in mine if r.step is not None]
    raw = {
        "failure": failure_at, "detected": detected_at, "aborted": aborted_at,
        "round_closed": closed_at,
        "restore_started": min((r.at - r.seconds for r in mine), default=None),
        "restore_finished": max((r.at for r in mine), default=None),
        "first_step": first_step_at,
    }
    marks, overlapped, last = {}, [], None
    # The survivors may be training again before any daemon sees the lease expire (a peer
    # killed outright resets its sockets: the agents re-form at once, and the daemons leave a
    # group that already went on without it running). Then "detected" is the first moment
    # anything noticed, not the failed event, so that no later moment is invented: the first
    # step stays when it happened and ``total`` is the real failure-to-training time.
    later = [raw[m] for m in MARKS[MARKS.index("detected") + 1:] if raw[m] is not None]
    if first_step_at is not None and first_step_at < detected_at:
        raw["detected"] = max(min(later), failure_at if failure_at is not None else min(later))
        overlapped.append("detected")
    for name in MARKS:
        t = raw[name]
        if t is not None and last is not None and t < last:
            t = last
            overlapped.append(name)
        if t is not None:
            last = t
        marks[f"{name}_at"] = None if t is None else round(t, 3)
    if latest is not None:
        latest = round(min(max(latest, marks["failure_at"]), marks["detected_at"]), 3)
    ranks = sorted((r.entry() for r in mine),
                   key=lambda e: (e["rank"] is None, e["rank"] or 0, e["node"]))
    group_made = _group_made(path, reform.get("group_made"), marks)
    return Timeline(job=job, failed=list(failed), **marks,
                    restore_source="+".join(sorted({r.source for r in mine})),
                    restore_bytes=sum(r.nbytes for r in mine), ranks_restored=len(mine),
                    step=max(steps) if steps else None, overlapped=overlapped,
                    failure_evidence=evidence, failure_latest_at=latest, ranks=ranks,
                    path=path if path in PATHS else "restart", group_made_at=group_made,
                    reform={k: round(v, 3) for k, v in sorted(reform.items())}
                    if path == "in_process" else {},
                    rank_paths={str(r.rank): r.path for r in mine
                                if r.rank is not None and r.path})


def _group_made(path: str, at: float | None, marks: Mapping[str, float | None]) -> float | None:
    """An in-process recovery's group moment, kept between the round close and the restore's
    start (or the first step), as the other moments are kept in order; None otherwise."""
    if path != "in_process" or at is None or marks["round_closed_at"] is None:
        return None
    upper = marks["restore_started_at"] or marks["first_step_at"]
    at = max(at, marks["round_closed_at"])
    return round(at if upper is None else min(at, upper), 3)


def place_failure(detected_at: float, detection_seconds: float | None, lease_ttl: float | None,
                  signs: Mapping[str, float | None]) -> tuple[float | None, str, float | None]:
    """Where the failure goes: (its time, the evidence, the latest it can have come or None).

    A sign the writer saw itself (``frame``, ``step``: :data:`MEASURED`) places it, the newest
    of them, when the lease allows it (no earlier than its last keep-alive can have been:
    :data:`EXPIRY_SLACK`) and no later than the detection (a later sign is another life of the
    node, or a clock step). Otherwise the lease does: its record's last write when younger
    than the TTL, else one TTL before the detection; the failure then came before the next
    keep-alive was due (every TTL/3), which bounds it.
    """
    floor = (detected_at - lease_ttl - EXPIRY_SLACK
             if lease_ttl is not None and lease_ttl >= 0 else -math.inf)
    measured = {k: at for k, at in signs.items()
                if k in MEASURED and at is not None and math.isfinite(at)
                and floor <= at <= detected_at}
    if measured:
        # The newest; of equal ones, the more direct (EVIDENCE's order).
        kind = max(measured, key=lambda k: (measured[k], -EVIDENCE.index(k)))
        return measured[kind], kind, None
    if lease_ttl is None or lease_ttl < 0:
        if detection_seconds is None or detection_seconds < 0:
            return None, "", None
        return detected_at - detection_seconds, "record", None
    due = detected_at - lease_ttl + lease_ttl / 3.0  # the next keep-alive
    if detection_seconds is not None and 0 <= detection_seconds < lease_ttl:
        at = detected_at - detection_seconds
        return at, "record", min(detected_at, max(at, due))
    return detected_at - lease_ttl, "keepalive", min(detected_at, due)


def first_after(times: Iterable[float], since: float) -> float | None:
    """The earliest of ``times`` at or after ``since``."""
    return min((t for t in times if t >= since), default=None)


def restore_of(data: Mapping[str, Any], at: float, node: str = "") -> RankRestore | None:
    """A ``recovered`` event's data as a :class:`RankRestore` (None when it does not read:
    such events are written by any node, and read with type checks). ``node``: the event's."""
    job, seconds, source = data.get("job"), data.get("seconds"), data.get("source")
    nbytes, step = data.get("bytes", 0), data.get("step")
    rank, lost, path = data.get("rank"), data.get("steps_lost"), data.get("path") or ""
    if (not isinstance(job, str) or not isinstance(source, str) or path not in ("", *PATHS)
            or records.check_type(seconds, float) is not None or seconds < 0
            or records.check_type(nbytes, int) is not None
            or records.check_type(step, int | None) is not None
            or records.check_type(rank, int | None) is not None
            or records.check_type(lost, int | None) is not None):
        return None
    return RankRestore(job, at, float(seconds), source, nbytes, step, rank, node, lost, path)


def decode(data: Any, where: str = "timeline") -> Timeline:
    """Reads a stored timeline (an event's ``data``), checking every field's type and that the
    moments are in order.

    Raises:
        records.CorruptRecord: naming the first problem.
    """
    if not isinstance(data, dict):
        raise records.CorruptRecord(f"{where}: not an object")
    t = records.from_payload(Timeline, data, where)
    present = [v for v in t.marks() if v is not None]
    if any(b < a for a, b in zip(present, present[1:])) or not all(map(math.isfinite, present)):
        raise records.CorruptRecord(f"{where}: its moments are not in order")
    if not t.failed or t.restore_bytes < 0 or t.ranks_restored < 0:
        raise records.CorruptRecord(f"{where}: no failed node, or a negative count")
    if t.path not in ("", *PATHS):
        raise records.CorruptRecord(f"{where}: unknown path {t.path[:40]!r}")
    if t.group_made_at is not None and (
            not math.isfinite(t.group_made_at) or t.round_closed_at is None
            or t.group_made_at < t.round_closed_at
            or t.group_made_at > (t.restore_started_at or t.first_step_at or math.inf)):
        raise records.CorruptRecord(f"{where}: its group moment is out of order")
    if any(not k.isdigit() or v not in PATHS for k, v in t.rank_paths.items()):
        raise records.CorruptRecord(f"{where}: an unreadable rank path")
    if any(k not in REFORM_MOMENTS or not math.isfinite(v) for k, v in t.reform.items()):
        raise records.CorruptRecord(f"{where}: an unknown or unreadable re-formation moment")
    if t.failure_evidence not in ("", *EVIDENCE):
        raise records.CorruptRecord(f"{where}: unknown failure evidence "
                                    f"{t.failure_evidence[:40]!r}")
    if t.failure_latest_at is not None and (
            t.failure_at is None or not t.failure_at <= t.failure_latest_at <= t.detected_at):
        raise records.CorruptRecord(f"{where}: the failure's bound is out of order")
    for i, e in enumerate(t.ranks):
        r = records.from_payload(_RankEntry, e, where, f" of ranks[{i}]")
        if set(e) != set(_RANK_KEYS) or r.seconds < 0 or r.bytes < 0:
            raise records.CorruptRecord(f"{where}: ranks[{i}] is not a rank's restore")
    return t


@dataclasses.dataclass(frozen=True)
class _RankEntry:
    """The types of an entry of ``Timeline.ranks`` (:meth:`RankRestore.entry`)."""

    rank: int | None
    node: str
    source: str
    seconds: float
    bytes: int
    step: int | None
    steps_lost: int | None


_RANK_KEYS = tuple(f.name for f in dataclasses.fields(_RankEntry))
