"""What the checkpoint service remembers per job (:class:`JobBook`, which both its sides share
under its lock), the check of each field a worker sends (:func:`param`: bad input is one
:class:`RequestError`), and the calls out to hooks and the metrics sink that never fail an op."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any

from elasticd.store.api import Slot
from elasticd.store.protection import Unprotected
from elasticd.local.wire import RequestError

log = logging.getLogger(__name__)


#: Consecutive snapshot gaps the tier's staleness bound looks back over.
GAPS = 8


@dataclasses.dataclass
class JobRecord:
    """One job's checkpoint state on this node."""

    world_size: int = 0
    local_world_size: int | None = None
    uid: int | None = None
    ranks: set[int] = dataclasses.field(default_factory=set)
    slots: dict[int, Slot] = dataclasses.field(default_factory=dict)
    nbytes: dict[int, int] = dataclasses.field(default_factory=dict)
    failing: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> last failure
    warned: bool = False
    first_snapshot_at: float | None = None  # monotonic
    protection: Unprotected | None = None
    progress: tuple[int, int] | None = None
    offered: tuple[int, int] = (-1, -1)
    refused: set[tuple[int, int, int]] = dataclasses.field(default_factory=set)
    last_restore: dict[str, Any] | None = None
    # Shards (rank, generation, step) that reached this store from a peer: still "peer" when
    # a rank opens them again after the fetch.
    fetched: set[tuple[int, int, int]] = dataclasses.field(default_factory=set)
    generation_started: int = -1
    scratch_refused: int = 0  # partial copies refused over the job's scratch cap
    # For the persistent tier's staleness (protection.JobView): the first step seen here, the
    # steps between the last GAPS pairs of consecutive steps reached in one generation (recent
    # ones only: a grid that widened under load once and narrowed again must not loosen the
    # bound for the rest of the job), the newest complete tier step the last assessment knew,
    # and since when the job is past it.
    first_step: int | None = None
    gaps: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=GAPS))
    persist_seen: tuple[int, int] | None = None
    unpersisted_since: float | None = None

    @property
    def grid(self) -> int:
        """The most steps between two of the job's recent consecutive snapshots here (0: none)."""
        return max(self.gaps, default=0)

    def reached(self, version: tuple[int, int]) -> None:
        """The job reached ``version`` (a snapshot asked for, taken, or held at a restart)."""
        old = self.progress
        if old is not None and old[0] == version[0] and version[1] > old[1]:
            self.gaps.append(version[1] - old[1])
        if self.first_step is None:
            self.first_step = version[1]
        self.progress = max(old or version, version)


@dataclasses.dataclass(frozen=True)
class ServiceDeps:
    """What the service's two sides are given of the node (the service's arguments, see
    :class:`~elasticd.store.service.CheckpointService`)."""

    store: Any
    persist: Any
    replicator: Any
    node_id: str
    clock: Any
    sink: Any


class JobBook:
    """The service's per-job records and op counters, under the one lock the service, its
    snapshot side and its restore side take (a reservation, a restore and the protection
    assessment read and write the same job's record).

    Attributes:
        lock: held around every read and write of ``jobs`` and ``counters``.
        jobs: job -> its record (made on first use).
        counters: op outcomes (``snapshots``, ``skipped_<reason>``, ``restores_<source>``...).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: collections.defaultdict[str, JobRecord] = collections.defaultdict(JobRecord)
        self.counters: collections.Counter[str] = collections.Counter()

    def unprotected(self, job: str | None) -> str:
        """``UNPROTECTED: <detail>`` while ``job`` is unprotected on this node, else ""."""
        with self.lock:
            record = self.jobs.get(job) if job is not None else None
            verdict = None if record is None else record.protection
        return str(verdict) if verdict is not None else ""


def emit(sink: Any, method: str, *args: Any) -> None:
    """Calls ``sink.<method>(*args)`` when the metrics sink has it; a failure is logged."""
    fn = getattr(sink, method, None)
    if fn is not None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 — metrics must never fail a snapshot
            log.exception("checkpoint metrics sink %s failed", method)


def param(msg: dict[str, Any], key: str, kind: type, default: Any = ...) -> Any:
    """``msg[key]``, checked to be a ``kind`` (an int: non-negative); ``default`` when absent."""
    value = msg.get(key, default)
    if value is ...:
        raise RequestError(f"request lacks {key!r}")
    if value is default and default is not ...:
        return value
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind or (kind is int and value < 0):
        raise RequestError(f"{key!r} must be a {'non-negative ' if kind is int else ''}"
                           f"{kind.__name__}, got {value!r:.60}")
    return value

