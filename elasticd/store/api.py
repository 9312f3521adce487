"""What the checkpoint store hands out and the errors it raises, apart from the machinery.

The daemon loop, the replication server and the worker-facing endpoint all handle these types;
they live here so that none of them needs the store's internals (:mod:`elasticd.store.shm`).
Snapshot-format errors (:class:`~elasticd.snapshot.format.SnapshotError` and its subclasses)
live with the format. No torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from elasticd.errors import CheckpointError


class SlotStoreError(CheckpointError):
    """Base class of the slot store's errors."""


class OverBudget(SlotStoreError):
    """A reservation would take the node over its memory cap (or the filesystem is full)."""


class ScratchOverCap(OverBudget):
    """A partial copy (or a reservation for one) would take a job's restore scratch over its
    per-job cap (:mod:`elasticd.store.scratch`)."""


class SlotBusy(SlotStoreError):
    """The only free slot is pinned by a reader (e.g. replication still sending it)."""


class CommitPending(SlotBusy):
    """Both slots of a rank hold copies that must stay: the committed step and a newer copy a
    peer acknowledged, which may still be committed. The snapshot is skipped until that copy is
    committed or withdrawn (:meth:`SlotStore.unprotect`).

    Attributes:
        version: the acknowledged copy in the way, (generation, step).
        held: every copy held for the rank that is not the commit (``version`` among them).
    """

    def __init__(self, message: str, version: tuple[int, int],
                 held: tuple[tuple[int, int], ...] = ()):
        super().__init__(message)
        self.version, self.held = version, held


class StaleSlot(SlotStoreError):
    """``complete`` was given a slot that has since been reserved again or removed."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """A reservation: write the snapshot's payload into ``buffer`` (or into ``path`` mapped by
    another process), then hand it back to :meth:`SlotStore.complete`.

    Attributes:
        path: the file; it changes whenever the slot is re-allocated (grown), so a worker can
            cache its own mapping keyed on the path.
        capacity: the file's size in bytes (at least what was reserved).
        buffer: the daemon's writable mapping of the whole file.
        ticket: identifies this reservation.
        newest: a slot of the rank's newest pair (:meth:`SlotStore.reserve` with ``newest``):
            the copy stays on this node, for an in-process survivor's own restore; it is
            neither replicated nor persisted.
    """

    job: str
    rank: int
    path: str
    capacity: int
    buffer: memoryview = dataclasses.field(repr=False)
    ticket: int = 0
    newest: bool = False


@dataclasses.dataclass(frozen=True)
class ScanResult:
    """What :meth:`SlotStore.scan` found: kept snapshots as (job, rank, generation, step), and
    the paths it removed with the reason."""

    kept: list[tuple[str, int, int, int]]
    removed: list[tuple[str, str]]


class CommittedStep(Protocol):
    """The committed step as the store reads it (:class:`elasticd.replication.commit.Committed`)."""

    generation: int
    step: int
    ranks: Any  # the ranks that snapshotted the step (a collection of ints)


class Fetched(Protocol):
    """A shard fetched into this node's store (:class:`elasticd.recovery.fetch.FetchResult`)."""

    holder: str
    wire_bytes: int
    #: A partial copy's scratch segment (a fetch with ``need``), else None.
    scratch: Any


class Replication(Protocol):
    """What the checkpoint service asks of the node's replication, when there is one (the
    :class:`~elasticd.recovery.replicator.Replicator`; the unit tests fake it). The store
    never imports the replicator: the node builder hands one in.

    Four members have defaults here, for a replication that keeps no replicas, takes every
    step and commits nothing (a fake subclasses this class to get them): ``sink``,
    :meth:`snapshot_grid`, :meth:`add_commit_listener` and :meth:`follows_commits`.
    """

    #: The replica store whose copies ``ckpt_list`` reports and ``ckpt_open`` hands over
    #: (a :class:`~elasticd.replication.api.Sink`), or None.
    sink: Any = None

    def snapshot_grid(self, job: str) -> int:
        """Local snapshots of ``job`` are taken only at multiples of this step count."""
        return 1

    def add_commit_listener(self, listener: Any) -> None:
        """Calls ``listener(job, version)`` for each newer commit learned, in order (the
        committed copy stays in this node's slots until the next one)."""

    def follows_commits(self, job: str) -> bool:
        """Whether this node's snapshots of ``job`` are committed: with a commit listener, the
        persistent tier's flushes then follow the commits."""
        return False

    def status(self) -> dict[str, Any]:
        """``{"jobs": {job: {...committed, placement, sync lag...}}}`` for protection checks."""

    def committed(self, job: str) -> CommittedStep | None:
        """The job's committed record as etcd holds it now. Raises: CoordinationError."""

    def fetch_to_local(self, job: str, rank: int, version: tuple[int, int] | None,
                       need: Any = None) -> Fetched:
        """Fetches a shard from a holder into this node's store; with ``need`` (a new rank's
        local boxes) only the rows they overlap, into a scratch segment the result carries as
        ``scratch``. Raises: :class:`~elasticd.errors.ShardLost`, the store's errors
        when it has no room, ValueError for a malformed ``need``."""

    def start_generation(self, job: str, generation: int) -> None:
        """A restore from the persistent tier opened ``generation``."""

    def on_local_snapshot(self, job: str, rank: int, version: tuple[int, int]) -> None:
        """A local snapshot completed: replicate it (returns at once)."""

    def on_commit_pending(self, job: str, version: tuple[int, int],
                          skipped: tuple[int, int] | None = None) -> None:
        """A snapshot was skipped because ``version`` awaits its commit in the slot it needs."""
